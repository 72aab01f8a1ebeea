"""Drains: what starts one, which policy governs it, and what to do at each moment.

Pure functions over observations, shared by the operator and the fleet simulator:

- :func:`drain_trigger` says whether (and why) a worker must drain;
- :func:`resolve_policy` picks the DrainPolicy for a worker (explicit reference, else
  the single matching selector, else the built-in default; two matches conflict, and a
  reference to a missing or invalid policy is reported as such);
- :func:`decide_drain` says, at time ``now``, whether to hold, migrate which
  sessions, release, or declare the drain done — and when to look again.

Holds are kept whenever sessions are pinned, not only during a drain: ``kubectl
drain`` cordons and evicts in the same breath, so a hold put up after the cordon
would come too late.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from sessionfleet.api import (
    DeadlineAction,
    DrainMode,
    DrainPolicySpec,
    HoldMechanism,
    Reason,
    parse_duration,
)
from sessionfleet.api.drainpolicy import DrainTriggers
from sessionfleet.policy.observed import NodeState

DEFAULT_POLICY = DrainPolicySpec()
"""The built-in policy when none is referenced or selects the worker: WaitThenMigrate,
2 minutes' grace, a 10-minute deadline, then Release — inside EKS's 15-minute window."""


def drain_trigger(
    worker_drain: bool, node: NodeState | None, triggers: DrainTriggers
) -> Reason | None:
    """Return why the worker must drain, or ``None`` when nothing asks for it."""
    if worker_drain and triggers.worker_drain:
        return Reason.DRAIN_REQUESTED
    if node is None:
        return None
    if triggers.node_cordon and node.unschedulable:
        return Reason.NODE_CORDONED
    if node.taint_keys.intersection(triggers.taints):
        return Reason.DISRUPTION_TAINT
    return None


@dataclass(frozen=True, slots=True)
class PolicyChoice:
    """The policy that governs a worker, and how it was chosen."""

    name: str | None
    spec: DrainPolicySpec
    reason: Reason | None = None
    message: str = ""
    conflicting: tuple[str, ...] = ()
    """With :attr:`Reason.POLICY_CONFLICT`: the policies that all select the worker."""


def selecting(labels: Mapping[str, str], policies: Mapping[str, DrainPolicySpec]) -> list[str]:
    """Return the names of the policies whose selector matches ``labels``, sorted."""
    return sorted(name for name, spec in policies.items() if spec.selector.matches(labels))


def resolve_policy(
    labels: Mapping[str, str],
    reference: str | None,
    policies: Mapping[str, DrainPolicySpec],
    invalid: Mapping[str, str] | None = None,
) -> PolicyChoice:
    """Choose the DrainPolicy of a worker from the policies in its namespace.

    ``policies`` are the ones whose spec parsed; ``invalid`` maps the others' names to
    why they did not. A reference to a missing or an invalid policy, or a conflict, is
    reported with a reason; the worker then drains under the built-in default rather
    than not at all.
    """
    if reference is not None:
        if reference in policies:
            return PolicyChoice(reference, policies[reference])
        if invalid is not None and reference in invalid:
            return PolicyChoice(
                None,
                DEFAULT_POLICY,
                Reason.POLICY_INVALID,
                f"DrainPolicy {reference} is invalid: {invalid[reference]}; "
                "using the built-in default",
            )
        return PolicyChoice(
            None,
            DEFAULT_POLICY,
            Reason.POLICY_NOT_FOUND,
            f"DrainPolicy {reference} does not exist; using the built-in default",
        )
    matching = selecting(labels, policies)
    if len(matching) == 1:
        return PolicyChoice(matching[0], policies[matching[0]])
    if len(matching) > 1:
        return PolicyChoice(
            None,
            DEFAULT_POLICY,
            Reason.POLICY_CONFLICT,
            f"DrainPolicies {', '.join(matching)} all select this worker; "
            "set spec.drainPolicyRef or narrow their selectors (using the built-in default)",
            conflicting=tuple(matching),
        )
    return PolicyChoice(None, DEFAULT_POLICY)


@dataclass(frozen=True, slots=True)
class PinnedSession:
    """A session still pinned to the draining worker.

    Whether one of its turns is in flight is not known here (the operator cannot see
    it): a session moves at a turn boundary through the routers' handshake
    (:mod:`.migration`), not by being left out of the drain's decision.
    """

    name: str


@dataclass(frozen=True, slots=True)
class DrainDecision:
    """What to do now. ``recheck_after`` is when the decision can next change (seconds)."""

    hold: bool
    migrate: tuple[str, ...] = ()
    done: bool = False
    released: bool = False
    reason: Reason = Reason.SESSIONS_PINNED
    message: str = ""
    recheck_after: float | None = None
    holds: frozenset[HoldMechanism] = field(default_factory=frozenset)


def decide_drain(
    policy: DrainPolicySpec,
    started_at: datetime,
    now: datetime,
    pinned: Sequence[PinnedSession],
) -> DrainDecision:
    """Decide a drain step from the policy, the time elapsed and the pinned sessions.

    Migrating names every pinned session; :func:`.migration.plan_migration` then moves
    each at a turn boundary. ``hold`` means keep the PodDisruptionBudget and annotations.
    """
    holds = frozenset(policy.holds)
    elapsed = (now - started_at).total_seconds()
    grace = parse_duration(policy.grace_period).total_seconds()
    deadline = parse_duration(policy.deadline).total_seconds()

    if not pinned:
        return DrainDecision(
            hold=False, done=True, reason=Reason.DRAINED, message="no session is pinned"
        )

    if elapsed >= deadline:
        if policy.on_deadline is DeadlineAction.RELEASE:
            return DrainDecision(
                hold=False,
                released=True,
                reason=Reason.DEADLINE_REACHED,
                message=(
                    f"deadline {policy.deadline} passed with {len(pinned)} session(s) pinned; "
                    "hold released, they lose their cache"
                ),
            )
        return DrainDecision(
            hold=True,
            holds=holds,
            reason=Reason.DEADLINE_REACHED,
            message=f"deadline {policy.deadline} passed; holding as the policy says",
        )

    migrating = policy.mode is DrainMode.MIGRATE or (
        policy.mode is DrainMode.WAIT_THEN_MIGRATE and elapsed >= grace
    )
    if migrating:
        return DrainDecision(
            hold=True,
            holds=holds,
            migrate=tuple(s.name for s in pinned),
            reason=Reason.GRACE_PERIOD_EXPIRED
            if policy.mode is DrainMode.WAIT_THEN_MIGRATE
            else Reason.MIGRATING,
            message=f"migrating {len(pinned)} session(s)",
            recheck_after=deadline - elapsed,
        )

    next_change = grace if policy.mode is DrainMode.WAIT_THEN_MIGRATE else deadline
    return DrainDecision(
        hold=True,
        holds=holds,
        reason=Reason.SESSIONS_PINNED,
        message=f"waiting for {len(pinned)} pinned session(s) to finish",
        recheck_after=max(next_change - elapsed, 0.0),
    )


def holds_while_pinned(policy: DrainPolicySpec, pinned_sessions: int) -> frozenset[HoldMechanism]:
    """Return the holds a worker needs outside a drain: all of its policy's, while pinned."""
    return frozenset(policy.holds) if pinned_sessions > 0 else frozenset()
