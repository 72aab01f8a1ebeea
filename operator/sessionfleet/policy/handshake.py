"""The turn-boundary handshake between the operator and the routers.

A session moves only between turns. The operator marks it Migrating (with
``status.migratingSince``); every router replica then holds the session's next turn,
waits until none of its turns is in flight, and acknowledges by annotating the session
``ack.sessionfleet.dev/<replica>: <migratingSince>``. The operator moves the session
once every *live* replica has acknowledged — live meaning its Lease
(``sessionfleet.dev/component: router``) was renewed within its duration — or when
the wait exceeds a bound, so a router that died holding a turn cannot stall a drain.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

ACK_PREFIX = "ack.sessionfleet.dev/"
ROUTER_COMPONENT_LABEL = "sessionfleet.dev/component"
ROUTER_COMPONENT = "router"
DEFAULT_ACK_TIMEOUT = timedelta(seconds=30)


@dataclass(frozen=True, slots=True)
class RouterLease:
    """One router replica's Lease."""

    holder: str
    renewed_at: datetime | None
    duration_seconds: int

    def live(self, now: datetime) -> bool:
        """Whether the replica renewed its Lease within the Lease's duration."""
        if self.renewed_at is None:
            return False
        return now - self.renewed_at <= timedelta(seconds=self.duration_seconds)


def acks_of(annotations: Mapping[str, str]) -> dict[str, str]:
    """Return a session's acknowledgements: replica to the migratingSince it acknowledged."""
    return {
        k.removeprefix(ACK_PREFIX): v for k, v in annotations.items() if k.startswith(ACK_PREFIX)
    }


def stamp(migrating_since: datetime) -> str:
    """Return ``migratingSince`` as the status holds it: the value routers acknowledge."""
    return migrating_since.isoformat().replace("+00:00", "Z")


@dataclass(frozen=True, slots=True)
class HandshakeState:
    """Where a migration's handshake stands."""

    ready: bool
    waiting_for: tuple[str, ...] = ()
    timed_out: bool = False


def handshake(
    migrating_since: datetime,
    stamp: str,
    acks: Mapping[str, str],
    leases: Iterable[RouterLease],
    now: datetime,
    timeout: timedelta = DEFAULT_ACK_TIMEOUT,
) -> HandshakeState:
    """Whether a Migrating session may move now, and which replicas it still waits for.

    ``stamp`` is ``migratingSince`` as written in the status; an acknowledgement of an
    earlier migration of the same session does not count.
    """
    waiting = tuple(
        sorted(
            lease.holder for lease in leases if lease.live(now) and acks.get(lease.holder) != stamp
        )
    )
    if not waiting:
        return HandshakeState(ready=True)
    if now - migrating_since >= timeout:
        return HandshakeState(ready=True, waiting_for=waiting, timed_out=True)
    return HandshakeState(ready=False, waiting_for=waiting)
