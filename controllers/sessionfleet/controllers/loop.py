"""The fleet loop: one task reconciling workers and sessions from the indexes.

It runs when an event wakes it and at least every ``resync_seconds``. A pass takes
what events marked and what came due (:mod:`.work`): its cost follows what changed,
not the size of the fleet. Deadlines (grace periods, drain deadlines, idle timeouts,
TTLs) are met within ``resync_seconds``: workers whose plan depends on the clock are
looked at on every pass, sessions at their own deadline. Every ``full_resync_seconds``
a pass takes everything, the safety net. A second task scrapes each Ready worker's
engine metrics.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, Final, TypeVar

from prometheus_client import Gauge
from prometheus_client.parser import text_string_to_metric_families

from sessionfleet.api import ConditionType, Reason, SessionPhase, WorkerPhase
from sessionfleet.controllers import metrics
from sessionfleet.controllers.faults import Job, reconciled_condition, run_isolated, with_condition
from sessionfleet.controllers.fleet import EngineStats, Fleet
from sessionfleet.controllers.policies import reconcile_policies
from sessionfleet.controllers.records import Key
from sessionfleet.controllers.sessioncache import NEW
from sessionfleet.controllers.sessions import next_step, reconcile_session
from sessionfleet.controllers.work import Batch
from sessionfleet.controllers.workers import reconcile_worker
from sessionfleet.engines import vllm
from sessionfleet.kube import SESSIONS, WORKERS
from sessionfleet.kube.connections import TRANSPORT_ERRORS, decoded, fetch_once
from sessionfleet.policy.observed import NodeState
from sessionfleet.policy.recovery import NodeRecoveryGate, node_recovery_gate
from sessionfleet.policy.sessions import SessionState, Urgency, next_check

log = logging.getLogger(__name__)

T = TypeVar("T")
FULL: Final = Batch(full=True)
GAUGE_SECONDS: Final = 5.0
"""The session and worker gauges are exported at most this often."""
SCRAPES_AT_ONCE: Final = 16
"""Engines scraped concurrently (see :func:`scrape_forever`)."""
SESSIONS_BETWEEN_YIELDS: Final = 1000
"""Sessions a pass looks at between two yields to the event loop (binds go between)."""


def utcnow() -> datetime:
    """Return the current time, timezone-aware."""
    return datetime.now(UTC)


async def _bounded(fleet: Fleet, jobs: Iterable[Job], now: datetime) -> None:
    """Run jobs concurrently, at most ``max_concurrent_writes`` at a time, each isolated.

    A job that fails is looked at again after a resync interval, whatever marks it.
    """
    semaphore = asyncio.Semaphore(fleet.config.max_concurrent_writes)
    retry_at = time.monotonic() + fleet.config.resync_seconds

    async def one(job: Job) -> None:
        # Let event handlers in between jobs, a new session's bind among them: without
        # this a pass of many jobs that never wait runs as one block of the event loop.
        await asyncio.sleep(0)
        async with semaphore:
            await _isolated(fleet, job, now, retry_at)

    await asyncio.gather(*(one(job) for job in jobs))


async def _isolated(fleet: Fleet, job: Job, now: datetime, retry_at: float) -> None:
    """Run one job isolated (:func:`run_isolated`); look at its object again if it failed."""
    if not await run_isolated(job, fleet.faults, functools.partial(record_fault, fleet=fleet), now):
        fleet.work.retry(job.resource.plural, job.key, retry_at)


def start_session_steps(fleet: Fleet, due: Iterable[SessionState], now: datetime) -> None:
    """Start each due session's step beside the loop: the pass does not wait for them.

    Their writes take turns by urgency (:mod:`.turns`). A pass that waited for its
    session steps waited behind every bind queued before them, and the drains and
    recoveries its next pass would have moved on waited with it: none ended within a
    minute at 20,000 live sessions (``make bench-scale``). A step still waiting for its
    turn is busy (:func:`.sessions.reconcile_session`), so the next pass skips it.
    """
    retry_at = time.monotonic() + fleet.config.resync_seconds
    for session in due:
        job = Job(SESSIONS, session.key, functools.partial(reconcile_session, fleet, session, now))
        fleet.spawner.spawn(
            f"session {session.namespace}/{session.name}", _isolated(fleet, job, now, retry_at)
        )


async def record_fault(job: Job, message: str, now: datetime, *, fleet: Fleet) -> None:
    """Put ``Reconciled=False`` with the failure on the object's status."""
    condition = reconciled_condition(message)
    namespace, name = job.key
    if job.resource is WORKERS:
        record = fleet.indexes.worker(namespace, name)
        existing = (record.raw_status.get("conditions") or []) if record is not None else []
        version = record.resource_version if record is not None else None
    else:
        # A session's conditions are not indexed; failures are rare enough to read them.
        body = await fleet.kube.get(job.resource, name, namespace)
        existing = (body.get("status") or {}).get("conditions") or []
        version = (body.get("metadata") or {}).get("resourceVersion")
    # On the version the conditions were read from: a stale copy's write fails (409).
    await fleet.kube.patch(
        job.resource,
        name,
        {"status": {"conditions": with_condition(existing, condition, now)}},
        namespace,
        status=True,
        resource_version=version or None,
    )


async def reconcile_once(fleet: Fleet, now: datetime, batch: Batch = FULL) -> None:
    """Reconcile the batch's workers, then start its sessions' steps; each isolated.

    The pass waits for its workers' steps, not its sessions' (:func:`start_session_steps`).

    A full batch (the default) takes every worker and every session, and repairs what
    the marks rely on: each session's deadline and the per-worker load counts.
    """
    started = time.monotonic()
    fleet.sessions.forget_deleted()
    fleet.worker_writes.node_gate = _node_gate(fleet)
    workers = (
        fleet.indexes.all_workers() if batch.full else _present(fleet.indexes.worker, batch.workers)
    )
    await _bounded(
        fleet,
        (Job(WORKERS, r.key, functools.partial(reconcile_worker, fleet, r, now)) for r in workers),
        now,
    )
    if batch.full or batch.policies:
        await reconcile_policies(fleet, now)
    sessions = (
        fleet.sessions.all_sessions()
        if batch.full
        else _present(fleet.sessions.session, batch.sessions)
    )
    if batch.full:
        await repair(fleet)
    start_session_steps(fleet, await due_sessions(fleet, sessions, now), now)
    kind = "full" if batch.full else "marked"
    metrics.PASS_SECONDS.labels(kind).observe(time.monotonic() - started)
    metrics.PASS_OBJECTS.labels(kind, "inferenceworkers").observe(len(workers))
    metrics.PASS_OBJECTS.labels(kind, "agentsessions").observe(len(sessions))
    if batch.full or started - fleet.loop_marks.gauges_at >= GAUGE_SECONDS:
        fleet.loop_marks.gauges_at = started
        _export_gauges(fleet)


def _present(lookup: Callable[[str, str], T | None], keys: Iterable[Key]) -> list[T]:
    """Return the index's current copy of each key that still exists."""
    return [record for key in keys if (record := lookup(*key)) is not None]


async def repair(fleet: Fleet) -> None:
    """Put right what the marks rely on, should an event have been missed.

    One session at a time, from the index as it is at that moment, with the event loop
    let in between (:func:`paced`): at 100,000 sessions the whole of it took over a
    second, every bind held behind it.
    """
    loads, deadlines = fleet.sessions.worker_loads, fleet.work.session_deadlines
    held = fleet.sessions.cache.by_key
    wrong = 0
    async for key in paced(list(held)):
        session = held.get(key)
        wrong += loads.check(key, session)
        when = (
            next_check(session, fleet.config.idle_timeout, fleet.config.lost_timeout)
            if session is not None
            else None
        )
        deadlines.schedule(key, when.timestamp() if when is not None else None)
    async for key in paced(list(loads.counted())):
        if key not in held:  # counted, but its deletion was missed
            wrong += loads.check(key, None)
            deadlines.schedule(key, None)
    fleet.sessions.placement.drop()  # built again from the records at the next placement
    if wrong:
        log.warning("full pass: %d session(s) were counted on the wrong worker", wrong)


async def paced(items: Iterable[T]) -> AsyncIterator[T]:
    """Yield the items, letting the event loop in every :data:`SESSIONS_BETWEEN_YIELDS`."""
    for count, item in enumerate(items, 1):
        yield item
        if count % SESSIONS_BETWEEN_YIELDS == 0:
            await asyncio.sleep(0)


def _node_gate(fleet: Fleet) -> NodeRecoveryGate:
    """Return this pass's budget for moving workers off NotReady nodes.

    Only a worker on a NotReady node takes from it: while every node is Ready it is not
    worked out (it looks at every worker's pods, on every pass).
    """
    if all(node.ready for node in fleet.indexes.all_nodes()):
        return NodeRecoveryGate(fleet.config.max_concurrent_node_recoveries)
    return node_recovery_gate(
        fleet_nodes(fleet),
        moving=_moving_off_not_ready_nodes(fleet, time.monotonic()),
        max_concurrent=fleet.config.max_concurrent_node_recoveries,
        unhealthy_threshold=fleet.config.unhealthy_node_threshold,
    )


NODE_MOVE_MEMORY_SECONDS: Final = 30.0
"""How long a move off a NotReady node counts before the index shows it (a write's
watch event comes back within milliseconds; this only bounds a lost one)."""


def _moving_off_not_ready_nodes(fleet: Fleet, now: float) -> int:
    """Count the workers moving off NotReady nodes, shown by the index or written here.

    A move this process wrote counts until the index shows it. Two workers on NotReady
    nodes are often reconciled in different passes (their nodes' events come apart):
    without these, the pass between a move's write and its watch event would see no
    move and let a second one past the cap.
    """
    moving = 0
    for record in fleet.indexes.all_workers():
        shown = moving_off_not_ready_node(record.raw_status)
        written = fleet.worker_writes.node_moves.get(record.key)
        if shown or (written is not None and now - written >= NODE_MOVE_MEMORY_SECONDS):
            fleet.worker_writes.node_moves.pop(record.key, None)
            written = None
        moving += shown or written is not None
    return moving


def fleet_nodes(fleet: Fleet) -> list[NodeState]:
    """Return the nodes that run the workers this operator serves (its share of the cluster)."""
    names = {
        pod.node
        for r in fleet.indexes.all_workers()
        for pod in fleet.indexes.pods_of(r.key)
        if pod.node
    }
    return [node for name in sorted(names) if (node := fleet.indexes.node(name)) is not None]


def moving_off_not_ready_node(status: Mapping[str, Any]) -> bool:
    """Whether a worker's status says it is Recovering because its node went NotReady."""
    if status.get("phase") != WorkerPhase.RECOVERING.value:
        return False
    return any(
        c.get("type") == ConditionType.RECOVERING.value
        and c.get("reason") == Reason.NODE_NOT_READY.value
        for c in status.get("conditions") or ()
    )


async def due_sessions(
    fleet: Fleet, sessions: list[SessionState], now: datetime
) -> list[SessionState]:
    """Return the sessions with a step to take, oldest first.

    Most sessions need nothing on most passes: they are decided without a task each, and
    tasks start only for those with a step to take (decided again when its turn comes).
    The event loop is let in between (:func:`paced`): a full pass decides every
    session, 1.3 seconds of it at 100,000.
    """
    due = [session async for session in paced(sessions) if _due(fleet, session, now)]
    due.sort(key=lambda s: (s.created_at or now, s.name))
    return due


def _due(fleet: Fleet, session: SessionState, now: datetime) -> bool:
    """Whether a session has a step to take; one whose decision fails gets its job too.

    Its job then fails the same way, isolated, and the failure is recorded on it.
    """
    try:
        return next_step(fleet, session, now) is not None
    except Exception:  # one odd session must not stop the others' pass
        return True


def _export_gauges(fleet: Fleet) -> None:
    """Export the session and worker gauges from counts kept as events arrive."""
    phases = fleet.sessions.cache.phases
    for name in (*(phase.value for phase in SessionPhase), NEW):
        metrics.SESSIONS.labels(name).set(phases.get(name, 0))
    metrics.RECOMPUTED_TOKENS.set(fleet.sessions.cache.recomputed_pinned)
    for urgency in Urgency:
        metrics.WRITES_WAITING.labels(urgency.name.lower()).set(
            fleet.sessions.writes.waiting[urgency]
        )
    draining: set[tuple[str, str]] = set()
    workers = fleet.indexes.all_workers()
    pinned = fleet.sessions.worker_loads.pinned
    for record in workers:
        metrics.PINNED.labels(record.namespace, record.name).set(pinned.get(record.key, 0))
        if record.status.phase is WorkerPhase.DRAINING:
            draining.add(record.key)
    metrics.DRAINS.set(len(draining))
    # A worker deleted (or no longer draining, or invalid) leaves no series behind: a
    # frozen drain gauge would keep its alert firing.
    _prune(metrics.PINNED, {r.key for r in workers})
    _prune(metrics.DRAIN_HELD, draining)
    _prune(metrics.DRAIN_DEADLINE, draining)


def _prune(gauge: Gauge, keep: set[tuple[str, str]]) -> None:
    """Remove the gauge's (namespace, worker) series that are not in ``keep``."""
    for family in gauge.collect():
        for sample in family.samples:
            labels = (sample.labels["namespace"], sample.labels["worker"])
            if labels not in keep:
                gauge.remove(*labels)


async def run(fleet: Fleet) -> None:
    """Reconcile forever, once leading: on every wake-up, and at least every resync interval.

    A standby waits here with its indexes kept warm by the watches, so it takes over
    from a picture of the fleet that is already complete.
    """
    await fleet.indexed.wait()
    await fleet.leadership.acquired.wait()
    log.info("indexes populated and leading; the fleet loop starts")
    while True:
        fleet.wakeup.clear()
        if fleet.leadership.leading:  # a deposed leader only waits for its exit
            try:
                now = utcnow()
                await reconcile_once(fleet, now, fleet.work.take(now.timestamp(), time.monotonic()))
            except Exception:  # the loop must outlive any one bad step
                log.exception("fleet loop iteration failed")
            if fleet.loop_marks.pass_at is None:  # what a new leader started from, for its log
                log.info(
                    "first pass done: %d worker(s), %d session(s)",
                    len(fleet.indexes.all_workers()),
                    len(fleet.sessions.cache),
                )
            fleet.loop_marks.pass_at = time.monotonic()
            metrics.LAST_PASS.set(time.time())
        try:
            await asyncio.wait_for(fleet.wakeup.wait(), timeout=fleet.config.resync_seconds)
        except TimeoutError:
            pass
        # Let a burst of events settle into one iteration rather than one each.
        await asyncio.sleep(0.05)


_HITS: Final = f"{vllm.PREFIX_CACHE_HITS}_total"
_QUERIES: Final = f"{vllm.PREFIX_CACHE_QUERIES}_total"
_READ: Final = frozenset(
    {
        vllm.KV_CACHE_USAGE_PERC,
        vllm.NUM_REQUESTS_RUNNING,
        vllm.NUM_REQUESTS_WAITING,
        _HITS,
        _QUERIES,
    }
)
"""The samples the operator reads (counters are exposed with ``_total``)."""
_READ_LINES: Final = tuple(f"{name}{end}" for name in sorted(_READ) for end in ("{", " "))
"""How the lines of those samples begin: a name, then its labels or its value."""


def parse_engine_metrics(text: str) -> EngineStats:
    """Read vLLM's metrics from a Prometheus text exposition.

    A NaN or infinite value is left out and named in ``ignored`` (the worker then
    carries ``EngineMetrics=False``): one engine's nonsense must neither stop the
    scraper nor reach a status field.

    Only the lines of the samples read are parsed: vLLM's page is some 700 lines of
    histograms (64 KB), which prometheus_client's parser took 6-12 ms to read whole,
    a third of a core for 500 workers scraped every 15 seconds.
    """
    values: dict[str, float] = {}
    samples: Counter[str] = Counter()
    ignored: set[str] = set()
    read = "\n".join(line for line in text.splitlines() if line.startswith(_READ_LINES))
    for family in text_string_to_metric_families(read + "\n"):
        for sample in family.samples:
            if sample.name not in _READ:
                continue
            value = float(sample.value)
            if not math.isfinite(value):
                ignored.add(sample.name)
                continue
            values[sample.name] = values.get(sample.name, 0.0) + value
            samples[sample.name] += 1
    for name in ignored:
        values.pop(name, None)

    running = values.get(vllm.NUM_REQUESTS_RUNNING)
    waiting = values.get(vllm.NUM_REQUESTS_WAITING)
    kv_usage = values.get(vllm.KV_CACHE_USAGE_PERC)
    if kv_usage is not None:
        # Counts add up over a worker's engines (data parallel: one sample each); each
        # engine has a KV cache of its own, so the worker's usage is their mean.
        kv_usage /= samples[vllm.KV_CACHE_USAGE_PERC]
    return EngineStats(
        kv_usage=min(max(kv_usage, 0.0), 1.0) if kv_usage is not None else None,
        prefix_hits=_non_negative(values.get(_HITS)),
        prefix_queries=_non_negative(values.get(_QUERIES)),
        running=max(0, int(running)) if running is not None else None,
        waiting=max(0, int(waiting)) if waiting is not None else None,
        ignored=tuple(sorted(ignored)),
    )


def _non_negative(value: float | None) -> float | None:
    return None if value is None else max(0.0, value)


SCRAPE_ERRORS: tuple[type[Exception], ...] = (*TRANSPORT_ERRORS, ValueError)
"""An engine that did not answer, answered other than 200, or with what does not parse."""


async def scrape_worker(fleet: Fleet, key: tuple[str, str], endpoint: str) -> bool:
    """Scrape one engine; return whether its figures changed (a failure keeps the last)."""
    try:
        answer = await fetch_once(f"{endpoint}/metrics", fleet.config.scrape_timeout_seconds)
        if answer.status != 200:
            raise ValueError(f"answered {answer.status}")
        stats = parse_engine_metrics(decoded(answer).decode(errors="replace"))
    except SCRAPE_ERRORS as error:
        log.debug("scrape of %s failed: %s", endpoint, error)
        return False
    changed = fleet.engines.stats.get(key) != stats
    fleet.engines.stats[key] = stats
    if changed:
        fleet.sessions.placement.touched.add(key)
    return changed


async def scrape_all(fleet: Fleet, targets: list[tuple[Key, str]]) -> list[bool]:
    """Scrape the engines a few at a time; return whether each one's figures changed.

    A few at a time: through httpx's connection pool, which matches each queued request
    against every connection on every change (encode/httpcore#1035), 500 scrapes queued
    at once cost the operator most of a core for seconds and held every bind behind
    them (``make bench-scale``, bench/README.md). Each scrape now has a connection of
    its own, no pool; the limit still bounds the sockets and the memory in flight.
    """
    limit = asyncio.Semaphore(SCRAPES_AT_ONCE)

    async def one(key: Key, endpoint: str) -> bool:
        async with limit:
            return await scrape_worker(fleet, key, endpoint)

    return await asyncio.gather(*(one(key, endpoint) for key, endpoint in targets))


async def scrape_forever(fleet: Fleet) -> None:
    """Scrape every Ready worker's engine on the scrape interval, then wake the loop.

    Only the leader scrapes: the figures feed its decisions and status writes.
    """
    await fleet.indexed.wait()
    await fleet.leadership.acquired.wait()
    while True:
        targets = [
            (r.key, endpoint)
            for r in fleet.indexes.all_workers()
            if (endpoint := r.status.endpoint)
            and r.status.phase in (WorkerPhase.READY, WorkerPhase.DRAINING)
        ]
        if targets:
            changed = await scrape_all(fleet, targets)
            # Only a worker whose figures moved has counters to write: an idle fleet's
            # scrape marks nothing (500 workers marked every interval cost a pass each).
            moved = (key for (key, _), change in zip(targets, changed, strict=True) if change)
            fleet.work.workers.update(moved)
            fleet.wakeup.set()
        await asyncio.sleep(fleet.config.scrape_interval_seconds)
