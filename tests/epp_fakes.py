"""Builders for the EPP's tests: a binding table and bodies; the ext_proc messages in
Envoy's order come from :mod:`epp_client`."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from typing import Any

from epp_client import (  # the messages, as Envoy builds them; re-exported
    MODES,
    destination_of,
    immediate_of,
    request_body,
    request_headers,
    response_body,
    response_headers,
    set_headers,
)

from sessionfleet.fronts.bindings import BindingTable
from sessionfleet.fronts.identity import session_object_name

__all__ = [
    "MODEL",
    "MODES",
    "USAGE",
    "chat_body",
    "completion",
    "destination_of",
    "immediate_of",
    "request_body",
    "request_headers",
    "response_body",
    "response_headers",
    "session",
    "set_headers",
    "sse_chunks",
    "table",
    "worker",
    "fleet",
]

MODEL = "m"


def worker(
    name: str, ip: str, *, model: str = MODEL, phase: str = "Ready", max_sessions: int = 4
) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {"model": model, "capacity": {"maxSessions": max_sessions}},
        "status": {"phase": phase, "endpoint": f"http://{ip}:8000"},
    }


VERSIONS = itertools.count(1)


def session(
    sid: str, worker: str | None, *, phase: str | None = "Bound", model: str = MODEL
) -> dict[str, Any]:
    """An AgentSession as the API server returns it: each one a new resourceVersion."""
    status: dict[str, Any] = {}
    if worker:
        status["worker"] = worker
    if phase:
        status["phase"] = phase
    return {
        "metadata": {
            "name": session_object_name(sid, None),
            "resourceVersion": str(next(VERSIONS)),
            "uid": sid,
        },
        "spec": {"sessionId": sid, "model": model},
        "status": status,
    }


def table(
    workers: Sequence[dict[str, Any]], sessions: Sequence[dict[str, Any]] = ()
) -> BindingTable:
    bindings = BindingTable()
    bindings.replace_workers(workers)
    bindings.replace_sessions(sessions)
    return bindings


def fleet(sessions: Sequence[dict[str, Any]] = ()) -> BindingTable:
    """Three Ready workers of model m at 10.0.0.1-3, and the given sessions."""
    return table([worker(f"w-{i}", f"10.0.0.{i}") for i in (1, 2, 3)], list(sessions))


def chat_body(model: str = MODEL, *, stream: bool = False) -> bytes:
    return json.dumps(
        {"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi " * 50}]}
    ).encode()


USAGE = {
    "prompt_tokens": 120,
    "completion_tokens": 7,
    "prompt_tokens_details": {"cached_tokens": 100},
}


def completion() -> bytes:
    return json.dumps(
        {"id": "c", "object": "chat.completion", "choices": [], "usage": USAGE}
    ).encode()


def sse_chunks() -> list[bytes]:
    content = {"choices": [{"delta": {"content": "hello"}}], "usage": None}
    final = {"choices": [], "usage": USAGE}
    return [
        b"data: " + json.dumps(content).encode() + b"\n\n",
        b"data: " + json.dumps(final).encode() + b"\n\n",
        b"data: [DONE]\n\n",
    ]
