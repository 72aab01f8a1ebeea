"""InferenceWorker reconciliation: observe → plan → act → write status.

Called by the fleet loop for every worker; the decisions are all in
:func:`sessionfleet.policy.worker.plan_worker`. Actions are idempotent (a pod is
created by its deterministic name, a hold is put up or taken down whatever was
there), so a restarted operator picks up where the last one stopped.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from datetime import UTC, datetime
from typing import Any

from sessionfleet.api import (
    CheckpointPhase,
    CheckpointReason,
    ConditionStatus,
    ConditionType,
    HoldMechanism,
    InferenceWorker,
    InferenceWorkerStatus,
    Reason,
    WorkerPhase,
    parse_duration,
)
from sessionfleet.api.labels import SPEC_HASH_ANNOTATION
from sessionfleet.controllers import metrics
from sessionfleet.controllers.checkpoints import create as create_checkpoint
from sessionfleet.controllers.checkpoints import reconcile_checkpoints, worker_driver_of
from sessionfleet.controllers.checkpoints import start as start_checkpoint
from sessionfleet.controllers.events import worker_ref
from sessionfleet.controllers.faults import reconciled_condition
from sessionfleet.controllers.fleet import EngineStats, Fleet
from sessionfleet.controllers.provenance import checkpoint_key, forgery
from sessionfleet.controllers.records import Key, WorkerRecord
from sessionfleet.controllers.sessions import migrate_sessions
from sessionfleet.controllers.status import status_patch
from sessionfleet.kube import (
    NETWORK_POLICIES,
    PDBS,
    PODS,
    WORKERS,
    Conflict,
    KubeError,
    NotFound,
)
from sessionfleet.policy.checkpoint import latest_usable
from sessionfleet.policy.drain import PinnedSession, resolve_policy
from sessionfleet.policy.events import EventType, Notice
from sessionfleet.policy.worker import (
    ConditionPlan,
    WorkerObservation,
    WorkerPlan,
    carries,
    plan_worker,
    settled,
)
from sessionfleet.resources.networkpolicies import build_engine_policy
from sessionfleet.resources.pods import build_pdb, build_pod, hold_annotations
from sessionfleet.resources.status import (
    invalid_worker_status,
    merge_conditions,
    wire_names,
    worker_status,
)

log = logging.getLogger(__name__)

ACTIVE_WINDOW_SECONDS = 60.0
"""A pinned session with a turn in the last minute counts as active."""


def observe(
    fleet: Fleet, record: WorkerRecord, worker: InferenceWorker, now: datetime
) -> WorkerObservation:
    """Gather what the plan needs from the indexes."""
    pods = fleet.indexes.pods_of(record.key)
    epoch = max([record.status.epoch or 0, *(p.epoch for p in pods)])
    current = next((p for p in pods if p.epoch == epoch), None)
    policies, invalid = fleet.indexes.policy_specs(record.namespace)
    pinned = [s for s in fleet.sessions.sessions_of(record.key) if s.pinned]
    return WorkerObservation(
        name=record.name,
        spec=worker.spec,
        status=record.status,
        pods=pods,
        node=fleet.indexes.node(current.node if current is not None else record.status.node),
        pinned=[PinnedSession(s.name) for s in pinned],
        policy=resolve_policy(
            worker.metadata.labels, worker.spec.drain_policy_ref, policies, invalid
        ),
        now=now,
        node_not_ready_toleration=fleet.config.node_not_ready_toleration,
    )


def desired_status(
    fleet: Fleet, record: WorkerRecord, worker: InferenceWorker, plan: WorkerPlan, now: datetime
) -> dict[str, Any]:
    """Return the status the plan describes, as the API server would store it."""
    pinned = [s for s in fleet.sessions.sessions_of(record.key) if s.pinned]
    active = [
        s
        for s in pinned
        if s.last_activity is not None
        and (now - s.last_activity).total_seconds() <= ACTIVE_WINDOW_SECONDS
    ]
    # A recovering worker's last figures describe the pod that is gone.
    recovering = plan.phase is WorkerPhase.RECOVERING
    stats = EngineStats() if recovering else fleet.engines.stats.get(record.key, EngineStats())
    hit_rate = None
    if stats.prefix_queries:
        # An engine may count more hits than queries for a moment: a rate stays 0-100.
        hit_rate = round(min(100.0, 100.0 * (stats.prefix_hits or 0.0) / stats.prefix_queries), 1)
    conditions: list[ConditionPlan] = [
        ConditionPlan(ConditionType.VALID, ConditionStatus.TRUE, Reason.PARSED, "spec accepted"),
        *plan.conditions,
        reconciled_condition(fleet.faults.of(WORKERS, record.key)),
    ]
    if record.key in fleet.engines.stats and not recovering:
        conditions.append(engine_metrics_condition(stats))
    store_key = f"{record.namespace}/{record.name}"
    if store_key in fleet.engines.kv_store_health and not recovering:
        conditions.append(kv_store_condition(fleet.engines.kv_store_health[store_key]))
    usable = latest_usable(fleet.indexes.checkpoints_of(record.key))
    restores = record.status.restore_count or 0
    if plan.epoch != (record.status.epoch or 0) and plan.epoch > 1 and usable is not None:
        restores += 1  # this new epoch starts from the checkpoint
    if usable is not None:
        conditions.append(
            ConditionPlan(
                ConditionType.CHECKPOINTED,
                ConditionStatus.TRUE,
                Reason.CHECKPOINT_SUCCEEDED,
                f"{usable.name}: {usable.captured_tokens} tokens from epoch {usable.epoch}",
            )
        )
    return worker_status(
        observed_generation=worker.metadata.generation,
        phase=plan.phase,
        epoch=plan.epoch,
        pod=plan.pod,
        node=plan.node,
        endpoint=plan.endpoint,
        pinned_sessions=len(pinned),
        active_sessions=len(active),
        kv_cache_usage_percent=(
            round(100 * stats.kv_usage) if stats.kv_usage is not None else None
        ),
        prefix_hit_rate_percent=hit_rate,
        running_requests=stats.running,
        waiting_requests=stats.waiting,
        drain_started_at=plan.drain_started_at,
        consecutive_failures=plan.consecutive_failures or None,
        last_recovery_at=plan.last_recovery_at,
        last_checkpoint=usable.name if usable is not None else None,
        restore_count=restores or None,
        conditions=merge_conditions(
            record.raw_status.get("conditions") or [],
            conditions,
            now,
            worker.metadata.generation,
        ),
    )


def engine_metrics_condition(stats: EngineStats) -> ConditionPlan:
    """Return ``EngineMetrics``: False while the engine reports values that cannot be used."""
    if stats.ignored:
        return ConditionPlan(
            ConditionType.ENGINE_METRICS,
            ConditionStatus.FALSE,
            Reason.NON_FINITE_METRICS,
            "the engine reports NaN or infinite values, ignored: " + ", ".join(stats.ignored),
        )
    return ConditionPlan(
        ConditionType.ENGINE_METRICS, ConditionStatus.TRUE, Reason.METRICS_READ, ""
    )


def metrics_notices(fleet: Fleet, record: WorkerRecord, plan: WorkerPlan) -> tuple[Notice, ...]:
    """Return ``MetricsUnreadable`` when the engine's figures stop being usable.

    The scrape's finding, not a plan's decision: like ``EngineMetrics``, it is added here.
    """
    stats = fleet.engines.stats.get(record.key)
    if stats is None or plan.phase is WorkerPhase.RECOVERING:
        return ()
    condition = engine_metrics_condition(stats)
    if condition.status is ConditionStatus.TRUE or carries(record.status, condition):
        return ()
    return (Notice(EventType.WARNING, "MetricsUnreadable", "Scrape", condition.message),)


def kv_store_condition(problem: str | None) -> ConditionPlan:
    """Return ``KVStore``: False, with the storage's error, while the store cannot be written."""
    if problem:
        return ConditionPlan(
            ConditionType.KV_STORE, ConditionStatus.FALSE, Reason.KV_STORE_DEGRADED, problem
        )
    return ConditionPlan(ConditionType.KV_STORE, ConditionStatus.TRUE, Reason.KV_STORE_WRITABLE, "")


COUNTER_FIELDS = wire_names(
    InferenceWorkerStatus,
    "pinned_sessions",
    "active_sessions",
    "kv_cache_usage_percent",
    "prefix_hit_rate_percent",
    "running_requests",
    "waiting_requests",
)
"""Status fields that only count: they move with every bind, finish and scrape."""


def worth_writing(fleet: Fleet, record: WorkerRecord, patch: dict[str, Any]) -> bool:
    """Whether to write a status patch now, or let a later pass carry it.

    A patch of counters alone waits until the worker's status has not been written for
    the fleet's counter interval (:func:`.work.counter_interval`): every bind and
    finish changes ``pinnedSessions``, and writing each change would cost the worker a
    write per session. Phase, epoch, conditions and the rest go out at once.
    """
    if not patch:
        return False
    if not set(patch) <= COUNTER_FIELDS:
        return True
    last = fleet.worker_writes.status_written_at.get(record.key)
    return last is None or time.monotonic() - last >= fleet.counter_interval()


async def write_status(
    fleet: Fleet, record: WorkerRecord, patch: dict[str, Any], notices: tuple[Notice, ...] = ()
) -> None:
    """Patch the worker's status subresource and remember the version it produced.

    ``notices`` are the Events for the decisions the write records (the plan's): they
    are recorded once the write has succeeded, so a failed write, decided again on the
    next pass, is not told twice, and a decision the status already shows is not told.

    The patch applies only to the version it was decided from: a write from a stale
    copy (another replica that believed it led wrote since) fails with Conflict, which
    ends this pass's reconcile of the worker before any pod is created from it.
    """
    body = await fleet.kube.patch(
        WORKERS,
        record.name,
        {"status": patch},
        record.namespace,
        status=True,
        resource_version=record.resource_version or None,
    )
    metrics.API_WRITES.labels("patch", "inferenceworkers/status").inc()
    fleet.freshness.mark(record.key, body)
    fleet.worker_writes.status_written_at[record.key] = time.monotonic()
    recovered_from = record.status.last_recovery_at
    became_ready = (
        record.status.phase is WorkerPhase.RECOVERING
        and patch.get("phase") == WorkerPhase.READY.value
    )
    if became_ready and recovered_from is not None:
        elapsed = (datetime.now(UTC) - recovered_from).total_seconds()
        metrics.RECOVERY_DURATION.observe(max(elapsed, 0.0))
    for notice in notices:
        fleet.notify(worker_ref(record), notice)


async def reconcile_invalid(fleet: Fleet, record: WorkerRecord, now: datetime) -> None:
    """Mark a worker whose spec does not parse: phase Failed, Valid=False with the reason."""
    invalid = ConditionPlan(
        ConditionType.VALID, ConditionStatus.FALSE, Reason.INVALID_SPEC, record.invalid or ""
    )
    desired = invalid_worker_status(
        merge_conditions(record.raw_status.get("conditions") or [], [invalid], now)
    )
    patch = status_patch(record.raw_status, desired)
    if patch:
        await write_status(fleet, record, patch)


async def reconcile_worker(fleet: Fleet, record: WorkerRecord, now: datetime) -> None:
    """Bring one worker one step closer to its plan."""
    if fleet.freshness.is_stale(record.key, record.resource_version):
        return  # our last status write has not come back through the watch yet
    if record.worker is None:
        await reconcile_invalid(fleet, record, now)
        return
    worker = record.worker
    observation = observe(fleet, record, worker, now)
    plan = plan_worker(observation)
    if plan.recovery is Reason.NODE_NOT_READY:
        block = fleet.worker_writes.node_gate.take()
        if block is not None:
            plan = plan_worker(dataclasses.replace(observation, recovery_block=block))
    _export_drain(record, plan, observation.policy.spec.deadline, now)
    # Until this reconcile ends clean, the worker is looked at on every pass.
    fleet.work.settle(record.key, False)
    desired = desired_status(fleet, record, worker, plan, now)
    patch = status_patch(record.raw_status, desired)
    # Each notice is a change the status does not show yet, so the patch is never
    # counters alone when there is one: the notices go with the write that records them.
    notices = (*plan.notices, *metrics_notices(fleet, record, plan))
    if not worth_writing(fleet, record, patch):
        if patch:  # counters only, coalesced: written once the interval has passed
            written = fleet.worker_writes.status_written_at.get(record.key, time.monotonic())
            due = written + fleet.counter_interval()
            fleet.work.retry(WORKERS.plural, record.key, due)
        patch = {}

    # A new epoch, or Drained, is recorded before the pods change, so that a restart
    # in between never mistakes our own deletion for a failure.
    epoch_changed = plan.epoch != (record.status.epoch or 0)
    if patch and (epoch_changed or plan.phase is WorkerPhase.DRAINED):
        await write_status(fleet, record, patch, notices)
        patch, notices = {}, ()
        if plan.recovery is not None and epoch_changed:
            if plan.recovery is Reason.NODE_NOT_READY:
                # counted by the next gates
                fleet.worker_writes.node_moves[record.key] = time.monotonic()
            metrics.RECOVERIES.labels(plan.recovery.value).inc()
            log.info("worker %s: %s; epoch %d", record.key, plan.recovery.value, plan.epoch)
    started = record.status.drain_started_at
    if plan.drain_done and record.status.phase is WorkerPhase.DRAINING and started:
        metrics.DRAIN_DURATION.observe((now - started).total_seconds())

    # The engine's fence goes up before the first pod, so no pod is ever open.
    await _apply_engine_policy(fleet, record, worker)
    if plan.create_pod:
        await _create_pod(fleet, record, worker, plan.epoch)
    for name in plan.delete_pods:
        await _delete_pod(fleet, record, name)
    await _apply_holds(fleet, record, worker, plan)
    if plan.migrate:
        await migrate_sessions(
            fleet, record, worker, plan.migrate, plan.migrate_through_checkpoint, now
        )
    if plan.move_worker:
        await _move_worker(fleet, record, worker, plan, now)
    if patch:
        await write_status(fleet, record, patch, notices)
    await reconcile_checkpoints(fleet, record, worker, now)
    fleet.work.settle(record.key, settled(observation, plan) and not _checkpointing(fleet, record))


def _checkpointing(fleet: Fleet, record: WorkerRecord) -> bool:
    """Whether a checkpoint of the worker runs here, or is left Pending or Running.

    Such a checkpoint has a deadline (``--checkpoint-timeout``) that only the clock
    brings, even one a stopped operator left behind: the worker is looked at every pass.
    """
    if record.key in fleet.checkpointing.running:
        return True
    return any(
        c.phase in (None, CheckpointPhase.PENDING, CheckpointPhase.RUNNING) and not c.refused
        for c in fleet.indexes.checkpoints_of(record.key)
    )


def _export_drain(record: WorkerRecord, plan: WorkerPlan, deadline: str, now: datetime) -> None:
    """Time held and deadline of a draining worker, for the dashboard and the alert."""
    started = record.status.drain_started_at
    labels = (record.namespace, record.name)
    if plan.phase is WorkerPhase.DRAINING and started is not None:
        metrics.DRAIN_HELD.labels(*labels).set(max((now - started).total_seconds(), 0.0))
        metrics.DRAIN_DEADLINE.labels(*labels).set(parse_duration(deadline).total_seconds())
    else:
        for gauge in (metrics.DRAIN_HELD, metrics.DRAIN_DEADLINE):
            try:
                gauge.remove(*labels)
            except KeyError:
                pass


async def _move_worker(
    fleet: Fleet, record: WorkerRecord, worker: InferenceWorker, plan: WorkerPlan, now: datetime
) -> None:
    """Migration scope Worker: save the whole worker, then delete its pod.

    The next reconcile sees the pod gone and starts a new epoch, which restores the
    newest whole-worker checkpoint — this one — on a node that is not draining; the
    sessions stay bound to the worker, Restoring, and follow it. If the checkpoint
    fails, the worker still moves, cold, and the sessions' recomputation is counted.
    """
    epoch = record.status.epoch
    if plan.pod is None or epoch is None:
        return
    key = await checkpoint_key(fleet)
    drains = [
        c
        for c in fleet.indexes.checkpoints_of(record.key)
        if c.reason is CheckpointReason.DRAIN
        and c.whole_worker
        and c.epoch in (None, epoch)
        # Only the operator's own, whichever replica created it (a leader that stopped
        # before it started one leaves it to the next: controllers/checkpoints.py): a
        # user's Drain checkpoint is refused, never run, and must not stand for "a save
        # is under way" for ever.
        and not c.refused
        and (c.epoch is not None or forgery(key, c) is None)
    ]
    if any(c.phase in (None, CheckpointPhase.PENDING, CheckpointPhase.RUNNING) for c in drains):
        return  # a save is under way
    if not drains and plan.migrate_through_checkpoint:
        # Saved in the background; a later pass moves the pod once it has ended.
        created = await create_checkpoint(fleet, record, worker, CheckpointReason.DRAIN, now)
        if created is not None:
            start_checkpoint(fleet, created, now)
        return
    log.info("worker %s: moving to another node (migration scope Worker)", record.key)
    await _delete_pod(fleet, record, plan.pod)


async def _create_pod(
    fleet: Fleet, record: WorkerRecord, worker: InferenceWorker, epoch: int
) -> None:
    """Create the epoch's pod; a later epoch starts from the newest usable checkpoint."""
    restore_args: list[str] = []
    usable = latest_usable(fleet.indexes.checkpoints_of(record.key)) if epoch > 1 else None
    driver = (
        fleet.checkpointing.drivers.get(worker_driver_of(worker)) if usable is not None else None
    )
    if usable is not None and usable.location and driver is not None:
        restore_args = driver.restore_args(worker.spec.engine.type, usable.location)
    try:
        await fleet.kube.create(
            PODS,
            build_pod(worker, epoch, fleet.config.images, restore_args),
            worker.metadata.namespace,
        )
        metrics.API_WRITES.labels("create", "pods").inc()
        if restore_args and usable is not None:
            metrics.RESTORES.inc()
            log.info("worker %s: epoch %d restores %s", record.key, epoch, usable.name)
            fleet.notify(
                worker_ref(record),
                Notice(
                    EventType.NORMAL,
                    "CheckpointRestored",
                    "Restore",
                    f"epoch {epoch} starts from checkpoint {usable.name}",
                ),
            )
    except Conflict:
        pass  # created by an earlier attempt: the name is deterministic


async def _delete_pod(fleet: Fleet, record: WorkerRecord, name: str) -> None:
    # Only the pod the index shows (its uid): a namesake created since is not ours to
    # delete. A resourceVersion would fail on every status update of the kubelet's.
    pod = next((p for p in fleet.indexes.pods_of(record.key) if p.name == name), None)
    try:
        await fleet.kube.delete(
            PODS,
            name,
            record.namespace,
            uid=pod.uid if pod is not None else None,
            grace_period_seconds=30,
        )
        metrics.API_WRITES.labels("delete", "pods").inc()
    except (NotFound, Conflict):
        pass  # gone, or another incarnation: the next pass decides again


HOLD_WRITE_PATIENCE_SECONDS = 5.0
"""A hold written this long ago and still not seen in the index is written again: the
watch shows a write within milliseconds, and one removed before the watch ever showed
it (deleted by hand at once) is put back after this long."""
_ANNOTATION_HOLDS = frozenset(
    {HoldMechanism.KARPENTER_DO_NOT_DISRUPT, HoldMechanism.CLUSTER_AUTOSCALER_SAFE_TO_EVICT}
)


def _needs_write(fleet: Fleet, what: str, key: Key, settled: bool, worker: Key) -> bool:
    """Whether to write a hold for ``key``: it is not as wanted, and no write is on its way.

    Level-triggered: the wanted holds are compared with what the indexes show, so a
    PodDisruptionBudget or annotation removed by hand is put back on the worker's next
    reconcile; a write the watch has not shown yet is not repeated for a while, and the
    worker is looked at again when that while is over (no event may come to mark it).
    """
    entry = (what, key)
    if settled:
        fleet.worker_writes.holds.pop(entry, None)
        return False
    written = fleet.worker_writes.holds.get(entry)
    if written is None or time.monotonic() - written >= HOLD_WRITE_PATIENCE_SECONDS:
        return True
    fleet.work.retry(WORKERS.plural, worker, written + HOLD_WRITE_PATIENCE_SECONDS)
    return False


async def _apply_engine_policy(fleet: Fleet, record: WorkerRecord, worker: InferenceWorker) -> None:
    """Keep the worker's engine NetworkPolicy as configured (``--engine-peers``).

    Server-side apply creates it or puts back what someone changed; the index's spec
    hash says when nothing needs writing. With no peers configured nothing is written
    (and a policy left from before stays, owned by the worker, until it is deleted).
    """
    peers = fleet.config.engine_peers
    if not peers:
        return
    wanted = build_engine_policy(worker, peers)
    current = fleet.indexes.engine_policy_hash(record.key)
    settled = current == wanted["metadata"]["annotations"][SPEC_HASH_ANNOTATION]
    if not _needs_write(fleet, "networkpolicy", record.key, settled=settled, worker=record.key):
        return
    name = wanted["metadata"]["name"]
    try:
        await fleet.kube.patch(NETWORK_POLICIES, name, wanted, record.namespace, patch_type="apply")
        metrics.API_WRITES.labels("apply", "networkpolicies").inc()
    except KubeError as error:
        log.warning("cannot write NetworkPolicy %s/%s: %s", record.namespace, name, error)
    fleet.worker_writes.holds[("networkpolicy", record.key)] = time.monotonic()


async def _apply_holds(
    fleet: Fleet, record: WorkerRecord, worker: InferenceWorker, plan: WorkerPlan
) -> None:
    """Make the PodDisruptionBudget and the pod annotations what the plan wants."""
    wanted = plan.holds
    want_pdb = HoldMechanism.POD_DISRUPTION_BUDGET in wanted
    has_pdb = fleet.indexes.has_pdb(record.key)
    if _needs_write(fleet, "pdb", record.key, settled=want_pdb == has_pdb, worker=record.key):
        try:
            if want_pdb:
                await fleet.kube.create(PDBS, build_pdb(worker), record.namespace)
                metrics.API_WRITES.labels("create", "poddisruptionbudgets").inc()
            else:
                # That PDB only (its uid, from the index), as the pods above.
                await fleet.kube.delete(
                    PDBS, record.name, record.namespace, uid=fleet.indexes.pdb_uid(record.key)
                )
                metrics.API_WRITES.labels("delete", "poddisruptionbudgets").inc()
        except (Conflict, NotFound):
            pass  # already as wanted
        fleet.worker_writes.holds[("pdb", record.key)] = time.monotonic()
    pod = next((p for p in fleet.indexes.pods_of(record.key) if p.name == plan.pod), None)
    if pod is None:
        return
    wanted_annotations = wanted & _ANNOTATION_HOLDS
    pod_key = (record.namespace, pod.name)
    if not _needs_write(
        fleet, "annotations", pod_key, settled=pod.holds == wanted_annotations, worker=record.key
    ):
        return
    annotations = hold_annotations(
        HoldMechanism.KARPENTER_DO_NOT_DISRUPT in wanted,
        HoldMechanism.CLUSTER_AUTOSCALER_SAFE_TO_EVICT in wanted,
    )
    # The uid in the patch is a precondition (a namesake refuses it: 422, uid is
    # immutable); not the resourceVersion, which the kubelet's status updates keep moving.
    metadata: dict[str, Any] = {"annotations": annotations}
    if pod.uid:
        metadata["uid"] = pod.uid
    try:
        await fleet.kube.patch(PODS, pod.name, {"metadata": metadata}, record.namespace)
        metrics.API_WRITES.labels("patch", "pods").inc()
        fleet.worker_writes.holds[("annotations", pod_key)] = time.monotonic()
    except (NotFound, Conflict):
        pass  # gone, or another incarnation: the next pass decides again
    except KubeError as error:
        log.warning("cannot annotate pod %s/%s: %s", record.namespace, pod.name, error)
