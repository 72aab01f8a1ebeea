"""Builders for the EPP's tests: a binding table, and ext_proc messages in Envoy's order."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from sessionfleet.router.bindings import BindingTable
from sessionfleet.router.identity import session_object_name

MODES = processing_mode_pb2.ProcessingMode
MODEL = "m"


def worker(
    name: str, ip: str, *, model: str = MODEL, phase: str = "Ready", max_sessions: int = 4
) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {"model": model, "capacity": {"maxSessions": max_sessions}},
        "status": {"phase": phase, "endpoint": f"http://{ip}:8000"},
    }


def session(
    sid: str, worker: str | None, *, phase: str | None = "Bound", model: str = MODEL
) -> dict[str, Any]:
    status: dict[str, Any] = {}
    if worker:
        status["worker"] = worker
    if phase:
        status["phase"] = phase
    return {
        "metadata": {"name": session_object_name(sid, None), "resourceVersion": "1", "uid": sid},
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


def _header_map(headers: dict[str, str]) -> Any:
    return base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
    )


def request_headers(
    headers: dict[str, str],
    *,
    end: bool = False,
    subset: list[str] | None = None,
    mode: int | None = None,
    response_mode: int | None = None,
) -> Any:
    message = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=_header_map({":method": "POST", ":path": "/v1/chat/completions", **headers}),
            end_of_stream=end,
        )
    )
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        message.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    if mode is not None:
        message.protocol_config.CopyFrom(
            pb.ProtocolConfiguration(
                request_body_mode=mode,
                response_body_mode=response_mode if response_mode is not None else mode,
            )
        )
    return message


def request_body(data: bytes, end: bool) -> Any:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end))


def response_headers(
    status: int = 200,
    *,
    served: str | None = None,
    served_header: str | None = None,
    event_stream: bool = False,
    end: bool = False,
) -> Any:
    headers = {":status": str(status)}
    headers["content-type"] = "text/event-stream" if event_stream else "application/json"
    if served_header:
        headers["x-gateway-destination-endpoint-served"] = served_header
    message = pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(headers=_header_map(headers), end_of_stream=end)
    )
    if served is not None:
        lb = struct_pb2.Struct()
        lb.update({"x-gateway-destination-endpoint-served": served})
        message.metadata_context.filter_metadata["envoy.lb"].CopyFrom(lb)
    return message


def response_body(data: bytes, end: bool) -> Any:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=end))


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


def set_headers(common: Any) -> dict[str, str]:
    return {o.header.key: o.header.raw_value.decode() for o in common.header_mutation.set_headers}


def destination_of(answer: Any) -> tuple[str, str]:
    """Return (header value, dynamic metadata value) of a deciding answer."""
    kind = answer.WhichOneof("response")
    common = getattr(answer, kind).response
    header = set_headers(common)["x-gateway-destination-endpoint"]
    metadata = answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    return header, metadata["x-gateway-destination-endpoint"].string_value


def immediate_of(answer: Any) -> tuple[int, dict[str, str], dict[str, Any]]:
    """Return (status, headers, JSON body) of an ImmediateResponse."""
    assert answer.WhichOneof("response") == "immediate_response"
    response = answer.immediate_response
    headers = {o.header.key: o.header.raw_value.decode() for o in response.headers.set_headers}
    return response.status.code, headers, json.loads(response.body)
