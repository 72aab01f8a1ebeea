"""The worker decision: from everything observed of one worker, the plan for it.

One pure function, :func:`plan_worker`, chains small decisions: a requested drain
that is done, a fresh epoch, recovery, then a running worker's drain, phase and
conditions. The
controller carries the plan out (create or delete pods, keep holds, migrate
sessions) and writes the status it describes only when it differs from the one
observed.

Each decision that changes what the observed status says (a drain started, held, at
its deadline or completed; an epoch replaced; recovery backing off or capped; a policy
that cannot be resolved) also puts a :class:`~sessionfleet.policy.events.Notice` in
the plan. A notice is decided against the observed status, so it comes once: the
controller records it with the status write that carries the decision, and the next
pass, which observes that status, decides the same thing without a notice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Final

from sessionfleet.api import (
    ConditionStatus,
    ConditionType,
    HoldMechanism,
    InferenceWorkerSpec,
    InferenceWorkerStatus,
    MigrationScope,
    Reason,
    WorkerPhase,
)
from sessionfleet.policy.drain import (
    PinnedSession,
    PolicyChoice,
    decide_drain,
    drain_trigger,
    holds_while_pinned,
)
from sessionfleet.policy.events import EventType, Notice
from sessionfleet.policy.migration import through_checkpoint
from sessionfleet.policy.observed import NodeState, PodState
from sessionfleet.policy.recovery import (
    DEFAULT_NODE_NOT_READY_TOLERATION,
    RecoveryBlock,
    pod_phase,
    recovery_backoff,
    recovery_reason,
)


def pod_name(worker: str, epoch: int) -> str:
    """Return the name of a worker's pod in an epoch: ``<worker>-<epoch>``."""
    return f"{worker}-{epoch}"


@dataclass(frozen=True, slots=True)
class WorkerObservation:
    """Everything the operator knows of one worker at one moment."""

    name: str
    spec: InferenceWorkerSpec
    status: InferenceWorkerStatus
    pods: Sequence[PodState]
    node: NodeState | None
    pinned: Sequence[PinnedSession]
    policy: PolicyChoice
    now: datetime
    node_not_ready_toleration: timedelta = DEFAULT_NODE_NOT_READY_TOLERATION
    recovery_block: RecoveryBlock | None = None
    """Set when the fleet-wide gate holds back moving workers off NotReady nodes."""


@dataclass(frozen=True, slots=True)
class ConditionPlan:
    """A condition the worker should carry."""

    type: ConditionType
    status: ConditionStatus
    reason: Reason
    message: str


@dataclass(frozen=True, slots=True)
class WorkerPlan:
    """What the worker should look like, and what to do to get there."""

    phase: WorkerPhase
    epoch: int
    create_pod: bool
    delete_pods: tuple[str, ...]
    pod: str | None
    node: str | None
    endpoint: str | None
    drain_started_at: datetime | None
    holds: frozenset[HoldMechanism]
    migrate: tuple[str, ...] = ()
    migrate_through_checkpoint: bool = False
    move_worker: bool = False
    """Migration scope Worker: checkpoint the whole worker, then replace its pod elsewhere
    (the new epoch restores the checkpoint and the sessions follow the worker)."""
    recovery: Reason | None = None
    consecutive_failures: int = 0
    last_recovery_at: datetime | None = None
    drain_done: bool = False
    conditions: tuple[ConditionPlan, ...] = field(default=())
    recheck_after: float | None = None
    notices: tuple[Notice, ...] = ()
    """Events for the decisions this plan takes that the observed status does not record
    yet; recorded with the status write that records them."""


def carries(status: InferenceWorkerStatus, condition: ConditionPlan) -> bool:
    """Whether ``status`` already has ``condition`` (its status and reason; not its message).

    A message may change on every pass (a back-off's seconds left): only a change of
    status or reason is news.
    """
    return any(
        c.type is condition.type and c.status is condition.status and c.reason == condition.reason
        for c in status.conditions
    )


def plan_worker(obs: WorkerObservation) -> WorkerPlan:
    """Decide the worker's pods, holds, migrations, phase and conditions.

    A chain of small decisions, the first that applies wins: a drain asked for and
    done keeps the worker down; a worker with no pod yet (or back from such a drain)
    starts a fresh epoch; a lost pod starts a new one (or backs off); otherwise the
    running worker's drain, phase and conditions are decided.
    """
    facts = _facts(obs)
    plan = _drained_on_request(facts) or _fresh_epoch(facts) or _recovery(facts) or _running(facts)
    return replace(plan, notices=(*_epoch_notices(obs, plan.epoch, plan.recovery), *plan.notices))


def settled(obs: WorkerObservation, plan: WorkerPlan) -> bool:
    """Whether the worker's plan stays as it is until one of the objects it reads changes.

    A Ready worker on a Ready node, with nothing to create, delete, migrate or move and
    no periodic checkpoint, is left alone until an event touches it (its own, its pods',
    its node's, its sessions', a policy's). Any other worker's plan depends on the clock
    too (grace periods, deadlines, back-offs, the NotReady toleration, checkpoint
    intervals), so the fleet loop looks at it on every pass.
    """
    return (
        plan.phase is WorkerPhase.READY
        and obs.status.phase is WorkerPhase.READY
        and plan.recheck_after is None
        and not (plan.create_pod or plan.delete_pods or plan.migrate or plan.move_worker)
        and obs.node is not None
        and obs.node.ready
        and obs.spec.checkpoint.interval is None
    )


@dataclass(frozen=True, slots=True)
class _Facts:
    """What every decision of :func:`plan_worker` reads, worked out once."""

    obs: WorkerObservation
    epoch: int
    """The newest epoch: the status's, or a later pod's (our own write still in flight)."""
    current: PodState | None
    """This epoch's pod, if it exists."""
    observed: bool
    """Whether the status already records this epoch's pod (so it was created)."""
    stale: tuple[str, ...]
    """Pods of earlier epochs still to delete."""
    conditions: tuple[ConditionPlan, ...]
    """Conditions every plan carries (a DrainPolicy conflict)."""
    notices: tuple[Notice, ...]
    """Notices every plan carries (a DrainPolicy conflict not yet in the status)."""
    failures: int
    last_recovery: datetime | None
    recovery: Reason | None
    """Why this epoch's pod must be replaced, if it must and may now."""
    blocked: RecoveryBlock | None
    """What holds back moving the worker off its NotReady node, if anything does."""


def _facts(obs: WorkerObservation) -> _Facts:
    # A pod of a later epoch than the status records means the status read is older
    # than our own last write: trust the pod, never delete it.
    epoch = max([obs.status.epoch or 0, *(p.epoch for p in obs.pods)])
    pods_by_name = {p.name: p for p in obs.pods}
    current = pods_by_name.get(pod_name(obs.name, epoch)) if epoch else None
    observed = obs.status.pod == pod_name(obs.name, epoch)
    recovery = recovery_reason(current, observed, obs.node, obs.now, obs.node_not_ready_toleration)
    # Only a move off a NotReady node is gated fleet-wide: a failed pod is always replaced.
    blocked = obs.recovery_block if recovery is Reason.NODE_NOT_READY else None
    conditions: tuple[ConditionPlan, ...] = ()
    notices: tuple[Notice, ...] = ()
    conflict = obs.policy.reason
    if conflict is not None:
        unresolved = ConditionPlan(
            ConditionType.CONFLICT, ConditionStatus.TRUE, conflict, obs.policy.message
        )
        conditions = (unresolved,)
        event = _POLICY_EVENTS.get(conflict, "PolicyConflict")
        notices = _warning_if_new(obs, unresolved, event, "ResolvePolicy")
    return _Facts(
        obs=obs,
        epoch=epoch,
        current=current,
        observed=observed,
        stale=tuple(p.name for p in obs.pods if p.epoch < epoch and not p.deleting),
        conditions=conditions,
        notices=notices,
        failures=obs.status.consecutive_failures or 0,
        last_recovery=obs.status.last_recovery_at,
        recovery=recovery if blocked is None else None,
        blocked=blocked,
    )


_POLICY_EVENTS: Final = {
    Reason.POLICY_CONFLICT: "PolicyConflict",
    Reason.POLICY_NOT_FOUND: "PolicyNotFound",
    Reason.POLICY_INVALID: "PolicyInvalid",
}
"""The Event for each reason a worker's DrainPolicy cannot be resolved."""


def _epoch_notices(obs: WorkerObservation, epoch: int, why: Reason | None) -> tuple[Notice, ...]:
    """Return ``EpochReplaced`` if the plan's epoch follows the one the status records."""
    replaced = obs.status.epoch
    if replaced is None or epoch <= replaced:
        return ()
    return (
        Notice(
            EventType.NORMAL,
            "EpochReplaced",
            "Recover",
            f"epoch {epoch} replaces epoch {replaced}: {why.value if why else 'NewEpoch'}",
        ),
    )


def _down(
    facts: _Facts,
    phase: WorkerPhase,
    *conditions: ConditionPlan,
    notices: tuple[Notice, ...] = (),
    **plan: Any,
) -> WorkerPlan:
    """Return a plan for a worker with no serving pod: no endpoint, no holds."""
    fields: dict[str, Any] = {
        "epoch": facts.epoch,
        "create_pod": False,
        "delete_pods": facts.stale,
        "pod": None,
        "node": None,
        "endpoint": None,
        "drain_started_at": facts.obs.status.drain_started_at,
        "holds": frozenset(),
        "conditions": (*facts.conditions, *conditions),
        "notices": (*notices, *facts.notices),
        **plan,
    }
    return WorkerPlan(phase=phase, **fields)


def _drained_on_request(facts: _Facts) -> WorkerPlan | None:
    """``spec.drain`` and Drained: the pod was deleted on purpose; nothing runs."""
    obs = facts.obs
    if not (obs.spec.drain and obs.status.phase is WorkerPhase.DRAINED):
        return None
    return _down(
        facts,
        WorkerPhase.DRAINED,
        ConditionPlan(ConditionType.DRAINING, ConditionStatus.FALSE, Reason.DRAINED, "drained"),
        ConditionPlan(
            ConditionType.READY,
            ConditionStatus.FALSE,
            Reason.DRAINED,
            "drained on request (spec.drain)",
        ),
        delete_pods=tuple(p.name for p in obs.pods if not p.deleting),
        drain_done=True,
    )


def _fresh_epoch(facts: _Facts) -> WorkerPlan | None:
    """Start a fresh epoch: the first pod, or the first after a requested drain."""
    back = facts.obs.status.phase is WorkerPhase.DRAINED and facts.current is None
    if facts.epoch != 0 and not back:
        return None
    new_epoch = facts.epoch + 1
    return _down(
        facts,
        WorkerPhase.PENDING,
        ConditionPlan(
            ConditionType.READY,
            ConditionStatus.FALSE,
            Reason.POD_PENDING,
            f"creating pod {pod_name(facts.obs.name, new_epoch)}",
        ),
        epoch=new_epoch,
        create_pod=True,
        drain_started_at=None,
    )


def _recovery(facts: _Facts) -> WorkerPlan | None:
    """Replace a lost pod: back off after repeated failures, else start the next epoch."""
    reason = facts.recovery
    if reason is None:
        return None
    obs, epoch, failures = facts.obs, facts.epoch, facts.failures
    detail = f"pod {pod_name(obs.name, epoch)}: {_recovery_detail(reason, facts.current)}"
    if failures and facts.last_recovery is not None:
        wait = (recovery_backoff(failures) - (obs.now - facts.last_recovery)).total_seconds()
        if wait > 0:
            backing_off = ConditionPlan(
                ConditionType.RECOVERING,
                ConditionStatus.TRUE,
                Reason.RECOVERY_BACK_OFF,
                f"{failures} epoch(s) in a row failed before Ready; "
                f"epoch {epoch + 1} starts in {wait:.0f}s",
            )
            return _down(
                facts,
                WorkerPhase.RECOVERING,
                backing_off,
                ConditionPlan(
                    ConditionType.READY, ConditionStatus.FALSE, Reason.RECOVERY_BACK_OFF, detail
                ),
                notices=_warning_if_new(obs, backing_off, "RecoveryBackingOff", "Recover"),
                consecutive_failures=failures,
                last_recovery_at=facts.last_recovery,
                recheck_after=wait,
            )
    current = facts.current
    doomed = (current.name,) if current is not None and not current.deleting else ()
    new_epoch = epoch + 1
    return _down(
        facts,
        WorkerPhase.RECOVERING,
        ConditionPlan(ConditionType.RECOVERING, ConditionStatus.TRUE, reason, detail),
        ConditionPlan(
            ConditionType.READY,
            ConditionStatus.FALSE,
            Reason.NEW_EPOCH,
            f"starting pod {pod_name(obs.name, new_epoch)} (epoch {new_epoch})",
        ),
        epoch=new_epoch,
        create_pod=True,
        delete_pods=facts.stale + doomed,
        recovery=reason,
        consecutive_failures=failures + 1,
        last_recovery_at=obs.now,
    )


def _warning_if_new(
    obs: WorkerObservation, condition: ConditionPlan, reason: str, action: str
) -> tuple[Notice, ...]:
    """Return a Warning with ``condition``'s message, if the status does not carry it yet."""
    if carries(obs.status, condition):
        return ()
    return (Notice(EventType.WARNING, reason, action, condition.message),)


def _recovering_condition(facts: _Facts, still_recovering: bool, reason: Reason) -> ConditionPlan:
    blocked = facts.blocked
    if blocked is not None:
        node = facts.obs.node.name if facts.obs.node else "?"
        return ConditionPlan(
            ConditionType.RECOVERING,
            ConditionStatus.FALSE,
            blocked.reason,
            f"node {node} is NotReady, but {blocked.message}",
        )
    return ConditionPlan(
        ConditionType.RECOVERING,
        ConditionStatus.TRUE if still_recovering else ConditionStatus.FALSE,
        _recovery_cause(facts.obs.status) if still_recovering else reason,
        f"waiting for pod {pod_name(facts.obs.name, facts.epoch)}" if still_recovering else "",
    )


RECOVERY_CAUSES: Final = frozenset({Reason.POD_DELETED, Reason.POD_FAILED, Reason.NODE_NOT_READY})


def _recovery_cause(status: InferenceWorkerStatus) -> Reason:
    """Return why the worker is recovering, as its status says: kept until it is Ready.

    The cause stays the condition's reason while the new epoch's pod starts, not only in
    the write that started it: the cap on workers moving off NotReady nodes counts those
    whose reason is NodeNotReady until they are Ready (controllers/loop.py), and a
    reason replaced as soon as the new pod existed let the next worker move early.
    """
    for condition in status.conditions:
        if (
            condition.type is ConditionType.RECOVERING
            and condition.status is ConditionStatus.TRUE
            and condition.reason in RECOVERY_CAUSES
        ):
            return Reason(condition.reason)
    return Reason.NEW_EPOCH


@dataclass(frozen=True, slots=True)
class _DrainPlan:
    """The drain part of a running worker's plan."""

    phase: WorkerPhase | None
    """Draining or Drained while a drain runs; None: no drain."""
    holds: frozenset[HoldMechanism]
    started_at: datetime | None
    migrate: tuple[str, ...]
    move_worker: bool
    done: bool
    recheck_after: float | None
    trigger: Reason | None
    condition: ConditionPlan
    notices: tuple[Notice, ...] = ()


def _drain(facts: _Facts, pod_reason: Reason) -> _DrainPlan:
    """Whether a drain runs, what it holds and moves, and how far it has come."""
    obs = facts.obs
    spec = obs.policy.spec
    trigger = drain_trigger(obs.spec.drain, obs.node, spec.triggers)
    if trigger is None:
        return _DrainPlan(
            phase=None,
            holds=holds_while_pinned(spec, len(obs.pinned)),
            started_at=None,
            migrate=(),
            move_worker=False,
            done=False,
            recheck_after=None,
            trigger=None,
            condition=ConditionPlan(
                ConditionType.DRAINING, ConditionStatus.FALSE, pod_reason, "no drain"
            ),
        )
    started_at = obs.status.drain_started_at or obs.now
    decision = decide_drain(spec, started_at, obs.now, obs.pinned)
    whole_worker = bool(decision.migrate) and spec.migration_scope is MigrationScope.WORKER
    how = f"triggered by {trigger.value}" + (
        f" under DrainPolicy {obs.policy.name}" if obs.policy.name else " (default policy)"
    )
    holds = decision.holds if decision.hold else frozenset()
    draining = ConditionPlan(
        ConditionType.DRAINING,
        ConditionStatus.FALSE if decision.done else ConditionStatus.TRUE,
        decision.reason,
        f"{decision.message}; {how}",
    )
    return _DrainPlan(
        phase=WorkerPhase.DRAINED if decision.done else WorkerPhase.DRAINING,
        holds=holds,
        started_at=started_at,
        migrate=() if whole_worker else decision.migrate,
        move_worker=whole_worker,
        done=decision.done,
        recheck_after=decision.recheck_after,
        trigger=trigger,
        condition=draining,
        notices=_drain_notices(obs, decision.done, holds, draining),
    )


def _drain_notices(
    obs: WorkerObservation,
    done: bool,
    holds: frozenset[HoldMechanism],
    draining: ConditionPlan,
) -> tuple[Notice, ...]:
    """Return the drain's story, each part once: started, held, at its deadline, completed."""
    status = obs.status
    if done:
        if status.phase is WorkerPhase.DRAINED:
            return ()
        return (
            Notice(EventType.NORMAL, "DrainCompleted", "Drain", "no session is pinned any more"),
        )
    notices = []
    started = status.phase is not WorkerPhase.DRAINING
    if started:
        notices.append(Notice(EventType.NORMAL, "DrainStarted", "Drain", draining.message))
    # A hold stands whenever sessions are pinned; a drain is held when it starts with
    # sessions pinned, or when they get pinned while it runs.
    held = _held_condition(holds)
    if holds and (started or not carries(status, held)):
        pinned = f"{len(obs.pinned)} session(s) pinned: {held.message}"
        notices.append(Notice(EventType.NORMAL, "DrainHeld", "Drain", pinned))
    if draining.reason is Reason.DEADLINE_REACHED and not carries(status, draining):
        notices.append(Notice(EventType.NORMAL, "DrainDeadlineReached", "Drain", draining.message))
    return tuple(notices)


def _held_condition(holds: frozenset[HoldMechanism]) -> ConditionPlan:
    return ConditionPlan(
        ConditionType.DRAIN_HELD,
        ConditionStatus.TRUE if holds else ConditionStatus.FALSE,
        Reason.SESSIONS_PINNED if holds else Reason.DRAINED,
        # No count in the text: status.pinnedSessions carries it, and a message that
        # changed with every bind would make every bind a worker status write.
        "sessions are pinned: eviction blocked by " + ", ".join(sorted(h.value for h in holds))
        if holds
        else "nothing holds the pod",
    )


def _running(facts: _Facts) -> WorkerPlan:
    """Plan a worker with its pod: its drain, then its phase, then its conditions."""
    obs, current = facts.obs, facts.current
    phase, reason = pod_phase(current)
    still_recovering = obs.status.phase is WorkerPhase.RECOVERING and phase is not WorkerPhase.READY
    if still_recovering:
        phase = WorkerPhase.RECOVERING
    drain = _drain(facts, reason)
    phase = drain.phase or phase
    recovering = _recovering_condition(facts, still_recovering, reason)
    capped = (
        _warning_if_new(obs, recovering, "RecoveriesCapped", "Recover") if facts.blocked else ()
    )
    ready = ConditionPlan(
        ConditionType.READY,
        ConditionStatus.TRUE if phase is WorkerPhase.READY else ConditionStatus.FALSE,
        reason if phase is not WorkerPhase.DRAINING else Reason.DRAIN_REQUESTED,
        current.message if current is not None and current.message else phase.description,
    )
    delete = facts.stale
    if drain.done and drain.trigger is Reason.DRAIN_REQUESTED and current is not None:
        delete = (*facts.stale, current.name)
    return WorkerPlan(
        phase=phase,
        epoch=facts.epoch,
        create_pod=current is None and not facts.observed,
        delete_pods=delete,
        pod=current.name if current is not None else None,
        node=current.node if current is not None else None,
        endpoint=(
            f"http://{current.pod_ip}:{obs.spec.engine.port}"
            if current is not None and current.pod_ip
            else None
        ),
        drain_started_at=drain.started_at,
        holds=drain.holds,
        migrate=drain.migrate,
        move_worker=drain.move_worker,
        migrate_through_checkpoint=through_checkpoint(obs.policy.spec, obs.spec.checkpoint.driver),
        consecutive_failures=0 if phase is WorkerPhase.READY else facts.failures,
        last_recovery_at=facts.last_recovery,
        drain_done=drain.done,
        conditions=(
            *facts.conditions,
            recovering,
            drain.condition,
            _held_condition(drain.holds),
            ready,
        ),
        recheck_after=drain.recheck_after,
        notices=(*drain.notices, *capped, *facts.notices),
    )


def _recovery_detail(reason: Reason, pod: PodState | None) -> str:
    if reason is Reason.POD_FAILED and pod is not None:
        return f"failed: {pod.message or 'container terminated'}"
    if reason is Reason.NODE_NOT_READY and pod is not None:
        return f"node {pod.node} is NotReady beyond the toleration"
    return "deleted by someone other than the operator"
