"""What a placement and a pass of the fleet loop cost the operator at 100,000 sessions.

No cluster: the operator's own indexes (the stores kopf keeps: key to the values
under it) filled with records parsed from synthetic objects — ``--workers`` Ready
workers and ``--sessions`` sessions Bound to them (bench/scale/memory.py's objects) —
and the operator's own functions timed on them, single-threaded:

* **placing one session**: ``Fleet.loads`` (placement's view of every worker) and
  ``place``, then the binding counted in flight, as a bind does: with the view kept
  between placements (now), built anew from the per-worker loads the session events
  keep (before), and counted from the index by worker (before that: the baseline,
  reproduced here);
* **deciding sessions**: the pure decision (``next_step``) over every session, which
  every pass of the fleet loop made before, against a marked pass's few hundred;
* **marking**: what a session event costs in :class:`WorkQueue` and
  :class:`WorkerLoads`;
* **a full pass's own work**: the repair of the per-worker counts and deadlines and
  the decision of every session, run on the event loop as the operator runs them: CPU
  in all, and the longest the event loop was held at once (what a bind waits behind);
* **reading one engine's metrics**: a page shaped like vLLM's (20 histograms of 25
  buckets with ``_created`` lines, its counters and gauges: ~700 lines, 64 KB), read
  by the operator's scrape (only the lines it reads parsed) against prometheus_client's
  parser over the whole page (before).

    .venv/bin/python bench/scale/passes.py [--sessions 10000,100000] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

from bench.scale.memory import NAMESPACE, WORKERS, agent_session  # noqa: E402
from sessionfleet.controllers.config import OperatorConfig  # noqa: E402
from sessionfleet.controllers.fleet import Fleet  # noqa: E402
from sessionfleet.controllers.loop import (  # noqa: E402
    due_sessions,
    parse_engine_metrics,
    repair,
)
from sessionfleet.controllers.records import session_record, worker_record  # noqa: E402
from sessionfleet.controllers.sessions import next_step  # noqa: E402
from sessionfleet.policy.placement import PlacementRequest, WorkerLoad, place  # noqa: E402
from sessionfleet.policy.sessions import next_check  # noqa: E402

NOW = datetime(2026, 12, 1, 12, 5, tzinfo=UTC)


def worker_body(index: int, max_sessions: int) -> dict[str, Any]:
    """A Ready InferenceWorker as the API server returns it."""
    name = f"w-{index:03d}"
    return {
        "apiVersion": "sessionfleet.dev/v1alpha1",
        "kind": "InferenceWorker",
        "metadata": {"name": name, "namespace": NAMESPACE, "resourceVersion": str(index + 1)},
        "spec": {
            "model": "qwen3-coder",
            "engine": {"type": "sim"},
            "gpus": 1,
            "capacity": {"maxSessions": max_sessions},
        },
        "status": {"phase": "Ready", "epoch": 1, "pod": f"{name}-1", "node": "n1"},
    }


def fleet_of(sessions: int, workers: int) -> Fleet:
    """A Fleet that holds the workers and sessions, loads counted from events."""
    fleet = Fleet(config=OperatorConfig(), kube=None, http=None)  # type: ignore[arg-type]
    records = [worker_record(worker_body(i, 2 * sessions // workers + 1)) for i in range(workers)]
    fleet.indexes.workers = {r.key: [r] for r in records}  # type: ignore[assignment]
    for index in range(sessions):
        state = session_record(agent_session(index))
        fleet.sessions.cache.put(state)
        fleet.sessions.worker_loads.update(state)
    return fleet


def loads_counted_from_the_index(fleet: Fleet, namespace: str) -> list[WorkerLoad]:
    """Placement's view as it was built before: each worker's sessions counted anew."""
    loads = []
    for record in fleet.indexes.all_workers():
        if record.namespace != namespace or record.worker is None:
            continue
        pinned = [s for s in fleet.sessions.sessions_of(record.key) if s.pinned]
        loads.append(
            WorkerLoad(
                name=record.name,
                model=record.worker.spec.model,
                ready=True,
                pinned_sessions=len(pinned) + fleet.sessions.ledger.unseen[record.key],
                max_sessions=record.worker.spec.capacity.max_sessions,
                kv_tokens_capacity=record.worker.spec.capacity.kv_tokens,
                kv_tokens_pinned=sum(s.context_tokens for s in pinned),
                kv_usage=0.0,
            )
        )
    return loads


def vllm_metrics_page() -> str:
    """A /metrics page shaped like vLLM's: many histograms, a few figures the operator reads."""
    registry = CollectorRegistry()
    labels = ("model_name", "engine")
    model = ("Qwen/Qwen3-Coder-30B-A3B-Instruct", "0")
    for i in range(20):
        buckets = [0.001 * 2**k for k in range(25)]
        Histogram(f"vllm:histogram_{i}", "h", labels, registry=registry, buckets=buckets).labels(
            *model
        ).observe(0.5)
    for name in ("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens", "num_preemptions"):
        Counter(f"vllm:{name}", "c", labels, registry=registry).labels(*model).inc(100)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        Gauge(f"vllm:{name}", "g", labels, registry=registry).labels(*model).set(0.5)
    return generate_latest(registry).decode()


def read_metrics_whole(text: str) -> int:
    """Before: prometheus_client's parser over the whole page (the samples counted)."""
    return sum(len(family.samples) for family in text_string_to_metric_families(text))


def full_pass_holds(fleet: Fleet) -> dict[str, float]:
    """CPU of a full pass's repair and decisions, and the longest hold of the event loop.

    A probe task takes a turn between every two of the pass's yields; the CPU between
    two of its turns is how long anything else waiting (a bind) was held.
    """

    async def run() -> dict[str, float]:
        holds: list[float] = []
        done = False

        async def probe() -> None:
            while not done:
                started = time.process_time()
                await asyncio.sleep(0)
                holds.append(time.process_time() - started)

        task = asyncio.create_task(probe())
        await asyncio.sleep(0)
        started = time.process_time()
        await repair(fleet)
        due = await due_sessions(fleet, fleet.sessions.all_sessions(), NOW)
        spent = time.process_time() - started
        done = True
        await task
        assert not due, "a settled fleet has nothing to do"
        return {"cpu_ms": round(spent * 1000, 1), "longest_hold_ms": round(max(holds) * 1000, 1)}

    return asyncio.run(run())


def timed(work: Callable[[], object], repeat: int) -> dict[str, float]:
    """Milliseconds per call: median and best of ``repeat`` calls."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        work()
        times.append(1000 * (time.perf_counter() - started))
    return {"median_ms": round(statistics.median(times), 3), "best_ms": round(min(times), 3)}


def measure(sessions: int, workers: int, marked: int) -> dict[str, Any]:
    """Every figure for one size."""
    fleet = fleet_of(sessions, workers)
    request = PlacementRequest(model="qwen3-coder", expected_tokens=40000)
    now_loads = place(request, fleet.loads(NAMESPACE))
    then_loads = place(request, loads_counted_from_the_index(fleet, NAMESPACE))
    assert now_loads.worker == then_loads.worker, "both views must place alike"
    every = fleet.sessions.all_sessions()
    few = every[:marked]
    sample = every[0]
    binds = itertools.count()

    def bind_one(view_anew: bool = False) -> None:
        # As a bind does: place, then count the binding in flight (one worker touched).
        if view_anew:
            fleet.sessions.placement.drop()
        placed = place(request, fleet.loads(NAMESPACE), ranked=True)
        assert placed.worker is not None
        fleet.sessions.ledger.add((NAMESPACE, f"new-{next(binds)}"), placed.worker, 0)

    page = vllm_metrics_page()
    return {
        "sessions": sessions,
        "workers": workers,
        "full_pass_repair_and_decisions": full_pass_holds(fleet),
        "read_one_vllm_metrics_page": timed(lambda: parse_engine_metrics(page), 50),
        "read_one_vllm_metrics_page_whole": timed(lambda: read_metrics_whole(page), 10),
        "place_one_session": timed(bind_one, 50),
        "place_one_session_view_built_anew": timed(lambda: bind_one(view_anew=True), 50),
        "place_one_session_counting_the_index": timed(
            lambda: place(request, loads_counted_from_the_index(fleet, NAMESPACE)), 10
        ),
        "decide_every_session": timed(lambda: [s for s in every if next_step(fleet, s, NOW)], 3),
        f"decide_{marked}_marked_sessions": timed(
            lambda: [s for s in few if next_step(fleet, s, NOW)], 50
        ),
        "mark_one_session_event_us": round(
            timed(
                lambda: [
                    (
                        fleet.sessions.worker_loads.update(sample),
                        fleet.work.session(sample.key),
                        fleet.work.session_deadlines.schedule(
                            sample.key,
                            next_check(sample).timestamp(),  # type: ignore[union-attr]
                        ),
                    )
                    for _ in range(1000)
                ],
                20,
            )["median_ms"],  # ms per 1,000 events: µs per event
            3,
        ),
    }


def main() -> int:
    """Measure each size; print and save the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", default="10000,100000", help="comma-separated sizes")
    parser.add_argument("--marked", type=int, default=200, help="sessions in a marked pass")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = [measure(int(size), WORKERS, args.marked) for size in args.sessions.split(",")]
    text = json.dumps(results, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
