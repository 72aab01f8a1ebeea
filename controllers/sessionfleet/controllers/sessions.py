"""AgentSession reconciliation: bind, follow the worker, finish, expire, migrate.

Sessions are numerous, so this is the cheap path: no per-session kopf handlers that
write annotations or finalizers, only status merge-patches that change something —
bind, finish, delete: three operator writes in a session's uneventful life.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterable
from datetime import UTC, datetime
from typing import Any

from sessionfleet.api import (
    CheckpointDriver,
    CheckpointReason,
    EngineType,
    InferenceWorker,
    MigrationReason,
    Reason,
    SessionPhase,
)
from sessionfleet.checkpoint import CheckpointOutcome, DriverError
from sessionfleet.controllers import checkpoints, metrics
from sessionfleet.controllers.events import session_ref, worker_ref
from sessionfleet.controllers.fleet import Fleet
from sessionfleet.controllers.records import WorkerRecord
from sessionfleet.kube import SESSIONS, Conflict, KubeError, NotFound
from sessionfleet.policy.events import EventType, Notice
from sessionfleet.policy.migration import MigrationAction, plan_migration
from sessionfleet.policy.placement import PlacementRequest, admit_or_place
from sessionfleet.policy.sessions import (
    Action,
    SessionDecision,
    SessionState,
    Urgency,
    WorkerBrief,
    decide_session,
    urgency_of,
)
from sessionfleet.resources.status import (
    migration,
    session_bound_status,
    session_migrating_status,
    session_pending_status,
    session_phase_status,
    session_rebound_status,
)

log = logging.getLogger(__name__)


async def _patch_status(fleet: Fleet, session: SessionState, status: dict[str, Any]) -> bool:
    """Write the session's status; the caller holds its write turn (:mod:`.turns`)."""
    try:
        body = await fleet.kube.patch(
            SESSIONS,
            session.name,
            {"status": status},
            session.namespace,
            status=True,
            # Decided from this copy: if anyone wrote the session since (a router's
            # usage, or another operator replica that believed it led), the write
            # fails and the next pass decides again from the newer copy.
            resource_version=session.resource_version or None,
        )
    except (NotFound, Conflict):
        return False
    metrics.API_WRITES.labels("patch", "agentsessions/status").inc()
    fleet.freshness.mark(session.key, body)
    return True


def worker_brief(record: WorkerRecord) -> WorkerBrief | None:
    """Return what a session's decision reads of its worker; None for an invalid worker."""
    if record.worker is None:
        return None
    status = record.status
    return WorkerBrief(record.name, status.phase, status.epoch, status.pod)


def _brief(fleet: Fleet, session: SessionState) -> WorkerBrief | None:
    if session.worker is None:
        return None
    record = fleet.indexes.worker(session.namespace, session.worker)
    return worker_brief(record) if record is not None else None


def next_step(fleet: Fleet, session: SessionState, now: datetime) -> SessionDecision | None:
    """Return the step the session needs now, or None. No I/O: the loop filters with it."""
    if session.key in fleet.sessions.busy:
        return None
    return _decide(fleet, session, now)


def _decide(fleet: Fleet, session: SessionState, now: datetime) -> SessionDecision | None:
    key = session.key
    if fleet.freshness.is_stale(key, session.resource_version):
        return None
    if fleet.sessions.deleted.get(key, -1) >= session.resource_version:
        return None  # we deleted it; the index shows it until the watch reports that
    if session.worker is not None:
        fleet.sessions.ledger.settle(key)
    decision = decide_session(
        session, _brief(fleet, session), now, fleet.config.idle_timeout, fleet.config.lost_timeout
    )
    return None if decision.action is Action.NOTHING else decision


async def reconcile_session(fleet: Fleet, session: SessionState, now: datetime) -> None:
    """Take the next step for one session, if it needs one, once its write's turn comes.

    The step is decided again when the turn comes, from the copy the watch holds then
    and at that time: the wait can be minutes when writes are asked for faster than the
    API server answers (:mod:`.turns`), and meanwhile the session may have been finished,
    used (its resourceVersion moved) or deleted, and the workers' loads have changed.
    """
    decision = next_step(fleet, session, now)
    if decision is None:
        return
    key = session.key
    fleet.sessions.busy.add(key)
    try:
        async with fleet.sessions.writes.turn(urgency_of(decision, _brief(fleet, session)), key):
            current = fleet.sessions.session(*key)
            now = datetime.now(UTC)
            decision = _decide(fleet, current, now) if current is not None else None
            if current is not None and decision is not None:
                await _act(fleet, current, decision, now)
    except KubeError as error:
        log.warning("session %s/%s: %s", session.namespace, session.name, error)
    finally:
        fleet.sessions.busy.discard(key)
        # Decided again next pass: a write that failed (a conflict with a router's usage
        # write) is retried, one that succeeded is skipped until the watch shows it.
        fleet.work.session(key)


async def _act(
    fleet: Fleet, session: SessionState, decision: SessionDecision, now: datetime
) -> None:
    if decision.action is Action.PLACE:
        await bind(fleet, session, now)
    elif decision.action is Action.DELETE:
        try:
            # Only the copy this was decided from: a session someone changed since
            # (a router's turn, a user's) or recreated under its name is decided again.
            await fleet.kube.delete(
                SESSIONS,
                session.name,
                session.namespace,
                uid=session.uid or None,
                resource_version=session.resource_version or None,
            )
            metrics.API_WRITES.labels("delete", "agentsessions").inc()
        except (NotFound, Conflict):
            pass
        # Until the watch reports the deletion, every pass of the loop would find the
        # session Finished past its TTL and delete it again: one 404 DELETE per pass.
        fleet.sessions.deleted[session.key] = session.resource_version
    elif decision.action is Action.UPDATE and decision.phase is not None:
        brief = _brief(fleet, session) if decision.phase is SessionPhase.BOUND else None
        status = session_phase_status(
            decision.phase,
            session.generation,
            decision.reason or Reason.BOUND,
            decision.message,
            now,
            binding=(brief.epoch, brief.pod) if brief is not None else None,
        )
        written = await _patch_status(fleet, session, status)
        if written and brief is not None and session.phase is SessionPhase.RESTORING:
            fleet.notify(
                session_ref(session),
                Notice(
                    EventType.NORMAL,
                    "SessionRebound",
                    "Bind",
                    f"bound again to worker {brief.name}, epoch {brief.epoch}, after its recovery",
                ),
            )


async def bind(fleet: Fleet, session: SessionState, now: datetime) -> None:
    """Bind a new session, or record why it must wait.

    A session a router or the EPP created arrives with the worker its first turn went
    to as its hint: that worker is admitted if it still takes new sessions and has room
    under this operator's count (:func:`~sessionfleet.policy.placement.admit_or_place`),
    without ranking the workers again. Only a session with no hint, or whose hint is
    refused, is placed here.
    """
    parent_worker = (
        fleet.sessions.worker_of_session_id(session.namespace, session.parent_session_id)
        if session.parent_session_id
        else None
    )
    placement = admit_or_place(
        PlacementRequest(
            model=session.model,
            pin=session.pin,
            parent_worker=parent_worker,
            expected_tokens=session.context_tokens,
        ),
        fleet.loads(session.namespace),
        hint=session.hint,
        ranked=True,
    )
    if placement.worker is None:
        fleet.work.waiting.add(session.key)  # tried again on every pass until placed
        if session.phase is SessionPhase.PENDING:
            return  # already says so; retried by the loop when capacity changes
        # Once per session that starts waiting: why a session is not served is the first
        # question asked of an operator, and its status may not be the first place looked.
        log.info("session %s/%s waits: %s", session.namespace, session.name, placement.message)
        await _patch_status(
            fleet,
            session,
            session_pending_status(session.generation, placement.reason, placement.message, now),
        )
        return
    record = fleet.indexes.worker(session.namespace, placement.worker)
    status = record.status if record is not None else None
    fleet.sessions.ledger.add(session.key, placement.worker, session.context_tokens)
    bound = await _patch_status(
        fleet,
        session,
        session_bound_status(
            placement.worker,
            status.pod if status else None,
            status.epoch if status else None,
            session.generation,
            placement.message,
            now,
        ),
    )
    if not bound:
        fleet.sessions.ledger.settle(session.key)
        return
    if record is not None:
        # On the worker, not the session: a burst of binds is one Event per worker,
        # its series counting them (sessionfleet.policy.events).
        fleet.notify(
            worker_ref(record),
            Notice(
                EventType.NORMAL,
                "SessionsBound",
                "Bind",
                f"session {session.session_id} bound: {placement.message}; the binds that "
                "follow are counted in this Event's series",
            ),
        )
    if session.created_at is not None:
        # Timed at the write's answer, not at the decision: the wait for a turn counts.
        waited = datetime.now(UTC) - session.created_at
        metrics.BIND_LATENCY.observe(max(waited.total_seconds(), 0.0))


async def migrate_sessions(
    fleet: Fleet,
    source: WorkerRecord,
    worker: InferenceWorker,
    names: tuple[str, ...],
    through_checkpoint: bool,
    now: datetime,
) -> None:
    """Move sessions of a draining worker to the best other workers, at a turn boundary.

    With ``through_checkpoint`` (the DrainPolicy's ``checkpoint`` and an ``engine``
    driver), one Drain checkpoint captures the batch's sessions on the source and each
    is imported into its new worker before the binding changes, so its next turn hits
    the cache there. Without one — or if the save or import fails — the session is
    rebound without cache and its next turn's recomputation is counted by the router.
    """
    namespace = source.namespace
    candidates = []
    for name in names:
        session = fleet.sessions.session(namespace, name)
        if session is None or session.worker != source.name:
            continue
        if session.key in fleet.sessions.busy:
            # Its write (a finish, say) may wait behind every bind: the drain waits on it.
            fleet.sessions.writes.promote(session.key, Urgency.HOLDS_WORKER)
            continue
        if fleet.freshness.is_stale(session.key, session.resource_version):
            continue
        candidates.append(session)
    # A session that carries its KV goes where it can be loaded: an engine of its type.
    engine = worker.spec.engine.type
    loaders = (
        frozenset(
            r.name
            for r in fleet.indexes.all_workers()
            if r.namespace == namespace
            and r.worker is not None
            and r.worker.spec.engine.type is engine
        )
        if through_checkpoint
        else None
    )
    steps = plan_migration(
        candidates,
        source.name,
        fleet.loads(namespace),
        fleet.indexes.routers(),
        now,
        fleet.config.ack_timeout,
        loaders,
    )
    movable: list[tuple[SessionState, str, str]] = []
    marking: list[tuple[SessionState, str]] = []
    for step in steps:
        session = step.session
        if step.action is MigrationAction.START_HANDSHAKE:
            marking.append((session, step.message))
        elif step.action is MigrationAction.MOVE and step.target is not None:
            if step.overdue:
                log.warning(
                    "session %s: routers %s did not acknowledge within %s; moving it anyway",
                    session.key,
                    ", ".join(step.overdue),
                    fleet.config.ack_timeout,
                )
            fleet.sessions.ledger.add(session.key, step.target, session.context_tokens)
            movable.append((session, step.target, step.message))
    # Together, not one round trip after another: a drain marks and moves every session
    # of its worker, and each write waits on the API server (their turns come first).
    await _together(_mark_migrating(fleet, session, why, now) for session, why in marking)
    if not movable:
        return
    log.info(
        "moving %d session(s) off worker %s/%s: %s",
        len(movable),
        *source.key,
        ", ".join(f"{session.name} to {target}" for session, target, _ in movable),
    )
    fleet.sessions.busy.update(session.key for session, _, _ in movable)
    move = _move(fleet, source, worker, movable, through_checkpoint, now)
    if through_checkpoint:
        # A checkpoint can take minutes (criu: up to 15): never inside the loop's pass.
        fleet.spawner.spawn(f"migration from {source.key}", move)
    else:
        await move


async def _move(
    fleet: Fleet,
    source: WorkerRecord,
    worker: InferenceWorker,
    movable: list[tuple[SessionState, str, str]],
    through_checkpoint: bool,
    now: datetime,
) -> None:
    """Save the batch's sessions (when asked), import each into its target, rebind it."""
    try:
        saved = None
        if through_checkpoint:
            saved = await _save_for_migration(fleet, source, worker, movable, now)

        async def move_one(session: SessionState, target: str, why: str) -> None:
            loaded = saved is not None and await _load_into(
                fleet, saved, session, target, worker.spec.engine.type
            )
            await _rebind(fleet, session, source.name, target, why, saved if loaded else None, now)

        await _together(move_one(*entry) for entry in movable)
    finally:
        moved = [session.key for session, _, _ in movable]
        fleet.sessions.busy.difference_update(moved)
        fleet.work.each_session(moved)  # a pass that skipped them while busy looks again


async def _together(steps: Iterable[Coroutine[Any, Any, None]]) -> None:
    """Run the steps concurrently, every one to its end; then raise the first failure."""
    outcomes = await asyncio.gather(*steps, return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome


async def _mark_migrating(fleet: Fleet, session: SessionState, message: str, now: datetime) -> None:
    """Start the turn-boundary handshake: routers hold the session's next turn and ack."""
    async with fleet.sessions.writes.turn(Urgency.HOLDS_WORKER, session.key):
        marked = await _patch_status(fleet, session, session_migrating_status(message, now))
    if marked:
        fleet.notify(
            session_ref(session),
            Notice(EventType.NORMAL, "MigrationStarted", "Migrate", message),
        )


async def _save_for_migration(
    fleet: Fleet,
    source: WorkerRecord,
    worker: InferenceWorker,
    movable: list[tuple[SessionState, str, str]],
    now: datetime,
) -> tuple[str, CheckpointOutcome] | None:
    """Take the Drain checkpoint of the sessions about to move; ``None`` if it fails."""
    sessions = tuple(session.session_id for session, _, _ in movable)
    created = await checkpoints.create(
        fleet, source, worker, CheckpointReason.DRAIN, now, sessions=sessions
    )
    if created is None:
        return None
    outcome = await checkpoints.save(fleet, created, now)
    return (created.name, outcome) if outcome is not None else None


async def _load_into(
    fleet: Fleet,
    saved: tuple[str, CheckpointOutcome],
    session: SessionState,
    target: str,
    engine: EngineType,
) -> bool:
    """Import one session's saved blocks into its new worker's engine.

    Only an engine of the source's type reads what it saved (a vLLM KV store's blocks
    mean nothing to the simulated engine, and the other way round).
    """
    _, outcome = saved
    record = fleet.indexes.worker(session.namespace, target)
    driver = fleet.checkpointing.drivers.get(CheckpointDriver.ENGINE)
    if record is None or record.worker is None or driver is None:
        return False
    if record.worker.spec.engine.type is not engine:
        return False
    destination = checkpoints.target_for(
        record, record.worker, outcome.location, (session.session_id,)
    )
    if destination is None or session.session_id not in outcome.sessions:
        return False
    try:
        await driver.load(destination)
    except DriverError as error:
        log.warning("session %s: import into %s failed: %s", session.key, target, error)
        return False
    return True


async def _rebind(
    fleet: Fleet,
    session: SessionState,
    source: str,
    target: str,
    why: str,
    saved: tuple[str, CheckpointOutcome] | None,
    now: datetime,
) -> None:
    checkpoint = None
    if saved is not None:
        checkpoint, outcome = saved
        tokens = outcome.sessions.get(session.session_id, 0)
        how = f"through checkpoint {checkpoint} ({tokens} tokens)"
    else:
        how = "without cache: its prefix is recomputed at the next turn"
    async with fleet.sessions.writes.turn(Urgency.HOLDS_WORKER, session.key):
        # A save can take minutes, a turn seconds: rebind from the copy the index holds
        # now, and only if it is still on the source (the write fails if anyone changes
        # it meanwhile).
        current = fleet.sessions.session(session.namespace, session.name)
        moved = False
        if current is not None and current.worker == source:
            session = current
            record = fleet.indexes.worker(session.namespace, target)
            status = record.status if record is not None else None
            moved = await _patch_status(
                fleet,
                session,
                session_rebound_status(
                    target,
                    status.pod if status else None,
                    status.epoch if status else None,
                    [*session.migrations, migration(source, target, now, checkpoint)],
                    f"migrated from draining worker {source} {how}; {why}",
                    now,
                ),
            )
    if moved:
        metrics.MIGRATIONS.labels(MigrationReason.DRAIN.value).inc()
        fleet.notify(
            session_ref(session),
            Notice(
                EventType.NORMAL,
                "MigrationCompleted",
                "Migrate",
                f"moved from worker {source} to {target} {how}",
            ),
        )
    else:
        fleet.sessions.ledger.settle(session.key)
