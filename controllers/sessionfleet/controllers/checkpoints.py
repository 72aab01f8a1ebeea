"""WorkerCheckpoint reconciliation: run pending checkpoints, take periodic ones, keep N.

A checkpoint is an object first (like a VolumeSnapshot): the operator creates one for a
periodic or drain checkpoint, a user creates one with ``kubectl apply`` for a manual
one, and this controller runs whichever is Pending through the worker's driver. The
status records the phase, timings, size, location, the worker epoch and the sessions
and tokens captured.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime
from typing import Any

from sessionfleet.api import (
    OPERATOR_REASONS,
    CheckpointDriver,
    CheckpointPhase,
    CheckpointReason,
    InferenceWorker,
    KVStoreType,
    Reason,
    WorkerPhase,
    destination_problem,
    reserved_reason_problem,
)
from sessionfleet.checkpoint import (
    CheckpointOutcome,
    CheckpointTarget,
    DriverError,
    DriverUnavailable,
)
from sessionfleet.controllers import metrics
from sessionfleet.controllers.events import checkpoint_ref
from sessionfleet.controllers.fleet import Fleet
from sessionfleet.controllers.provenance import checkpoint_key, forgery, signature
from sessionfleet.controllers.records import WorkerRecord
from sessionfleet.kube import CHECKPOINTS, Conflict, KubeError, NotFound
from sessionfleet.policy.checkpoint import (
    CheckpointState,
    abandoned,
    checkpoint_location,
    checkpoint_name,
    latest_usable,
    periodic_due,
    retention_victims,
)
from sessionfleet.policy.events import EventType, Notice
from sessionfleet.policy.provenance import CheckpointIdentity
from sessionfleet.resources.checkpoints import build_checkpoint
from sessionfleet.resources.kvstore import kv_store_of
from sessionfleet.resources.names import session_object_name
from sessionfleet.resources.status import (
    checkpoint_failed_status,
    checkpoint_refused_status,
    checkpoint_running_status,
    checkpoint_succeeded_status,
)

log = logging.getLogger(__name__)


def worker_driver_of(worker: InferenceWorker) -> CheckpointDriver:
    """Return the worker's configured checkpoint driver."""
    return worker.spec.checkpoint.driver


def worker_driver(worker: InferenceWorker, checkpoint: CheckpointState) -> CheckpointDriver:
    """Return the driver a checkpoint uses: its own, else the worker's."""
    return checkpoint.driver or worker_driver_of(worker)


def target_for(
    record: WorkerRecord,
    worker: InferenceWorker,
    location: str,
    sessions: tuple[str, ...],
    session_names: tuple[str, ...] = (),
) -> CheckpointTarget | None:
    """Return what the driver works on; ``None`` while the worker has no serving pod."""
    status = record.status
    if not status.endpoint or status.epoch is None:
        return None
    return CheckpointTarget(
        namespace=record.namespace,
        worker=record.name,
        epoch=status.epoch,
        engine=worker.spec.engine.type,
        endpoint=status.endpoint,
        location=location,
        pod=status.pod,
        node=status.node,
        sessions=sessions,
        session_names=session_names,
        model=worker.spec.model,
        # Only sessionfleet's own KV store answers control requests.
        token=worker.metadata.uid if kv_store_of(worker) is KVStoreType.SESSIONFLEET else None,
    )


async def _patch(fleet: Fleet, checkpoint: CheckpointState, status: dict[str, Any]) -> None:
    # No precondition (docs/operator.md, "Fencing"): a run's later patches follow its
    # earlier ones, so the resourceVersion it started from would refuse them, and the
    # status subresource ignores a uid in the patch. The gate and the write bound fence it.
    body = await fleet.kube.patch(
        CHECKPOINTS, checkpoint.name, {"status": status}, checkpoint.namespace, status=True
    )
    metrics.API_WRITES.labels("patch", "workercheckpoints/status").inc()
    fleet.freshness.mark((checkpoint.namespace, f"checkpoint/{checkpoint.name}"), body)
    if status.get("phase") == CheckpointPhase.FAILED.value:
        reasons = [c.get("reason") for c in status.get("conditions") or () if c.get("reason")]
        metrics.CHECKPOINT_FAILURES.labels(reasons[0] if reasons else "Unknown").inc()
        fleet.notify(
            checkpoint_ref(checkpoint),
            Notice(
                EventType.WARNING,
                "CheckpointFailed",
                "Checkpoint",
                f"checkpoint of worker {checkpoint.worker} failed: {status.get('error')}",
            ),
        )


async def save(
    fleet: Fleet, checkpoint: CheckpointState, now: datetime
) -> CheckpointOutcome | None:
    """Run one checkpoint through its driver and record the outcome in its status."""
    record = fleet.indexes.worker(checkpoint.namespace, checkpoint.worker)
    if record is None or record.worker is None:
        await _patch(
            fleet,
            checkpoint,
            checkpoint_failed_status(
                Reason.CHECKPOINT_FAILED, f"worker {checkpoint.worker} not found", now
            ),
        )
        return None
    worker = record.worker
    problem = destination_problem(
        checkpoint.destination, worker.spec.checkpoint.storage.path, checkpoint.namespace
    )
    if problem is not None:
        await refuse(fleet, checkpoint, Reason.DESTINATION_OUTSIDE_STORAGE, problem, now)
        return None
    kind = worker_driver(worker, checkpoint)
    driver = fleet.checkpointing.drivers.get(kind)
    location = checkpoint_location(
        worker.spec.checkpoint.storage.path,
        checkpoint.namespace,
        checkpoint.worker,
        checkpoint.name,
        checkpoint.destination,
    )
    # A KV store keys a session by its AgentSession's name, which the id alone does not
    # give when clients authenticate (the name's hash covers the client too).
    names = {s.session_id: s.name for s in fleet.sessions.sessions_of(record.key)}
    target = target_for(
        record,
        worker,
        location,
        checkpoint.sessions,
        tuple(names.get(s, session_object_name(s)) for s in checkpoint.sessions),
    )
    failure = None
    if kind is CheckpointDriver.NONE or driver is None:
        failure = (Reason.DRIVER_UNSUPPORTED, f"driver {kind.value} cannot checkpoint here")
    elif target is None:
        failure = (Reason.CHECKPOINT_FAILED, f"worker {checkpoint.worker} has no serving pod")
    if failure is not None or target is None or driver is None:
        reason, error = failure or (Reason.CHECKPOINT_FAILED, "nothing to checkpoint")
        await _patch(fleet, checkpoint, checkpoint_failed_status(reason, error, now))
        return None
    await _patch(fleet, checkpoint, checkpoint_running_status(target.epoch, now))
    try:
        async with asyncio.timeout(fleet.config.checkpoint_timeout.total_seconds()):
            outcome = await driver.save(target)
    except (DriverError, TimeoutError) as error:
        if isinstance(error, TimeoutError):
            error = DriverError(
                f"the checkpoint did not finish within "
                f"{fleet.config.checkpoint_timeout.total_seconds():g} s"
            )
        # DriverUnavailable: the node cannot do it at all (capability), nothing was tried.
        reason = (
            Reason.DRIVER_UNSUPPORTED
            if isinstance(error, DriverUnavailable)
            else Reason.CHECKPOINT_FAILED
        )
        await _patch(fleet, checkpoint, checkpoint_failed_status(reason, str(error), now))
        log.warning("checkpoint %s/%s failed: %s", checkpoint.namespace, checkpoint.name, error)
        return None
    done = datetime.now(now.tzinfo)
    await _patch(
        fleet,
        checkpoint,
        checkpoint_succeeded_status(
            completed_at=done,
            seconds=outcome.seconds,
            size_bytes=outcome.size_bytes,
            location=outcome.location,
            sessions=outcome.sessions,
            total_tokens=outcome.total_tokens,
        ),
    )
    metrics.CHECKPOINTS.labels(checkpoint.reason.value).inc()
    metrics.CHECKPOINT_DURATION.labels(kind.value).observe(outcome.seconds)
    metrics.CHECKPOINT_SIZE.labels(kind.value).observe(outcome.size_bytes)
    fleet.notify(
        checkpoint_ref(checkpoint),
        Notice(
            EventType.NORMAL,
            "CheckpointTaken",
            "Checkpoint",
            f"worker {checkpoint.worker} saved to {outcome.location} in {outcome.seconds:.1f} s: "
            f"{outcome.size_bytes} bytes, {len(outcome.sessions)} session(s), "
            f"{outcome.total_tokens} tokens",
        ),
    )
    return outcome


async def create(
    fleet: Fleet,
    record: WorkerRecord,
    worker: InferenceWorker,
    reason: CheckpointReason,
    now: datetime,
    sessions: tuple[str, ...] = (),
) -> CheckpointState | None:
    """Create a WorkerCheckpoint object owned by the worker; return its state."""
    epoch = record.status.epoch or 0
    name = checkpoint_name(record.name, reason, epoch, now, sessions)
    identity = CheckpointIdentity(record.namespace, name, record.name, reason, sessions)
    provenance = await signature(fleet, identity, now)
    body = build_checkpoint(
        worker, name, record.namespace, record.name, reason, sessions, provenance
    )
    key = (record.namespace, name)
    fleet.checkpointing.created.add(key)
    try:
        await fleet.kube.create(CHECKPOINTS, body, record.namespace)
    except Conflict:
        # Created this second already — or someone else's object has the name.
        fleet.checkpointing.created.discard(key)
        return None
    except BaseException:
        fleet.checkpointing.created.discard(key)
        raise
    metrics.API_WRITES.labels("create", "workercheckpoints").inc()
    return CheckpointState(
        namespace=record.namespace,
        name=name,
        worker=record.name,
        reason=reason,
        created_at=now,
        sessions=sessions,
    )


async def refuse(
    fleet: Fleet, checkpoint: CheckpointState, reason: Reason, problem: str, now: datetime
) -> None:
    """Mark a checkpoint the operator will not run: Failed, with ``Valid=False`` saying why."""
    await _patch(fleet, checkpoint, checkpoint_refused_status(reason, problem, now))
    log.warning("checkpoint %s/%s refused: %s", *checkpoint.key, problem)


def start(fleet: Fleet, checkpoint: CheckpointState, now: datetime) -> None:
    """Run a checkpoint in the background (once): the fleet loop never waits for a driver."""
    key = (checkpoint.namespace, checkpoint.name)
    if key in fleet.checkpointing.running:
        return

    async def run() -> None:
        try:
            await save(fleet, checkpoint, now)
        except KubeError as error:
            log.warning("checkpoint %s: %s", key, error)
        finally:
            fleet.checkpointing.running.discard(key)

    fleet.checkpointing.running.add(key)
    fleet.spawner.spawn(f"checkpoint {key}", run())


async def _take_up(fleet: Fleet, checkpoint: CheckpointState, now: datetime) -> None:
    """Start, refuse or close a checkpoint that nobody has started yet."""
    if checkpoint.key in fleet.checkpointing.created:
        # This process created it; its Drain ones are started by the move that made them.
        if checkpoint.reason is not CheckpointReason.DRAIN:
            start(fleet, checkpoint, now)
        return
    forged = None
    if checkpoint.reason in OPERATOR_REASONS:
        forged = forgery(await checkpoint_key(fleet), checkpoint)
    problem = reserved_reason_problem(checkpoint.reason, created_by_operator=forged is None)
    if problem is not None:
        await refuse(
            fleet, checkpoint, Reason.RESERVED_CHECKPOINT_REASON, f"{problem}: {forged}", now
        )
    elif checkpoint.reason is CheckpointReason.DRAIN and not checkpoint.whole_worker:
        # An earlier leader's per-session migration, which would have used the outcome
        # itself: the sessions' migration starts again here, with a checkpoint of its own.
        await _patch(
            fleet,
            checkpoint,
            checkpoint_failed_status(
                Reason.CHECKPOINT_FAILED,
                "the operator replica that created it for a migration stopped before it "
                "ran; the migration is started again with a new checkpoint",
                now,
            ),
        )
    else:
        # A user's Manual one, or an earlier leader's Periodic or whole-worker Drain one:
        # the worker's move waits for the latter, so it must not be lost with the leader.
        start(fleet, checkpoint, now)


async def reconcile_checkpoints(
    fleet: Fleet, record: WorkerRecord, worker: InferenceWorker, now: datetime
) -> None:
    """Run the worker's pending checkpoints, take a periodic one if due, apply retention."""
    checkpoints = fleet.indexes.checkpoints_of(record.key)
    timeout = fleet.config.checkpoint_timeout
    for checkpoint in checkpoints:
        if checkpoint.phase is None:
            await _take_up(fleet, checkpoint, now)
        elif abandoned(checkpoint, checkpoint.key in fleet.checkpointing.running, now, timeout):
            await _patch(
                fleet,
                checkpoint,
                checkpoint_failed_status(
                    Reason.CHECKPOINT_FAILED,
                    "no operator finished it within "
                    f"{timeout.total_seconds():g} s (the one that started it stopped)",
                    now,
                ),
            )
            log.warning("checkpoint %s/%s abandoned: marked Failed", *checkpoint.key)
    settings = worker.spec.checkpoint
    whole = [c for c in checkpoints if c.whole_worker]
    last = latest_usable(whole)
    in_flight = any(
        c.phase in (None, CheckpointPhase.PENDING, CheckpointPhase.RUNNING) for c in whole
    )
    activity = max(
        (s.last_activity for s in fleet.sessions.sessions_of(record.key) if s.last_activity),
        default=None,
    )
    if periodic_due(
        settings.interval,
        settings.driver,
        record.status.phase is WorkerPhase.READY,
        last,
        activity,
        in_flight,
        now,
    ):
        created = await create(fleet, record, worker, CheckpointReason.PERIODIC, now)
        if created is not None:
            start(fleet, created, now)
    uids = {c.name: c.uid for c in checkpoints}
    for name in retention_victims(checkpoints, settings.retention):
        try:
            # The copy retention chose (uid and version): one changed since is kept.
            version = next(c.resource_version for c in checkpoints if c.name == name)
            await fleet.kube.delete(
                CHECKPOINTS,
                name,
                record.namespace,
                uid=uids.get(name) or None,
                resource_version=version or None,
            )
            metrics.API_WRITES.labels("delete", "workercheckpoints").inc()
        except (NotFound, Conflict):
            pass
