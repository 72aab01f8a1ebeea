"""Where a drained worker's sessions would move now: the operator's own plan, not a copy.

:func:`~sessionfleet.policy.migration.plan_migration` decides, as the operator calls it
(``controllers.sessions.migrate_sessions``): the sessions in turn, each counted against
its target for the next, the worker they leave excluded, and — when they move with
their saved state — a worker that can load it preferred. This module only builds its
inputs from a :class:`~sessionfleet.kubectl.views.snapshot.Snapshot`. "Now" means as
if every router had already acknowledged: the preview does not wait for the handshake.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from sessionfleet.api import (
    AgentSession,
    InferenceWorker,
    SessionPhase,
)
from sessionfleet.kubectl.views.placement import loads
from sessionfleet.kubectl.views.snapshot import Snapshot
from sessionfleet.policy.migration import MigrationStep, plan_migration, through_checkpoint
from sessionfleet.policy.placement import Placement
from sessionfleet.policy.sessions import SessionState


def moving_now(session: AgentSession, now: datetime) -> SessionState:
    """Return the operator's state of ``session`` as if it had been asked to move at ``now``.

    Migrating since ``now``, with the counts its context estimate is made of; with no
    router to wait for, :func:`~sessionfleet.policy.migration.plan_migration` places it.
    """
    spec, status = session.spec, session.status
    return SessionState(
        namespace=session.metadata.namespace,
        name=session.metadata.name,
        session_id=spec.session_id,
        model=spec.model,
        parent_session_id=spec.parent_session_id,
        hint=spec.worker_hint,
        pin=spec.worker_pin,
        phase=SessionPhase.MIGRATING,
        worker=status.worker,
        migrating_since=now,
        prompt_tokens=status.prompt_tokens or 0,
        turns=status.turns or 0,
    )


def loaders(snap: Snapshot, source: InferenceWorker) -> frozenset[str]:
    """Return the workers of the source's namespace that can load its saved state.

    Engines of the source's type, as the operator counts them.
    """
    engine = source.spec.engine.type
    return frozenset(
        w.metadata.name
        for w in snap.workers
        if w.metadata.namespace == source.metadata.namespace and w.spec.engine.type is engine
    )


def _plan(
    snap: Snapshot,
    namespace: str,
    source: str,
    sessions: Sequence[AgentSession],
    now: datetime,
    carriers: frozenset[str] | None,
) -> list[MigrationStep]:
    return plan_migration(
        [moving_now(s, now) for s in sessions],
        source,
        loads(snap, namespace),
        (),  # no router to wait for: "if it moved now"
        now,
        timedelta(0),
        carriers,
    )


def migration_plan(
    snap: Snapshot, source: InferenceWorker, sessions: Sequence[AgentSession], now: datetime
) -> list[MigrationStep]:
    """Return the operator's plan for ``sessions`` if they left ``source`` now, in order.

    Through a checkpoint when the DrainPolicy that governs ``source`` and its driver say
    so, and then preferring the workers that can load the saved state.
    """
    policy = snap.policy_choice(source).spec
    return _plan(
        snap,
        source.metadata.namespace,
        source.metadata.name,
        sessions,
        now,
        loaders(snap, source)
        if through_checkpoint(policy, source.spec.checkpoint.driver)
        else None,
    )


def migration_target(snap: Snapshot, session: AgentSession, now: datetime) -> Placement:
    """Return where a migrating session would go now, as the operator's plan places it.

    No pin or hint, and the worker it leaves excluded; a worker that was not read (gone)
    carries no saved state, so any worker with room will do.
    """
    namespace, source = session.metadata.namespace, session.status.worker or ""
    worker = snap.worker(namespace, source)
    if worker is not None:
        (step,) = migration_plan(snap, worker, [session], now)
    else:
        (step,) = _plan(snap, namespace, source, [session], now, None)
    assert step.reason is not None, "a session migrating now is placed or told why not"
    return Placement(step.target, step.reason, step.message)
