"""DrainPolicy status, written from the indexes once per pass of the fleet loop.

Level-triggered and coalesced: on each pass :func:`reconcile_policies` computes the
status of every DrainPolicy at once with the pure
:func:`sessionfleet.policy.policies.plan_policy_statuses` — the workers each one
governs (the same resolution the workers' drains use), how many of them are draining,
``Valid`` and ``Conflict`` — and patches the status subresource of only the policies
whose status differs from what the watch last showed. A policy whose last write has
not come back through the watch yet is left for a later pass, so a pass never writes
the same change twice. One policy's failed write is recorded on it as
``Reconciled=False`` and stops no other (controllers/sessionfleet/controllers/faults.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import defaultdict
from datetime import datetime
from typing import Any

from sessionfleet.api import WorkerPhase
from sessionfleet.controllers import metrics
from sessionfleet.controllers.faults import Job, reconciled_condition, run_isolated, with_condition
from sessionfleet.controllers.fleet import Fleet
from sessionfleet.controllers.records import Key, PolicyRecord, WorkerRecord
from sessionfleet.controllers.status import status_patch
from sessionfleet.kube import DRAIN_POLICIES, Conflict, NotFound
from sessionfleet.policy.policies import PolicyStatusPlan, WorkerView, plan_policy_statuses
from sessionfleet.resources.status import merge_conditions, policy_status

log = logging.getLogger(__name__)


def worker_view(record: WorkerRecord) -> WorkerView | None:
    """Return what the policies' status reads of a worker; ``None`` when it is invalid."""
    if record.worker is None:
        return None
    return WorkerView(
        name=record.name,
        labels=record.worker.metadata.labels,
        reference=record.worker.spec.drain_policy_ref,
        draining=record.status.phase is WorkerPhase.DRAINING,
    )


def desired_status(record: PolicyRecord, plan: PolicyStatusPlan, now: datetime) -> dict[str, Any]:
    """Return the status the plan describes, as the API server would store it."""
    return policy_status(
        observed_generation=record.generation,
        matched_workers=len(plan.matched),
        workers=plan.listed,
        active_drains=plan.active_drains,
        conditions=merge_conditions(
            record.raw_status.get("conditions") or [], plan.conditions, now, record.generation
        ),
    )


def desired_statuses(fleet: Fleet, now: datetime) -> list[tuple[PolicyRecord, dict[str, Any]]]:
    """Return every DrainPolicy with the status it should carry, from the indexes."""
    policies: dict[str, list[PolicyRecord]] = defaultdict(list)
    for policy in fleet.indexes.all_policies():
        policies[policy.namespace].append(policy)
    workers: dict[str, list[WorkerView]] = defaultdict(list)
    for record in fleet.indexes.all_workers():
        view = worker_view(record)
        if view is not None:
            workers[record.namespace].append(view)
    desired: list[tuple[PolicyRecord, dict[str, Any]]] = []
    for namespace, records in policies.items():
        parsed, invalid = fleet.indexes.policy_specs(namespace)  # as each worker's drain reads them
        plans = plan_policy_statuses(parsed, workers.get(namespace, ()), invalid)
        desired.extend(
            (record, desired_status(record, plans[record.name], now))
            for record in records
            if record.name in plans
        )
    return desired


def _freshness_key(key: Key) -> Key:
    return (key[0], f"drainpolicy/{key[1]}")


async def write_status(fleet: Fleet, record: PolicyRecord, desired: dict[str, Any]) -> None:
    """Patch the policy's status subresource with what differs from the observed status."""
    if fleet.freshness.is_stale(_freshness_key(record.key), record.resource_version):
        return  # our last write has not come back through the watch yet
    patch = status_patch(record.raw_status, desired)
    if not patch:
        return
    try:
        body = await fleet.kube.patch(
            DRAIN_POLICIES,
            record.name,
            {"status": patch},
            record.namespace,
            status=True,
            resource_version=record.resource_version or None,
        )
    except (NotFound, Conflict):
        return  # deleted or changed meanwhile; the next pass decides from the new copy
    metrics.API_WRITES.labels("patch", "drainpolicies/status").inc()
    fleet.freshness.mark(_freshness_key(record.key), body)


async def record_fault(job: Job, message: str, now: datetime, *, fleet: Fleet) -> None:
    """Put ``Reconciled=False`` with the failure on the policy's status (once per change)."""
    namespace, name = job.key
    record = next((p for p in fleet.indexes.policies_in(namespace) if p.name == name), None)
    existing = (record.raw_status.get("conditions") or []) if record is not None else []
    conditions = with_condition(existing, reconciled_condition(message), now)
    if not status_patch({"conditions": existing}, {"conditions": conditions}):
        return
    body = await fleet.kube.patch(
        DRAIN_POLICIES,
        name,
        {"status": {"conditions": conditions}},
        namespace,
        status=True,
        resource_version=(record.resource_version or None) if record is not None else None,
    )
    metrics.API_WRITES.labels("patch", "drainpolicies/status").inc()
    fleet.freshness.mark(_freshness_key(job.key), body)


async def reconcile_policies(fleet: Fleet, now: datetime) -> None:
    """Bring every DrainPolicy's status up to date; called once per pass of the fleet loop.

    Never raises: a failure to plan is logged and the pass goes on; a failure to write
    one policy is recorded on that policy.
    """
    try:
        desired = desired_statuses(fleet, now)
    except Exception:  # the fleet loop must go on to the sessions
        log.exception("the DrainPolicy statuses could not be computed")
        return
    semaphore = asyncio.Semaphore(fleet.config.max_concurrent_writes)
    record = functools.partial(record_fault, fleet=fleet)

    async def one(policy: PolicyRecord, status: dict[str, Any]) -> None:
        async with semaphore:
            job = Job(
                DRAIN_POLICIES, policy.key, functools.partial(write_status, fleet, policy, status)
            )
            if not await run_isolated(job, fleet.faults, record, now):
                fleet.work.policies = True  # written again on the next pass

    await asyncio.gather(*(one(policy, status) for policy, status in desired))
