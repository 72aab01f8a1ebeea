"""``kubectl sessionfleet explain session``: why a session is where it is, as text or data."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any

from sessionfleet.api import (
    AgentSession,
    ConditionType,
    InferenceWorker,
    Reason,
    SessionPhase,
    WorkerPhase,
)
from sessionfleet.kubectl.views.events import EventView, conditions_table, events_table
from sessionfleet.kubectl.views.format import age_of, countdown, indent, maybe_time, percent, tokens
from sessionfleet.kubectl.views.migration import migration_target
from sessionfleet.kubectl.views.placement import placement_now, serving
from sessionfleet.kubectl.views.sessions import context_tokens, session_phase, session_record
from sessionfleet.kubectl.views.snapshot import Snapshot, condition, created_at
from sessionfleet.policy.handshake import acks_of
from sessionfleet.policy.placement import Placement


def _reason_text(reason: str) -> str:
    """Return the documentation sentence of a reason the API defines, else ``""``."""
    try:
        return Reason(reason).description
    except ValueError:
        return ""


def explain_session(
    session: AgentSession,
    events: Sequence[EventView],
    snap: Snapshot,
    now: datetime,
    *,
    events_problem: str | None = None,
) -> str:
    """Return why a session is where it is: its state, the reasons, its conditions and events.

    ``snap`` holds the namespace's workers and sessions, for what the conditions cannot
    say: which workers serve the model, whether one has room now, where a migrating
    session is likely to go. ``events_problem``: why no events could be listed.
    """
    meta, spec, status = session.metadata, session.spec, session.status
    phase = session_phase(session)
    lines = [
        f"Session:     {spec.session_id}",
        f"Object:      AgentSession {meta.namespace}/{meta.name}",
        f"Model:       {spec.model}",
        f"Phase:       {phase}",
        f"Created:     {age_of(created_at(meta), now)} ago",
    ]
    if spec.worker_pin:
        lines.append(f"Pinned to:   {spec.worker_pin} (spec.workerPin)")
    elif spec.worker_hint:
        lines.append(f"Hint:        {spec.worker_hint} (spec.workerHint)")
    if spec.parent_session_id:
        lines.append(f"Parent:      {spec.parent_session_id}")
    if status.worker:
        epoch = f", epoch {status.epoch}" if status.epoch is not None else ""
        pod = f"pod {status.pod}" if status.pod else "no pod recorded"
        lines.append(f"Worker:      {status.worker} ({pod}{epoch})")
    if status.turns:
        lines.append(
            f"Turns:       {status.turns}, context ~{tokens(context_tokens(session))} tokens, "
            f"hit rate {percent(status.hit_rate_percent)}"
        )
    lines += ["", *_why(session, snap, now)]
    if status.migrations:
        lines += ["", "Migrations:"]
        for move in status.migrations:
            via = (
                f" through checkpoint {move.checkpoint}"
                if move.checkpoint
                else ", without a checkpoint"
            )
            recomputed = (
                f", {move.recomputed_tokens} tokens recomputed"
                if move.recomputed_tokens is not None
                else ""
            )
            lines.append(
                f"  {move.from_worker} -> {move.to_worker} ({move.reason.value}) "
                f"{age_of(move.at, now)} ago{via}{recomputed}"
            )
    lines += ["", "Conditions:", *indent(conditions_table(status.conditions, now))]
    listed = events_table(events, now) if events_problem is None else events_problem
    lines += ["", "Events:", *indent(listed)]
    return "\n".join(lines)


_LABEL = re.compile(r"^(\w[\w ]*:) +")


def _sentences(lines: Iterable[str]) -> list[str]:
    """Return lines of the text layout without its column padding: ``Why: not bound: ...``."""
    return [_LABEL.sub(r"\1 ", line.strip()) for line in lines if line.strip()]


def _placement_record(placement: Placement) -> dict[str, Any]:
    return {
        "worker": placement.worker,
        "reason": placement.reason.value,
        "message": placement.message,
    }


def _event_record(event: EventView) -> dict[str, Any]:
    return {
        "type": event.type or None,
        "reason": event.reason or None,
        "message": event.message,
        "from": event.source or None,
        "count": event.count,
        "lastSeen": maybe_time(event.last_seen),
    }


def explain_session_record(
    session: AgentSession,
    events: Sequence[EventView],
    snap: Snapshot,
    now: datetime,
    *,
    events_problem: str | None = None,
) -> dict[str, Any]:
    """Return ``explain session`` as ``--output json|yaml`` shows it: the same answer as data.

    The session's row (as ``sessions -o json``) with its wishes, the Ready condition's
    reason and what it means, the explanation's sentences, where placement would put it
    now (Pending: placed as a new session; Migrating: its likely target), the routers
    that acknowledged a migration, its migrations, conditions and events.
    """
    spec, status = session.spec, session.status
    reason, message = _ready_reason(session)
    phase = status.phase
    placement: Placement | None = None
    if phase is SessionPhase.PENDING:
        placement = placement_now(snap, session)
    elif phase is SessionPhase.MIGRATING:
        placement = migration_target(snap, session, now)
    return {
        **session_record(session, now),
        "workerPin": spec.worker_pin,
        "workerHint": spec.worker_hint,
        "parentSessionId": spec.parent_session_id,
        "pod": status.pod,
        "epoch": status.epoch,
        "ready": {
            "reason": reason or None,
            "message": message or None,
            "meaning": _reason_text(reason) or None,
        },
        "explanation": _sentences(_why(session, snap, now)),
        "placementNow": _placement_record(placement) if placement is not None else None,
        "acknowledgedBy": (
            sorted(acks_of(session.metadata.annotations))
            if phase is SessionPhase.MIGRATING
            else None
        ),
        "migrations": [move.wire() for move in status.migrations],
        "conditions": [c.wire() for c in status.conditions],
        "events": [_event_record(e) for e in events] if events_problem is None else None,
        "eventsProblem": events_problem,
    }


def _ready_reason(session: AgentSession) -> tuple[str, str]:
    ready = condition(session.status.conditions, ConditionType.READY)
    return (ready.reason, ready.message) if ready is not None else ("", "")


def _why(session: AgentSession, snap: Snapshot, now: datetime) -> list[str]:
    """Return the paragraph that answers "why is it so" for the session's phase."""
    status, namespace = session.status, session.metadata.namespace
    reason, message = _ready_reason(session)
    explained = _reason_text(reason)
    because = f"{reason}: {message}" if reason else ""
    phase = status.phase
    if phase is None:
        return [
            "Why:         the operator has not handled this session yet (no status). It binds a",
            "             new session as soon as it sees it: is an operator running for "
            f"namespace {namespace}?",
        ]
    if phase is SessionPhase.PENDING:
        lines = [f"Why:         not bound: {because or 'no Ready condition yet'}"]
        if explained:
            lines.append(f"             ({explained})")
        lines += _candidates(session, snap)
        now_placed = placement_now(snap, session)
        if now_placed.worker is not None:
            lines.append(
                f"Now:         placement would choose {now_placed.worker} "
                f"({now_placed.message}); the operator binds it on its next pass"
            )
        else:
            lines.append(f"Now:         still no place: {now_placed.message}")
        return lines
    worker = snap.worker(namespace, status.worker) if status.worker else None
    if phase is SessionPhase.MIGRATING:
        return _migrating(session, worker, snap, now)
    if phase is SessionPhase.RESTORING:
        lines = [
            f"Why:         its worker {status.worker} is being recreated; turns are held until "
            "it is Ready again",
        ]
        if worker is not None:
            recovering = condition(worker.status.conditions, ConditionType.RECOVERING)
            if recovering is not None and recovering.message:
                lines.append(f"Worker:      {recovering.reason}: {recovering.message}")
        return lines
    if phase is SessionPhase.BOUND:
        since = f" since {age_of(status.bound_at, now)} ago" if status.bound_at else ""
        lines = [f"Bound:       to {status.worker}{since}: its turns go there"]
        if worker is not None and worker.status.phase is WorkerPhase.DRAINING:
            draining = condition(worker.status.conditions, ConditionType.DRAINING)
            detail = f": {draining.message}" if draining is not None else ""
            lines.append(f"Worker:      {status.worker} is Draining{detail}")
        elif worker is None and status.worker:
            lines.append(f"Worker:      {status.worker} was not found")
        return lines
    if phase is SessionPhase.FINISHED:
        lines = [f"Why:         finished: {because or 'the session ended'}"]
        if status.finished_at is not None:
            expires = status.finished_at + timedelta(
                seconds=session.spec.ttl_seconds_after_finished
            )
            lines.append(
                f"             deleted {countdown(expires, now)} (ttlSecondsAfterFinished "
                f"{session.spec.ttl_seconds_after_finished})"
            )
        return lines
    return [f"Why:         lost: {because or 'its worker is gone'}"] + (
        [f"             ({explained})"] if explained else []
    )


def _candidates(session: AgentSession, snap: Snapshot) -> list[str]:
    """Return the workers that could take the session, or what the namespace serves."""
    namespace, model = session.metadata.namespace, session.spec.model
    candidates = serving(snap, namespace, model)
    if candidates:
        briefs = ", ".join(_worker_brief(w, len(snap.sessions_of(w))) for w in candidates)
        return [f"Workers:     serving {model}: {briefs}"]
    served = sorted({w.spec.model for w in snap.workers if w.metadata.namespace == namespace})
    elsewhere = f"; the workers here serve {', '.join(served)}" if served else ""
    return [f"Workers:     no worker in {namespace} serves {model}{elsewhere}"]


def _migrating(
    session: AgentSession, worker: InferenceWorker | None, snap: Snapshot, now: datetime
) -> list[str]:
    status = session.status
    source = status.worker or "?"
    since = status.migrating_since
    lines = [
        f"Migrating:   leaving {source}"
        + (f", asked {age_of(since, now)} ago" if since is not None else "")
        + "; routers hold its next turn until each has acknowledged that none is in flight",
    ]
    if worker is not None:
        draining = condition(worker.status.conditions, ConditionType.DRAINING)
        if draining is not None and draining.message:
            lines.append(f"Because:     {source} drains: {draining.message}")
    acks = sorted(acks_of(session.metadata.annotations))
    lines.append(f"Acknowledged: {', '.join(acks) if acks else 'by no router yet'}")
    target = migration_target(snap, session, now)
    if target.worker is not None:
        lines.append(
            f"Target:      {target.worker} if it moved now ({target.message}); chosen when it moves"
        )
    else:
        lines.append(f"Target:      none now: {target.message}; it stays until the deadline")
    return lines


def _worker_brief(worker: InferenceWorker, held: int) -> str:
    phase = worker.status.phase.value if worker.status.phase is not None else "no phase yet"
    drain = ", drain requested" if worker.spec.drain and phase != "Drained" else ""
    return f"{worker.metadata.name} ({phase}{drain}, {held}/{worker.spec.capacity.max_sessions})"
