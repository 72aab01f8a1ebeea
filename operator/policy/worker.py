"""The worker decision: from everything observed of one worker, the plan for it.

One pure function, :func:`plan_worker`, composes recovery, drain and phase. The
controller carries the plan out (create or delete pods, keep holds, migrate
sessions) and writes the status it describes only when it differs from the one
observed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sessionfleet.api import (
    CheckpointDriver,
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
from sessionfleet.policy.observed import NodeState, PodState
from sessionfleet.policy.recovery import (
    DEFAULT_NODE_NOT_READY_TOLERATION,
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


def plan_worker(obs: WorkerObservation) -> WorkerPlan:
    """Decide the worker's pods, holds, migrations, phase and conditions."""
    # A pod of a later epoch than the status records means the status read is older
    # than our own last write: trust the pod, never delete it.
    epoch = max([obs.status.epoch or 0, *(p.epoch for p in obs.pods)])
    pods_by_name = {p.name: p for p in obs.pods}
    current = pods_by_name.get(pod_name(obs.name, epoch)) if epoch else None
    observed = obs.status.pod == pod_name(obs.name, epoch)
    stale = tuple(p.name for p in obs.pods if p.epoch < epoch and not p.deleting)
    conditions: list[ConditionPlan] = []
    if obs.policy.reason is not None:
        conditions.append(
            ConditionPlan(
                ConditionType.CONFLICT,
                ConditionStatus.TRUE,
                obs.policy.reason,
                obs.policy.message,
            )
        )

    drained_on_request = obs.spec.drain and obs.status.phase is WorkerPhase.DRAINED
    if drained_on_request:
        # The pod was deleted on purpose; nothing runs until spec.drain is false.
        return WorkerPlan(
            phase=WorkerPhase.DRAINED,
            epoch=epoch,
            create_pod=False,
            delete_pods=tuple(p.name for p in obs.pods if not p.deleting),
            pod=None,
            node=None,
            endpoint=None,
            drain_started_at=obs.status.drain_started_at,
            holds=frozenset(),
            drain_done=True,
            conditions=(
                *conditions,
                ConditionPlan(
                    ConditionType.DRAINING, ConditionStatus.FALSE, Reason.DRAINED, "drained"
                ),
                ConditionPlan(
                    ConditionType.READY,
                    ConditionStatus.FALSE,
                    Reason.DRAINED,
                    "drained on request (spec.drain)",
                ),
            ),
        )

    if epoch == 0 or (obs.status.phase is WorkerPhase.DRAINED and current is None):
        # First pod, or back from a requested drain: a fresh epoch.
        return WorkerPlan(
            phase=WorkerPhase.PENDING,
            epoch=epoch + 1,
            create_pod=True,
            delete_pods=stale,
            pod=None,
            node=None,
            endpoint=None,
            drain_started_at=None,
            holds=frozenset(),
            conditions=(
                *conditions,
                ConditionPlan(
                    ConditionType.READY,
                    ConditionStatus.FALSE,
                    Reason.POD_PENDING,
                    f"creating pod {pod_name(obs.name, epoch + 1)}",
                ),
            ),
        )

    recovery = recovery_reason(current, observed, obs.node, obs.now, obs.node_not_ready_toleration)
    failures = obs.status.consecutive_failures or 0
    last_recovery = obs.status.last_recovery_at
    if recovery is not None and failures and last_recovery is not None:
        wait = (recovery_backoff(failures) - (obs.now - last_recovery)).total_seconds()
        if wait > 0:
            return WorkerPlan(
                phase=WorkerPhase.RECOVERING,
                epoch=epoch,
                create_pod=False,
                delete_pods=stale,
                pod=None,
                node=None,
                endpoint=None,
                drain_started_at=obs.status.drain_started_at,
                holds=frozenset(),
                consecutive_failures=failures,
                last_recovery_at=last_recovery,
                conditions=(
                    *conditions,
                    ConditionPlan(
                        ConditionType.RECOVERING,
                        ConditionStatus.TRUE,
                        Reason.RECOVERY_BACK_OFF,
                        f"{failures} epoch(s) in a row failed before Ready; "
                        f"epoch {epoch + 1} starts in {wait:.0f}s",
                    ),
                    ConditionPlan(
                        ConditionType.READY,
                        ConditionStatus.FALSE,
                        Reason.RECOVERY_BACK_OFF,
                        f"pod {pod_name(obs.name, epoch)}: {_recovery_detail(recovery, current)}",
                    ),
                ),
                recheck_after=wait,
            )
    if recovery is not None:
        new_epoch = epoch + 1
        doomed = stale + ((current.name,) if current is not None and not current.deleting else ())
        message = f"pod {pod_name(obs.name, epoch)}: {_recovery_detail(recovery, current)}"
        return WorkerPlan(
            phase=WorkerPhase.RECOVERING,
            epoch=new_epoch,
            create_pod=True,
            delete_pods=doomed,
            pod=None,
            node=None,
            endpoint=None,
            drain_started_at=obs.status.drain_started_at,
            holds=frozenset(),
            recovery=recovery,
            consecutive_failures=failures + 1,
            last_recovery_at=obs.now,
            conditions=(
                *conditions,
                ConditionPlan(ConditionType.RECOVERING, ConditionStatus.TRUE, recovery, message),
                ConditionPlan(
                    ConditionType.READY,
                    ConditionStatus.FALSE,
                    Reason.NEW_EPOCH,
                    f"starting pod {pod_name(obs.name, new_epoch)} (epoch {new_epoch})",
                ),
            ),
        )

    phase, reason = pod_phase(current)
    endpoint = (
        f"http://{current.pod_ip}:{obs.spec.engine.port}"
        if current is not None and current.pod_ip
        else None
    )
    still_recovering = obs.status.phase is WorkerPhase.RECOVERING and phase is not WorkerPhase.READY
    if still_recovering:
        phase = WorkerPhase.RECOVERING
    conditions.append(
        ConditionPlan(
            ConditionType.RECOVERING,
            ConditionStatus.TRUE if still_recovering else ConditionStatus.FALSE,
            Reason.NEW_EPOCH if still_recovering else reason,
            f"waiting for pod {pod_name(obs.name, epoch)}" if still_recovering else "",
        )
    )

    trigger = drain_trigger(obs.spec.drain, obs.node, obs.policy.spec.triggers)
    holds = holds_while_pinned(obs.policy.spec, len(obs.pinned))
    drain_started_at = None
    migrate: tuple[str, ...] = ()
    move_worker = False
    drain_done = False
    recheck_after = None
    if trigger is not None:
        drain_started_at = obs.status.drain_started_at or obs.now
        decision = decide_drain(obs.policy.spec, drain_started_at, obs.now, obs.pinned)
        holds = decision.holds if decision.hold else frozenset()
        migrate = decision.migrate
        if migrate and obs.policy.spec.migration_scope is MigrationScope.WORKER:
            move_worker, migrate = True, ()
        drain_done = decision.done
        recheck_after = decision.recheck_after
        phase = WorkerPhase.DRAINED if decision.done else WorkerPhase.DRAINING
        how = f"triggered by {trigger.value}" + (
            f" under DrainPolicy {obs.policy.name}" if obs.policy.name else " (default policy)"
        )
        conditions.append(
            ConditionPlan(
                ConditionType.DRAINING,
                ConditionStatus.FALSE if decision.done else ConditionStatus.TRUE,
                decision.reason,
                f"{decision.message}; {how}",
            )
        )
    else:
        conditions.append(
            ConditionPlan(ConditionType.DRAINING, ConditionStatus.FALSE, reason, "no drain")
        )

    conditions.append(
        ConditionPlan(
            ConditionType.DRAIN_HELD,
            ConditionStatus.TRUE if holds else ConditionStatus.FALSE,
            Reason.SESSIONS_PINNED if holds else Reason.DRAINED,
            # No count in the text: status.pinnedSessions carries it, and a message that
            # changed with every bind would make every bind a worker status write.
            "sessions are pinned: eviction blocked by " + ", ".join(sorted(h.value for h in holds))
            if holds
            else "nothing holds the pod",
        )
    )
    conditions.append(
        ConditionPlan(
            ConditionType.READY,
            ConditionStatus.TRUE if phase is WorkerPhase.READY else ConditionStatus.FALSE,
            reason if phase is not WorkerPhase.DRAINING else Reason.DRAIN_REQUESTED,
            current.message if current is not None and current.message else phase.description,
        )
    )
    delete = stale
    if drain_done and trigger is Reason.DRAIN_REQUESTED and current is not None:
        delete = (*stale, current.name)
    return WorkerPlan(
        phase=phase,
        epoch=epoch,
        create_pod=current is None and not observed,
        delete_pods=delete,
        pod=current.name if current is not None else None,
        node=current.node if current is not None else None,
        endpoint=endpoint,
        drain_started_at=drain_started_at,
        holds=holds,
        migrate=migrate,
        move_worker=move_worker,
        migrate_through_checkpoint=obs.policy.spec.checkpoint
        and obs.spec.checkpoint.driver is not CheckpointDriver.NONE,
        consecutive_failures=0 if phase is WorkerPhase.READY else failures,
        last_recovery_at=last_recovery,
        drain_done=drain_done,
        conditions=tuple(conditions),
        recheck_after=recheck_after,
    )


def _recovery_detail(reason: Reason, pod: PodState | None) -> str:
    if reason is Reason.POD_FAILED and pod is not None:
        return f"failed: {pod.message or 'container terminated'}"
    if reason is Reason.NODE_NOT_READY and pod is not None:
        return f"node {pod.node} is NotReady beyond the toleration"
    return "deleted by someone other than the operator"
