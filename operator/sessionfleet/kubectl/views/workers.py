"""A worker's DrainPolicy and where its drain stands, in a few words and countdowns.

Shared by ``status`` (its POLICY, DRAIN and DEADLINE columns) and ``drain`` / ``undrain``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sessionfleet.api import (
    ConditionStatus,
    ConditionType,
    DeadlineAction,
    DrainMode,
    DrainPolicySpec,
    InferenceWorker,
    WorkerPhase,
    parse_duration,
)
from sessionfleet.kubectl.views.format import NONE, countdown
from sessionfleet.kubectl.views.snapshot import condition
from sessionfleet.policy.drain import PolicyChoice


def policy_label(choice: PolicyChoice) -> str:
    """Return the governing policy in a few words: its name, or ``default`` and why."""
    if choice.name is not None:
        return choice.name
    return "default" if choice.reason is None else f"default ({choice.reason.value})"


def policy_origin(choice: PolicyChoice, worker: InferenceWorker) -> str:
    """Return the policy and how it was chosen, for a sentence."""
    if choice.name is not None:
        how = (
            "named by spec.drainPolicyRef"
            if worker.spec.drain_policy_ref == choice.name
            else "its selector matches the worker's labels"
        )
        return f"DrainPolicy {choice.name} ({how})"
    if choice.reason is None:
        return "the built-in default (no DrainPolicy selects the worker)"
    return f"the built-in default ({choice.reason.value}: {choice.message})"


@dataclass(frozen=True)
class DrainView:
    """Where a worker's drain stands, and when its next steps come."""

    state: str
    """:data:`NONE`; ``Requested`` (spec.drain, not acted on yet); the Draining
    condition's reason (``SessionsPinned``, ``GracePeriodExpired``, ``Migrating``,
    ``DeadlineReached``); or ``Drained``."""
    started_at: datetime | None = None
    migrate_at: datetime | None = None
    """When the sessions still pinned start to move (Migrate: the start; Wait: never)."""
    deadline_at: datetime | None = None
    on_deadline: DeadlineAction = DeadlineAction.RELEASE
    message: str = ""

    @property
    def active(self) -> bool:
        """Whether a drain is in progress (not over, not merely requested)."""
        return self.started_at is not None and self.state not in (NONE, "Drained", "Requested")


def drain_view(worker: InferenceWorker, choice: PolicyChoice) -> DrainView:
    """Return the state of ``worker``'s drain under the policy that governs it."""
    status = worker.status
    draining = condition(status.conditions, ConditionType.DRAINING)
    message = draining.message if draining is not None else ""
    if status.phase is WorkerPhase.DRAINED:
        return DrainView("Drained", status.drain_started_at, message=message)
    in_progress = status.phase is WorkerPhase.DRAINING or (
        draining is not None and draining.status is ConditionStatus.TRUE
    )
    if in_progress:
        started = status.drain_started_at
        state = (
            draining.reason
            if draining is not None and draining.status is ConditionStatus.TRUE
            else WorkerPhase.DRAINING.value
        )
        migrate_at, deadline_at = _drain_times(choice.spec, started)
        return DrainView(
            state, started, migrate_at, deadline_at, choice.spec.on_deadline, message=message
        )
    if worker.spec.drain:
        return DrainView("Requested", message="spec.drain is true; the operator has not acted yet")
    return DrainView(NONE)


def _drain_times(
    policy: DrainPolicySpec, started: datetime | None
) -> tuple[datetime | None, datetime | None]:
    """Return when a drain started at ``started`` migrates and reaches its deadline."""
    if started is None:
        return None, None
    deadline = started + parse_duration(policy.deadline)
    if policy.mode is DrainMode.MIGRATE:
        return started, deadline
    if policy.mode is DrainMode.WAIT_THEN_MIGRATE:
        return started + parse_duration(policy.grace_period), deadline
    return None, deadline


def drain_cell(view: DrainView, now: datetime) -> str:
    """Return the DRAIN column: the state, and when migration starts if it is to come."""
    if view.active and view.migrate_at is not None and view.migrate_at > now:
        return f"{view.state} (migrates {countdown(view.migrate_at, now)})"
    return view.state


def deadline_cell(view: DrainView, now: datetime) -> str:
    """Return the DEADLINE column: a countdown, or how long ago it passed and what then."""
    if not view.active or view.deadline_at is None:
        return NONE
    if view.deadline_at > now:
        return countdown(view.deadline_at, now)
    return f"{countdown(view.deadline_at, now)} ({view.on_deadline.value})"
