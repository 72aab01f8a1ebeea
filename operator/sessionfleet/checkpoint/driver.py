"""The checkpoint driver interface, shared by the operator and the node agent."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from sessionfleet.api import CheckpointDriver, EngineType


class DriverError(Exception):
    """A checkpoint or restore was attempted and failed; the message says why."""


class DriverUnavailable(DriverError):
    """The driver cannot work here at all (capability missing); nothing was attempted."""


class NotLeadingDriver(DriverError):
    """Refused, unsent: this operator replica may not act on workers now (not the leader)."""


WriteGate = Callable[[], bool]
"""Whether this process may act on the fleet now (the operator's leader election)."""


def check_gate(gate: WriteGate | None, what: str) -> None:
    """Raise :class:`NotLeadingDriver` when ``gate`` is closed; ``what`` names the call.

    Asked just before each call that acts on a worker is sent, as the API client asks
    before each write: a replica deposed while a checkpoint waited does not pause,
    dump or load an engine that its successor now drives.
    """
    if gate is not None and not gate():
        raise NotLeadingDriver(f"{what}: not sent, this process is not the leader")


@dataclass(frozen=True, slots=True)
class CheckpointTarget:
    """What to save or restore: one worker's engine, whole or a few of its sessions."""

    namespace: str
    worker: str
    epoch: int
    engine: EngineType
    endpoint: str
    """The engine's base URL, ``http://<podIP>:<port>``."""
    location: str
    """Where the checkpoint lives: a directory on shared storage, or a store's URL."""
    pod: str | None = None
    node: str | None = None
    sessions: tuple[str, ...] = ()
    """Only these sessions (per-session migration); empty: the whole worker."""
    session_names: tuple[str, ...] = ()
    """The AgentSession names of ``sessions``, in the same order (how a KV store keys them)."""
    model: str = ""
    """The served model's name, which a request to the engine must name."""
    token: str | None = None
    """What the engine's KV store asks of a control request (the worker's UID)."""


@dataclass(frozen=True, slots=True)
class CheckpointOutcome:
    """What a save or a load did."""

    location: str
    seconds: float
    size_bytes: int = 0
    sessions: Mapping[str, int] = field(default_factory=dict)
    """Session id to the prefix tokens it holds."""

    @property
    def total_tokens(self) -> int:
        """Tokens captured over all sessions."""
        return sum(self.sessions.values())


class Driver(Protocol):
    """Saves a worker's state and loads it into an engine or a new pod."""

    name: CheckpointDriver

    async def save(self, target: CheckpointTarget) -> CheckpointOutcome:
        """Write the target's state to ``target.location``."""
        ...

    async def load(self, target: CheckpointTarget) -> CheckpointOutcome:
        """Load the state at ``target.location`` into the running engine at the target."""
        ...

    def restore_args(self, engine: EngineType, location: str) -> list[str]:
        """Extra engine arguments that make a new pod start from ``location``."""
        ...


@runtime_checkable
class KVStoreControl(Protocol):
    """A driver that also reaches the KV store inside an engine (the engine driver).

    The operator's KV-store housekeeping (``controllers/kvstores.py``) needs only this,
    so it asks for the capability, not for one driver class.
    """

    async def store_control(
        self, target: CheckpointTarget, request: dict[str, Any]
    ) -> dict[str, Any]:
        """Send one control request to the engine's KV store; return its answer."""
