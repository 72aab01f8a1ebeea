"""``kubectl sessionfleet drain`` and ``undrain``: what the command did and what follows.

Where each pinned session would move is the operator's own batch decision,
:func:`~sessionfleet.policy.migration.plan_migration`, run over inputs built from the
snapshot: the preview and the operator cannot disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sessionfleet.api import (
    AgentSession,
    DeadlineAction,
    DrainMode,
    DrainPolicySpec,
    InferenceWorker,
    MigrationScope,
    Reason,
    parse_duration,
)
from sessionfleet.kubectl.views.format import (
    NONE,
    age_of,
    countdown,
    indent,
    table,
    tokens,
    wire_time,
)
from sessionfleet.kubectl.views.migration import migration_plan
from sessionfleet.kubectl.views.sessions import context_tokens, session_phase
from sessionfleet.kubectl.views.snapshot import Snapshot
from sessionfleet.kubectl.views.workers import drain_view, policy_origin
from sessionfleet.policy.migration import through_checkpoint


def _mode_text(policy: DrainPolicySpec) -> str:
    return f"{policy.mode.value}: {policy.mode.description}"


def _move_text(policy: DrainPolicySpec, worker: InferenceWorker) -> str:
    """Return how sessions move under the policy: alone or with the worker, cached or not."""
    if policy.migration_scope is MigrationScope.WORKER:
        return (
            "the whole worker is checkpointed and restarted on a node that is not draining; "
            "its sessions follow it"
        )
    driver = worker.spec.checkpoint.driver
    if through_checkpoint(policy, driver):
        return (
            f"each moves at its next turn boundary through a checkpoint (driver {driver.value}): "
            "its next turn is served from cache"
        )
    why = "policy checkpoint: false" if not policy.checkpoint else "the worker's driver is none"
    return f"each moves at its next turn boundary without its cache ({why}): recomputed"


def _deadline_text(policy: DrainPolicySpec) -> str:
    if policy.on_deadline is DeadlineAction.RELEASE:
        return (
            "the holds are removed and the drain proceeds; sessions still pinned lose their cache"
        )
    return "the holds stay: the platform's own deadline decides"


def drain_timeline(
    policy: DrainPolicySpec,
    worker: InferenceWorker,
    pinned_count: int,
    start: datetime,
    now: datetime,
) -> list[tuple[str, str]]:
    """Return what the drain does and when, as (when, what) rows, from ``start``."""
    name = worker.metadata.name
    end = (
        f"{name} is Drained: its pod is deleted, and it stays Drained until "
        f"kubectl sessionfleet undrain {name}"
    )
    if pinned_count == 0:
        return [("now", f"no session is pinned: {end}")]

    def when(offset: str) -> str:
        moment = start + parse_duration(offset)
        return f"{countdown(moment, now)} ({wire_time(moment)})"

    held = (
        "the pinned session keeps its"
        if pinned_count == 1
        else f"the {pinned_count} pinned sessions keep their"
    )
    if policy.migration_scope is MigrationScope.WORKER:
        move = f"{name} moves whole to a node that is not draining; its sessions follow it"
    else:
        them = "the pinned session moves" if pinned_count == 1 else "the pinned sessions move"
        move = f"{them} to other workers, each at its next turn boundary"
    rows = [("now", f"hold: no new session goes to {name}; {held} turns here")]
    if policy.mode is DrainMode.MIGRATE:
        rows[0] = ("now", move)
    elif policy.mode is DrainMode.WAIT_THEN_MIGRATE:
        rows.append((f"grace {policy.grace_period}, {when(policy.grace_period)}", move))
    rows.append((f"deadline {policy.deadline}, {when(policy.deadline)}", _deadline_text(policy)))
    rows.append(("once none is pinned", end))
    return rows


def drain_targets(
    snap: Snapshot, worker: InferenceWorker, sessions: Sequence[AgentSession], now: datetime
) -> dict[str, str]:
    """Return where each session would move if it moved now, by session name.

    The operator's own :func:`~sessionfleet.policy.migration.plan_migration` decides
    (:func:`~sessionfleet.kubectl.views.migration.migration_plan`): one after another,
    each counted against its target for the next.
    """
    out = {}
    for step in migration_plan(snap, worker, sessions, now):
        reason = step.reason.value if step.reason is not None else step.action.name
        out[step.session.name] = step.target or f"none ({reason})"
    return out


def _migrates(policy: DrainPolicySpec) -> bool:
    return policy.mode is not DrainMode.WAIT


def drain_preview(
    snap: Snapshot,
    worker: InferenceWorker,
    now: datetime,
    *,
    dry_run: bool,
    was_set: bool,
) -> str:
    """Return what ``drain`` did (or, ``dry_run``, would do) and what the policy does next.

    ``worker`` is as read before the patch; ``was_set``: its ``spec.drain`` was already
    true, so nothing changes.
    """
    choice = snap.policy_choice(worker)
    policy = choice.spec
    name, namespace = worker.metadata.name, worker.metadata.namespace
    if was_set:
        head = f"InferenceWorker {namespace}/{name}: spec.drain is already true"
    elif dry_run:
        head = f"InferenceWorker {namespace}/{name}: spec.drain would be set to true (dry run)"
    else:
        head = f"InferenceWorker {namespace}/{name}: spec.drain set to true"
    lines = [head, ""]
    view = drain_view(worker, choice)
    if view.active and view.started_at is not None:
        lines.append(
            f"Draining:     since {age_of(view.started_at, now)} ago ({view.state}); "
            "times below count from then"
        )
    elif view.state == "Drained":
        lines.append("Drained:      already; nothing is pinned")
    lines += [
        f"Policy:       {policy_origin(choice, worker)}",
        f"Mode:         {_mode_text(policy)}",
        "Grace period: "
        + (
            policy.grace_period
            if policy.mode is DrainMode.WAIT_THEN_MIGRATE
            else f"{policy.grace_period} (not used by mode {policy.mode.value})"
        ),
        f"Deadline:     {policy.deadline}",
        f"At deadline:  {policy.on_deadline.value}: {_deadline_text(policy)}",
        f"Holds:        {', '.join(sorted(h.value for h in policy.holds)) or 'none'}",
    ]
    if _migrates(policy):
        lines.append(f"Migration:    {_move_text(policy, worker)}")
    warnings = []
    if not policy.triggers.worker_drain:
        warnings.append(
            "warning: this policy does not drain on spec.drain (triggers.workerDrain is false): "
            "only a cordon or a disruption taint of the node starts a drain"
        )
    if choice.reason is not None:
        warnings.append(f"warning: {choice.message}")
    held = snap.sessions_of(worker)
    start = view.started_at if view.active and view.started_at is not None else now
    lines += ["", "What happens:"]
    lines += indent(table(("when", "what"), drain_timeline(policy, worker, len(held), start, now)))
    lines += ["", _pinned_heading(policy, len(held))]
    if held:
        targets = drain_targets(snap, worker, held, now) if _migrates(policy) else {}
        rows = [
            [
                s.spec.session_id,
                session_phase(s),
                str(s.status.turns or 0),
                tokens(context_tokens(s)),
                *([targets.get(s.metadata.name, NONE)] if targets else []),
            ]
            for s in sorted(held, key=lambda s: s.spec.session_id)
        ]
        headers = ("id", "phase", "turns", "context", *(("target now",) if targets else ()))
        lines += indent(table(headers, rows))
    if warnings:
        lines += ["", *warnings]
    return "\n".join(lines)


def _pinned_heading(policy: DrainPolicySpec, count: int) -> str:
    if not count:
        return "Pinned sessions: none"
    fate = {
        DrainMode.WAIT: f"waited for until they finish, at most {policy.deadline}",
        DrainMode.MIGRATE: "migrated now",
        DrainMode.WAIT_THEN_MIGRATE: f"waited for {policy.grace_period}, then migrated",
    }[policy.mode]
    return f"Pinned sessions ({count}), {fate}:"


def undrain_summary(
    snap: Snapshot, worker: InferenceWorker, now: datetime, *, dry_run: bool, was_set: bool
) -> str:
    """Return what ``undrain`` did (or would do) and what follows from it."""
    name, namespace = worker.metadata.name, worker.metadata.namespace
    if not was_set:
        head = f"InferenceWorker {namespace}/{name}: spec.drain is already false"
    elif dry_run:
        head = f"InferenceWorker {namespace}/{name}: spec.drain would be set to false (dry run)"
    else:
        head = f"InferenceWorker {namespace}/{name}: spec.drain set to false"
    lines = [head]
    choice = snap.policy_choice(worker)
    view = drain_view(worker, choice)
    held = len(snap.sessions_of(worker))
    by_request = Reason.DRAIN_REQUESTED.value in view.message
    if view.state == "Drained":
        epoch = (worker.status.epoch or 0) + 1
        lines.append(
            f"It is Drained: a new pod ({name}-{epoch}) starts, and new sessions are placed "
            "on it once it is Ready"
        )
    elif view.active and (by_request or not view.message):
        lines.append(
            f"It is draining ({view.state}, since {age_of(view.started_at, now)} ago): the drain "
            f"stops, unless its node is cordoned or tainted for a disruption; the {held} "
            f"session(s) still pinned stay on {name}, and those already moved stay where they are"
        )
    elif view.active:
        lines.append(
            f"It is draining for another reason ({view.message}): spec.drain does not stop that"
        )
    elif view.state == "Requested":
        lines.append("The operator had not started the drain: nothing else changes")
    return "\n".join(lines)
