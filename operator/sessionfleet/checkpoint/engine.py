"""The ``engine`` driver: the engine itself exports and imports its KV cache.

The simulated engine writes its cache (or one session's blocks) to a directory with
``POST /sim/cache/export`` and loads one with ``POST /sim/cache/import`` or at start
with ``--import-cache DIR``. The directory must be on storage both the old and the new
pod mount at the same path (the worker's ``checkpoint.storage``: a ReadWriteMany
volume; on the local demo cluster, a directory of the machine). A session's blocks go to
a directory named like its AgentSession (a DNS-safe part of its id and a hash), never
to the raw id: a client picks its session id, ``../..`` included.

vLLM keeps its KV in LMCache's shared remote store as it serves (the pod builder
configures the connector, the store's URL and a fixed ``PYTHONHASHSEED``), so a new
worker hits the saved prefixes without an explicit export: for vLLM this driver
records the store as the checkpoint's location and has nothing to copy.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from sessionfleet.api import CheckpointDriver, EngineType
from sessionfleet.checkpoint.driver import CheckpointOutcome, CheckpointTarget, DriverError
from sessionfleet.checkpoint.paths import session_directory


class UnknownToEngine(DriverError):
    """The engine holds nothing for a session (it has had no turn there): nothing to save."""


class EngineDriver:
    """Checkpoints through the engine's own export and import."""

    name = CheckpointDriver.ENGINE

    def __init__(self, http: httpx.AsyncClient, timeout: float = 120.0) -> None:
        self.http = http
        self.timeout = timeout

    async def _call(self, target: CheckpointTarget, path: str, body: dict[str, Any]) -> Any:
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
            return CheckpointOutcome(location=target.location, seconds=0.0)
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
