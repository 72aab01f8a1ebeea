"""The ``engine`` driver: the engine itself exports and imports its KV cache.

The simulated engine writes its cache (or one session's blocks) to a directory with
``POST /sim/cache/export`` and loads one with ``POST /sim/cache/import`` or at start
with ``--import-cache DIR``. The directory must be on storage both the old and the new
pod mount at the same path (the worker's ``checkpoint.storage``: a ReadWriteMany
volume; on the local demo cluster, a directory of the machine). A session's blocks go to
a directory named like its AgentSession (a DNS-safe part of its id and a hash), never
to the raw id: a client picks its session id, ``../..`` included.

vLLM saves its KV to its KV store as it serves (the pod builder configures the
connector and a fixed ``PYTHONHASHSEED``; docs/kvstore.md): every completed prefix
block is written behind the turn that computed it, and any engine of the model loads
any saved prefix. So for vLLM a save copies nothing; it asks the engine's store, through
vLLM's own request channel (``kv_transfer_params``, answered by the connector), what it
holds for the checkpoint's sessions, and records that: tokens per session and bytes.
A load needs nothing either: the session's next turn loads its prefix.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from sessionfleet.api import CheckpointDriver, EngineType
from sessionfleet.checkpoint.driver import (
    CheckpointOutcome,
    CheckpointTarget,
    DriverError,
    WriteGate,
    check_gate,
)
from sessionfleet.checkpoint.paths import session_directory
from sessionfleet.engines.kvstore_wire import CONTROL_KEY


class UnknownToEngine(DriverError):
    """The engine holds nothing for a session (it has had no turn there): nothing to save."""


class EngineDriver:
    """Checkpoints through the engine's own export and import."""

    name = CheckpointDriver.ENGINE

    def __init__(
        self,
        http: httpx.AsyncClient,
        timeout: float = 120.0,
        *,
        write_gate: WriteGate | None = None,
    ) -> None:
        self.http = http
        self.timeout = timeout
        self.write_gate = write_gate
        """Asked before every call to an engine.

        See :func:`sessionfleet.checkpoint.driver.check_gate`.
        """

    async def _call(self, target: CheckpointTarget, path: str, body: dict[str, Any]) -> Any:
        check_gate(self.write_gate, f"engine at {target.endpoint}: {path}")
        try:
            response = await self.http.post(
                f"{target.endpoint}{path}", json=body, timeout=self.timeout
            )
        except httpx.HTTPError as error:
            raise DriverError(f"engine at {target.endpoint} unreachable: {error!r}") from error
        if response.status_code == 404 and "session" in body and _not_found(response):
            raise UnknownToEngine(f"engine at {target.endpoint}: {response.text[:300]}")
        if response.is_error:
            raise DriverError(
                f"engine at {target.endpoint} answered {response.status_code} to {path}: "
                f"{response.text[:300]}"
            )
        return response.json()

    async def save(self, target: CheckpointTarget) -> CheckpointOutcome:
        """Export the engine's cache (or the target's sessions) to ``target.location``."""
        if target.engine is EngineType.VLLM:
            return await self._report(target)
        started = time.monotonic()
        sessions: dict[str, int] = {}
        size = 0
        for session in target.sessions or (None,):
            directory = _directory(target.location, session)
            body: dict[str, Any] = {"directory": directory}
            if session is not None:
                body["session"] = session
            try:
                answer = await self._call(target, "/sim/cache/export", body)
            except UnknownToEngine:
                # A session bound here that has had no turn yet has no cache to carry: a
                # drain batch moves it without one, and the rest of the batch with theirs.
                continue
            sessions.update(_session_tokens(answer))
            size += int(answer.get("bytes", 0))
        return CheckpointOutcome(
            location=target.location,
            seconds=time.monotonic() - started,
            size_bytes=size,
            sessions=sessions,
        )

    async def load(self, target: CheckpointTarget) -> CheckpointOutcome:
        """Import a saved cache (or the target's sessions) into the running engine."""
        if target.engine is EngineType.VLLM:
            return CheckpointOutcome(location=target.location, seconds=0.0)
        started = time.monotonic()
        sessions: dict[str, int] = {}
        for session in target.sessions or (None,):
            directory = _directory(target.location, session)
            answer = await self._call(target, "/sim/cache/import", {"directory": directory})
            sessions.update(_session_tokens(answer))
        return CheckpointOutcome(
            location=target.location, seconds=time.monotonic() - started, sessions=sessions
        )

    def restore_args(self, engine: EngineType, location: str) -> list[str]:
        """Start a new simulated engine from the checkpoint; vLLM needs nothing extra."""
        return [f"--import-cache={location}"] if engine is EngineType.SIM else []

    async def _report(self, target: CheckpointTarget) -> CheckpointOutcome:
        """Ask a vLLM engine's KV store what it holds for the target's sessions."""
        started = time.monotonic()
        if target.token is None:
            # LMCache or vLLM's offloading tier: nothing of ours to ask; the store is
            # whatever the engine's connector keeps.
            return CheckpointOutcome(location=target.location, seconds=0.0)
        names = dict(zip(target.session_names, target.sessions, strict=False))
        answer = await self.store_control(
            target, {"op": "report", "sessions": list(names), "usage": not names}
        )
        sessions: dict[str, int] = {}
        size = 0
        for name, held in (answer.get("sessions") or {}).items():
            tokens = int(held.get("tokens", 0)) if isinstance(held, dict) else 0
            if name in names and tokens > 0:
                # A session with nothing saved moves without a cache, and is counted so.
                sessions[names[name]] = tokens
                size += int(held.get("bytes", 0))
        if not names:
            size = int((answer.get("usage") or {}).get("bytes", 0))
        return CheckpointOutcome(
            location=target.location,
            seconds=time.monotonic() - started,
            size_bytes=size,
            sessions=sessions,
        )

    async def store_control(
        self, target: CheckpointTarget, request: dict[str, Any]
    ) -> dict[str, Any]:
        """Send one control request to a vLLM engine's KV store; return its answer.

        The request rides a one-token completion's ``kv_transfer_params``, which vLLM hands
        to the connector and whose answer it returns in the response: vLLM's own channel,
        no port or sidecar of ours. The store refuses a request without the worker's token.

        Raises:
            DriverError: the engine did not answer, or the store refused or did not answer.

        """
        body = {
            "model": target.model,
            "prompt": [0],
            "max_tokens": 1,
            "kv_transfer_params": {CONTROL_KEY: {**request, "token": target.token}},
        }
        answer = await self._call(target, "/v1/completions", body)
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        reply = params.get(CONTROL_KEY) if isinstance(params, dict) else None
        if not isinstance(reply, dict):
            raise DriverError(
                f"engine at {target.endpoint} has no sessionfleet KV store "
                "(checkpoint.kvStore.type Sessionfleet, and the image's connector)"
            )
        if reply.get("error"):
            raise DriverError(f"the KV store at {target.endpoint}: {reply['error']}")
        return reply


def _not_found(response: httpx.Response) -> bool:
    """Whether the engine's own JSON error says not found (not a missing route's 404)."""
    try:
        error = response.json().get("error", {})
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("type") == "NotFoundError"


def _directory(location: str, session: str | None) -> str:
    """Return the whole checkpoint's directory, or one session's inside it."""
    return location if session is None else session_directory(location, session)


def _session_tokens(answer: Any) -> dict[str, int]:
    """Session tokens from an export or import answer (a list of ids, or id → tokens)."""
    sessions = answer.get("sessions", {}) if isinstance(answer, dict) else {}
    if isinstance(sessions, dict):
        return {str(k): int(v) for k, v in sessions.items()}
    tokens = answer.get("sessionTokens", {}) if isinstance(answer, dict) else {}
    return {str(s): int(tokens.get(s, 0)) for s in sessions}
