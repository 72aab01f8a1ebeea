"""The fleet loop: one task reconciling every worker and session from the indexes.

It runs when an event wakes it and at least every ``resync_seconds``, so deadlines
(grace periods, drain deadlines, idle timeouts, TTLs) are met within that interval
without a timer per object. A second task scrapes each Ready worker's engine metrics.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Iterable
from datetime import UTC, datetime

import httpx
from prometheus_client.parser import text_string_to_metric_families

from sessionfleet.api import SessionPhase, WorkerPhase
from sessionfleet.controllers import metrics
from sessionfleet.controllers.fleet import EngineStats, Fleet
from sessionfleet.controllers.sessions import next_step, reconcile_session
from sessionfleet.controllers.workers import reconcile_worker
from sessionfleet.kube import KubeError

log = logging.getLogger(__name__)


def utcnow() -> datetime:
    """Return the current time, timezone-aware."""
    return datetime.now(UTC)


async def _bounded(fleet: Fleet, jobs: Iterable[Awaitable[None]]) -> None:
    """Run jobs concurrently, at most ``max_concurrent_writes`` at a time; log failures."""
    semaphore = asyncio.Semaphore(fleet.config.max_concurrent_writes)

    async def one(job: Awaitable[None]) -> None:
        async with semaphore:
            try:
                await job
            except KubeError as error:
                log.warning("reconcile step failed: %s", error)

    await asyncio.gather(*(one(job) for job in jobs))


async def reconcile_once(fleet: Fleet, now: datetime) -> None:
    """Reconcile every worker, then every session."""
    fleet.forget_deleted()
    await _bounded(fleet, (reconcile_worker(fleet, r, now) for r in fleet.all_workers()))
    # Most sessions need nothing on most passes: decide without a task for each, and start
    # tasks only for those with a step to take (decided again when its turn comes).
    due = [s for s in fleet.all_sessions() if next_step(fleet, s, now) is not None]
    due.sort(key=lambda s: (s.created_at or now, s.name))
    await _bounded(fleet, (reconcile_session(fleet, s, now) for s in due))
    _export_gauges(fleet)


def _export_gauges(fleet: Fleet) -> None:
    sessions = fleet.all_sessions()
    phases = Counter(s.phase.value if s.phase else "New" for s in sessions)
    for phase in (*SessionPhase, "New"):
        name = phase if isinstance(phase, str) else phase.value
        metrics.SESSIONS.labels(name).set(phases.get(name, 0))
    metrics.RECOMPUTED_TOKENS.set(sum(s.recomputed_tokens for s in sessions if s.pinned))
    draining = 0
    for record in fleet.all_workers():
        pinned = sum(1 for s in fleet.sessions_of(record.key) if s.pinned)
        metrics.PINNED.labels(record.namespace, record.name).set(pinned)
        draining += record.status.phase is WorkerPhase.DRAINING
    metrics.DRAINS.set(draining)


async def run(fleet: Fleet) -> None:
    """Reconcile forever: on every wake-up, and at least every resync interval."""
    await fleet.indexed.wait()
    log.info("indexes populated; the fleet loop starts")
    while True:
        fleet.wakeup.clear()
        try:
            await reconcile_once(fleet, utcnow())
        except Exception:  # the loop must outlive any one bad step
            log.exception("fleet loop iteration failed")
        try:
            await asyncio.wait_for(fleet.wakeup.wait(), timeout=fleet.config.resync_seconds)
        except TimeoutError:
            pass
        # Let a burst of events settle into one iteration rather than one each.
        await asyncio.sleep(0.05)


def parse_engine_metrics(text: str) -> EngineStats:
    """Read vLLM's metric names (FACTS.md) from a Prometheus text exposition."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)

    def number(name: str) -> float | None:
        return values.get(name)

    running, waiting = number("vllm:num_requests_running"), number("vllm:num_requests_waiting")
    return EngineStats(
        kv_usage=number("vllm:kv_cache_usage_perc"),
        prefix_hits=number("vllm:prefix_cache_hits_total"),
        prefix_queries=number("vllm:prefix_cache_queries_total"),
        running=int(running) if running is not None else None,
        waiting=int(waiting) if waiting is not None else None,
    )


async def scrape_worker(fleet: Fleet, key: tuple[str, str], endpoint: str) -> None:
    """Scrape one engine; a failure leaves the last figures in place."""
    try:
        response = await fleet.http.get(
            f"{endpoint}/metrics", timeout=fleet.config.scrape_timeout_seconds
        )
        response.raise_for_status()
        fleet.stats[key] = parse_engine_metrics(response.text)
    except (httpx.HTTPError, ValueError) as error:
        log.debug("scrape of %s failed: %s", endpoint, error)


async def scrape_forever(fleet: Fleet) -> None:
    """Scrape every Ready worker's engine on the scrape interval, then wake the loop."""
    await fleet.indexed.wait()
    while True:
        targets = [
            (r.key, r.status.endpoint)
            for r in fleet.all_workers()
            if r.status.endpoint and r.status.phase in (WorkerPhase.READY, WorkerPhase.DRAINING)
        ]
        if targets:
            await asyncio.gather(*(scrape_worker(fleet, k, e) for k, e in targets if e))
            fleet.wakeup.set()
        await asyncio.sleep(fleet.config.scrape_interval_seconds)
