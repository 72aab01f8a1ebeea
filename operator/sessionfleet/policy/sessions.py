"""The session decision: what a session's status should be, given its worker.

The operator owns phase and binding; the router owns usage counters. Every write
here is one the lifecycle needs — bind, finish, delete — so that a session costs at
most three operator writes in its life when nothing goes wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import Enum, IntEnum
from typing import Any

from sessionfleet.api import Reason, SessionPhase, WorkerPhase
from sessionfleet.policy.holds import context_tokens, holds_worker

DEFAULT_IDLE_TIMEOUT = timedelta(minutes=30)
DEFAULT_LOST_TIMEOUT = timedelta(minutes=30)
"""How long a Lost session is kept after it became Lost, or after its last turn if later.

A Lost session no longer holds a worker (routers serve its turns on the worker its id
hashes to), so nothing else would ever end it: without an expiry every session of a
deleted worker would stay in etcd for good."""


@dataclass(frozen=True, slots=True)
class SessionState:
    """What the operator keeps of one AgentSession (an index value)."""

    namespace: str
    name: str
    session_id: str
    model: str
    generation: int = 0
    created_at: datetime | None = None
    parent_session_id: str | None = None
    hint: str | None = None
    pin: str | None = None
    finished: bool = False
    ttl_seconds: int = 3600
    phase: SessionPhase | None = None
    worker: str | None = None
    epoch: int | None = None
    observed_generation: int | None = None
    bound_at: datetime | None = None
    last_activity: datetime | None = None
    finished_at: datetime | None = None
    lost_since: datetime | None = None
    """When the session became Lost (its Ready condition's last transition); None otherwise."""
    prompt_tokens: int = 0
    turns: int = 0
    recomputed_tokens: int = 0
    migrations: tuple[dict[str, Any], ...] = ()
    migrating_since: datetime | None = None
    acks: tuple[tuple[str, str], ...] = ()
    """Router acknowledgements of the current migration: (replica, migratingSince)."""
    invalid: str | None = None
    resource_version: int = 0
    uid: str = ""
    """The object's uid: Events about it name it, so ``kubectl describe`` finds them."""

    @property
    def key(self) -> tuple[str, str]:
        """The session's (namespace, name)."""
        return (self.namespace, self.name)

    @property
    def pinned(self) -> bool:
        """Whether the session holds its worker: bound and not over."""
        return holds_worker(self.worker, self.phase)

    @property
    def context_tokens(self) -> int:
        """An estimate of the session's prefix: the mean prompt of its turns so far."""
        return context_tokens(self.prompt_tokens, self.turns)


@dataclass(frozen=True, slots=True)
class WorkerBrief:
    """What the session decision needs of its bound worker."""

    name: str
    phase: WorkerPhase | None
    epoch: int | None
    pod: str | None


class Action(Enum):
    """The kind of step the session needs."""

    NOTHING = "nothing"
    PLACE = "place"
    UPDATE = "update"
    DELETE = "delete"


@dataclass(frozen=True, slots=True)
class SessionDecision:
    """The step to take, and for UPDATE the phase and reason to write."""

    action: Action
    phase: SessionPhase | None = None
    reason: Reason | None = None
    message: str = ""
    recheck_at: datetime | None = None


NOTHING = SessionDecision(Action.NOTHING)


class Urgency(IntEnum):
    """Which session writes go first when they wait for a turn; lower is sooner.

    When writes are asked for faster than the API server answers them, something
    waits. What waits least is what holds a worker: a drain cannot end, nor a recovered
    worker serve its sessions again, until these are written. Then a new session's bind
    (its first turn waits on it), then a finish (it frees a seat), and last the deletion
    of a session already finished, which only tidies etcd.
    """

    HOLDS_WORKER = 0
    BIND = 1
    FINISH = 2
    CLEANUP = 3


_HELD_PHASES = frozenset({WorkerPhase.DRAINING, WorkerPhase.RECOVERING})


def urgency_of(decision: SessionDecision, worker: WorkerBrief | None) -> Urgency:
    """Return how soon a session's step should be written (see :class:`Urgency`)."""
    if decision.action is Action.PLACE:
        return Urgency.BIND
    if decision.action is Action.DELETE:
        return Urgency.CLEANUP  # a finished session no longer holds its worker
    if decision.phase is SessionPhase.FINISHED and (
        worker is None or worker.phase not in _HELD_PHASES
    ):
        return Urgency.FINISH
    # Restoring, bound again at a new epoch, lost with its worker, a migration ended, or
    # a finish that lets a drain or a recovery go on.
    return Urgency.HOLDS_WORKER


def lost_expires_at(session: SessionState, lost_timeout: timedelta) -> datetime | None:
    """Return when a Lost session is finished; None when no time is known (never).

    That is ``lost_timeout`` after it became Lost or after its last turn, whichever is
    later. Its turns keep it: a Lost session is still served (on another worker), and a client
    in the middle of one must not see it finished under it.
    """
    seen = [
        t
        for t in (session.lost_since, session.last_activity, session.bound_at, session.created_at)
        if t is not None
    ]
    if not seen:
        return None
    try:
        return max(seen) + lost_timeout
    except OverflowError:  # the schema allows dates up to 9999-12-31: never, then
        return None


def decide_session(
    session: SessionState,
    worker: WorkerBrief | None,
    now: datetime,
    idle_timeout: timedelta = DEFAULT_IDLE_TIMEOUT,
    lost_timeout: timedelta = DEFAULT_LOST_TIMEOUT,
) -> SessionDecision:
    """Decide the next step for one session. ``worker`` is its bound worker, if it exists."""
    if session.invalid is not None:
        return NOTHING
    if session.phase is SessionPhase.FINISHED:
        finished = session.finished_at or now
        ttl = timedelta(seconds=session.ttl_seconds)
        if now - finished >= ttl:
            return SessionDecision(Action.DELETE, message="ttlSecondsAfterFinished passed")
        try:
            expires = finished + ttl
        except OverflowError:
            # The schema accepts a finishedAt up to 9999-12-31: past the calendar's end
            # it never expires, so there is no moment to look again.
            return NOTHING
        return SessionDecision(Action.NOTHING, recheck_at=expires)
    if session.finished:
        return SessionDecision(
            Action.UPDATE,
            SessionPhase.FINISHED,
            Reason.FINISHED_BY_CLIENT,
            "the client marked the session finished",
        )
    last_seen = session.last_activity or session.bound_at or session.created_at
    if last_seen is not None and session.phase is not SessionPhase.LOST:
        if now - last_seen >= idle_timeout:
            return SessionDecision(
                Action.UPDATE,
                SessionPhase.FINISHED,
                Reason.IDLE_TIMEOUT,
                f"no turn for {int(idle_timeout.total_seconds())}s",
            )
    if session.phase is SessionPhase.LOST:
        lost_until = lost_expires_at(session, lost_timeout)
        if lost_until is None or now < lost_until:
            return SessionDecision(Action.NOTHING, recheck_at=lost_until)
        return SessionDecision(
            Action.UPDATE,
            SessionPhase.FINISHED,
            Reason.LOST_EXPIRED,
            f"Lost with no turn for {int(lost_timeout.total_seconds())}s; deleted after "
            f"ttlSecondsAfterFinished ({session.ttl_seconds}s)",
        )
    if session.worker is None:
        return SessionDecision(Action.PLACE)
    if worker is None:
        return SessionDecision(
            Action.UPDATE,
            SessionPhase.LOST,
            Reason.WORKER_DELETED,
            f"worker {session.worker} was deleted; the session's cache is gone",
        )
    if session.phase is SessionPhase.MIGRATING:
        if worker.phase is WorkerPhase.DRAINING:
            return NOTHING  # the drain moves it once the routers have acknowledged
        return SessionDecision(
            Action.UPDATE,
            SessionPhase.BOUND,
            Reason.BOUND,
            f"the drain of worker {worker.name} ended; the session stays",
        )
    if worker.phase is WorkerPhase.RECOVERING:
        if session.phase is SessionPhase.RESTORING:
            return NOTHING
        return SessionDecision(
            Action.UPDATE,
            SessionPhase.RESTORING,
            Reason.WORKER_RECOVERING,
            f"worker {worker.name} is starting epoch {worker.epoch}; turns are held",
        )
    if worker.phase in (WorkerPhase.READY, WorkerPhase.DRAINING) and (
        session.phase is not SessionPhase.BOUND or session.epoch != worker.epoch
    ):
        return SessionDecision(
            Action.UPDATE,
            SessionPhase.BOUND,
            Reason.BOUND,
            f"bound to worker {worker.name} (pod {worker.pod}, epoch {worker.epoch})",
        )
    return NOTHING


def next_check(
    session: SessionState,
    idle_timeout: timedelta = DEFAULT_IDLE_TIMEOUT,
    lost_timeout: timedelta = DEFAULT_LOST_TIMEOUT,
) -> datetime | None:
    """Return when :func:`decide_session` can next change its answer with no event.

    A Finished session is deleted at ``finishedAt + ttlSecondsAfterFinished``; a Lost one
    is finished at :func:`lost_expires_at`; any other live one is finished at its last
    sign of life plus ``idle_timeout``. Every other change of decision comes with an
    event of the session or of its worker.
    """
    if session.invalid is not None:
        return None
    if session.phase is SessionPhase.LOST:
        return lost_expires_at(session, lost_timeout)
    try:
        if session.phase is SessionPhase.FINISHED:
            if session.finished_at is None:
                return None
            return session.finished_at + timedelta(seconds=session.ttl_seconds)
        last_seen = session.last_activity or session.bound_at or session.created_at
        return None if last_seen is None else last_seen + idle_timeout
    except OverflowError:  # the schema allows dates up to 9999-12-31: never, then
        return None
