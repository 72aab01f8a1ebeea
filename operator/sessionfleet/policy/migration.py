"""Moving a draining worker's sessions: which may move now, and where each goes.

Pure: the controller observes the sessions, the router replicas' Leases and the
workers' loads, :func:`plan_migration` decides, and the controller carries the steps
out (mark a session Migrating, or save, import and rebind it). A session moves only at
a turn boundary: it is first marked Migrating, and moves once every live router replica
has acknowledged that none of its turns is in flight (:mod:`.handshake`), or once the
acknowledgements are overdue.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import Enum

from sessionfleet.api import CheckpointDriver, DrainPolicySpec, Reason, SessionPhase
from sessionfleet.policy.handshake import RouterLease, handshake, stamp
from sessionfleet.policy.placement import Placement, PlacementRequest, WorkerLoad, place
from sessionfleet.policy.sessions import SessionState


class MigrationAction(Enum):
    """What to do with one session of a draining worker in this pass."""

    START_HANDSHAKE = "start the handshake: mark it Migrating so routers hold its next turn"
    WAIT = "wait: a router may still have a turn of it in flight"
    MOVE = "move it to the target worker"
    NO_TARGET = "keep it: no other worker has room; the drain holds until its deadline"


@dataclass(frozen=True, slots=True)
class MigrationStep:
    """The decision for one session."""

    session: SessionState
    action: MigrationAction
    target: str | None = None
    message: str = ""
    """For MOVE, why that worker (placement's message); otherwise what it waits for."""
    overdue: tuple[str, ...] = ()
    """For MOVE after the acknowledgement timeout: the replicas that never answered."""
    reason: Reason | None = None
    """For MOVE and NO_TARGET, placement's reason (NO_TARGET: why no worker has room)."""


def through_checkpoint(policy: DrainPolicySpec, driver: CheckpointDriver) -> bool:
    """Whether a drain's sessions move with their saved state.

    The DrainPolicy asks for a checkpoint and the worker has a driver to take one; else
    each session moves without its cache and recomputes its prefix on its new worker.
    """
    return policy.checkpoint and driver is not CheckpointDriver.NONE


def _with_session(loads: Sequence[WorkerLoad], worker: str, tokens: int) -> list[WorkerLoad]:
    """Return the loads once a session of ``tokens`` is bound to ``worker``."""
    return [
        dataclasses.replace(
            load,
            pinned_sessions=load.pinned_sessions + 1,
            kv_tokens_pinned=load.kv_tokens_pinned + tokens,
        )
        if load.name == worker
        else load
        for load in loads
    ]


def _target(
    session: SessionState,
    source: str,
    loads: Sequence[WorkerLoad],
    loaders: frozenset[str] | None,
) -> Placement:
    """Place a moving session, on a worker that can load its state when one has room."""
    request = PlacementRequest(
        model=session.model, expected_tokens=session.context_tokens, exclude=frozenset({source})
    )
    if loaders is not None:
        others = frozenset(load.name for load in loads if load.name not in loaders)
        keeps = place(dataclasses.replace(request, exclude=request.exclude | others), loads)
        if keeps.placed:
            return keeps
    return place(request, loads)


def plan_migration(
    sessions: Iterable[SessionState],
    source: str,
    loads: Sequence[WorkerLoad],
    routers: Sequence[RouterLease],
    now: datetime,
    ack_timeout: timedelta,
    loaders: frozenset[str] | None = None,
) -> list[MigrationStep]:
    """Decide, in order, what to do with each session asked to leave ``source``.

    Each session placed counts against its target's load for the sessions after it,
    so a batch spreads over the workers instead of piling onto the least loaded one.

    ``loaders``: when the sessions move with their saved state, the workers that can
    load it (engines of the source's type). A session goes to one of them when one has
    room, and elsewhere, to recompute its prefix, only when none has.
    """
    steps: list[MigrationStep] = []
    current = list(loads)
    for session in sessions:
        if session.phase is not SessionPhase.MIGRATING or session.migrating_since is None:
            steps.append(
                MigrationStep(
                    session,
                    MigrationAction.START_HANDSHAKE,
                    message=f"worker {source} drains: turns are held until the routers acknowledge",
                )
            )
            continue
        state = handshake(
            session.migrating_since,
            stamp(session.migrating_since),
            dict(session.acks),
            routers,
            now,
            ack_timeout,
        )
        if not state.ready:
            waiting = ", ".join(state.waiting_for)
            steps.append(
                MigrationStep(session, MigrationAction.WAIT, message=f"waiting for {waiting}")
            )
            continue
        placement = _target(session, source, current, loaders)
        if placement.worker is None:
            steps.append(
                MigrationStep(
                    session,
                    MigrationAction.NO_TARGET,
                    message=placement.message,
                    reason=placement.reason,
                )
            )
            continue
        current = _with_session(current, placement.worker, session.context_tokens)
        steps.append(
            MigrationStep(
                session,
                MigrationAction.MOVE,
                target=placement.worker,
                message=placement.message,
                overdue=state.waiting_for if state.timed_out else (),
                reason=placement.reason,
            )
        )
    return steps
