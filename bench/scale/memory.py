"""What 10,000 and 100,000 live sessions cost in memory, in the operator and the router.

No cluster: synthetic AgentSession objects shaped as the API server returns them to the
operator and the routers (metadata with labels, an annotation and managedFields; a spec
as routers create it; a Bound status with the usage counters and a condition, as the
operator and routers write it), then, measured with tracemalloc (Python heap, not RSS):

* the objects themselves: what a cache of whole objects (a LIST's answer) holds;
* the router's binding table after ``replace_sessions`` (what a relist builds), and the
  peak heap of a relist through the router's reflector, the LIST read in pages of 500:
  keeping the objects until the table is rebuilt, or turning each page into views;
* the operator: its AgentSession watch (controllers/sessionwatch.py) listing every
  session through the same reflector, in pages of 500, into its fleet: what the fleet
  then holds for them (records by name and by worker, per-worker loads, each session's
  next deadline), the peak heap while the list ran, and its CPU time (without
  tracemalloc, less what making the synthetic pages costs); and the CPU of the same
  list again after the watch expired, every session unchanged.

Also the CPU of one ``session_record`` (a pydantic validation of the whole object),
which the operator pays once per event.

    .venv/bin/python bench/scale/memory.py [--sessions 10000,100000] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

from sessionfleet.controllers.config import OperatorConfig  # noqa: E402
from sessionfleet.controllers.fleet import Fleet  # noqa: E402
from sessionfleet.controllers.records import session_record  # noqa: E402
from sessionfleet.controllers.sessionwatch import follow, sources  # noqa: E402
from sessionfleet.fronts.bindings import BindingTable, SessionView  # noqa: E402
from sessionfleet.kube import SESSIONS, Gone  # noqa: E402
from sessionfleet.kube.reflector import reflect  # noqa: E402

GROUP_VERSION = "sessionfleet.dev/v1alpha1"
NAMESPACE = "agents"
WORKERS = 500


def agent_session(index: int) -> dict[str, Any]:
    """One live, Bound session as the API server returns it."""
    name = f"s-{index:06d}-{index * 7919 % 1000003:07d}"
    worker = f"w-{index % WORKERS:03d}"
    stamp = "2026-12-01T12:00:00Z"
    return {
        "apiVersion": GROUP_VERSION,
        "kind": "AgentSession",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "uid": f"00000000-0000-4000-8000-{index:012d}",
            "resourceVersion": str(100000 + index),
            "generation": 1,
            "creationTimestamp": stamp,
            "labels": {
                "app.kubernetes.io/managed-by": "sessionfleet",
                "sessionfleet.dev/client": "ClaudeCode",
                "sessionfleet.dev/model": "qwen3-coder",
            },
            "annotations": {"ack.sessionfleet.dev/router-0": stamp},
            "managedFields": [
                {
                    "manager": "sessionfleet-router",
                    "operation": "Update",
                    "apiVersion": GROUP_VERSION,
                    "time": stamp,
                    "fieldsType": "FieldsV1",
                    "fieldsV1": {"f:spec": {".": {}, "f:sessionId": {}, "f:model": {}}},
                },
                {
                    "manager": "sessionfleet-operator",
                    "operation": "Update",
                    "apiVersion": GROUP_VERSION,
                    "time": stamp,
                    "fieldsType": "FieldsV1",
                    "subresource": "status",
                    "fieldsV1": {"f:status": {".": {}, "f:phase": {}, "f:worker": {}}},
                },
            ],
        },
        "spec": {
            "sessionId": f"claude-code-{index:08d}-4f1c-9a2b",
            "model": "qwen3-coder",
            "workerHint": worker,
        },
        "status": {
            "phase": "Bound",
            "worker": worker,
            "pod": f"{worker}-1",
            "epoch": 1,
            "boundAt": stamp,
            "observedGeneration": 1,
            "turns": 12,
            "promptTokens": 480000,
            "cachedTokens": 451000,
            "completionTokens": 9000,
            "recomputedTokens": 3100,
            "hitRatePercent": 93.96,
            "lastActivity": stamp,
            "firstTurnAt": stamp,
            "firstTurnUncachedTokens": 25900,
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "Bound",
                    "message": f"bound to {worker}",
                    "lastTransitionTime": stamp,
                    "observedGeneration": 1,
                }
            ],
        },
    }


def heap_of(build: Callable[[], Any]) -> tuple[Any, int]:
    """Build something; return it and the Python heap it holds."""
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    built = build()
    gc.collect()
    return built, tracemalloc.get_traced_memory()[0] - before


class Pager:
    """Answers a chunked LIST of ``count`` sessions, 500 a page, each page decoded anew.

    Its first watch ends with 410 Gone once ``expire`` is set (when one is given), so
    the reflector lists again; ``watches`` counts the watches begun, each one after the
    list before it was handled whole.
    """

    def __init__(self, count: int, expire: asyncio.Event | None = None) -> None:
        self.count = count
        self.expire = expire
        self.watches = 0
        self.making = 0.0
        """CPU seconds spent making the pages (not the operator's)."""

    async def pages(self, *_: Any, **__: Any) -> Any:
        for start in range(0, self.count, 500):
            stop = min(start + 500, self.count)
            started = time.process_time()
            page = [agent_session(i) for i in range(start, stop)]
            self.making += time.process_time() - started
            yield page, (str(self.count) if stop == self.count else None)

    async def watch(self, *_: Any, **__: Any) -> Any:
        """Nothing happens after the list, but the expiry asked for."""
        self.watches += 1
        if self.expire is not None and self.watches == 1:
            await self.expire.wait()
            raise Gone(410, "too old resource version")
        await asyncio.Event().wait()
        yield  # an async generator, as Kube.watch is


async def _operator_lists(count: int) -> tuple[Fleet, int]:
    pager: Any = Pager(count)
    fleet = Fleet(config=OperatorConfig(), kube=pager, http=None)
    task = asyncio.create_task(follow(fleet, sources([NAMESPACE])[0]))
    while not fleet.sessions.cache.listed:
        await asyncio.sleep(0.01)
    peak = tracemalloc.get_traced_memory()[1] if tracemalloc.is_tracing() else 0
    task.cancel()
    return fleet, peak


def operator_relist(count: int) -> tuple[Fleet, int, int]:
    """The operator's session watch listing ``count`` sessions, as at a start or after a
    410: what its fleet then holds for them (heap), and the peak heap while it listed
    (taken before the event loop's teardown, which allocates on its own)."""
    gc.collect()
    tracemalloc.start()
    fleet, peak = asyncio.run(_operator_lists(count))
    gc.collect()
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return fleet, held, peak


def operator_relist_cpu(count: int) -> float:
    """CPU seconds of that list, less what making the synthetic pages costs."""

    async def pages_alone() -> None:
        async for _ in Pager(count).pages():
            pass

    started = time.process_time()
    asyncio.run(pages_alone())
    making = time.process_time() - started
    started = time.process_time()
    asyncio.run(_operator_lists(count))
    return time.process_time() - started - making


def operator_relist_again_cpu(count: int) -> float:
    """CPU seconds of the operator's relist after its watch expired, every session listed
    again at the version it already holds (nothing changed meanwhile), less what making
    the synthetic pages costs."""

    async def until(check: Callable[[], bool]) -> None:
        while not check():
            await asyncio.sleep(0.01)

    async def relist() -> float:
        pager: Any = Pager(count, expire=asyncio.Event())
        fleet = Fleet(config=OperatorConfig(), kube=pager, http=None)
        task = asyncio.create_task(follow(fleet, sources([NAMESPACE])[0]))
        await until(lambda: pager.watches == 1)
        started, making = time.process_time(), pager.making
        pager.expire.set()
        await until(lambda: pager.watches == 2)
        spent = time.process_time() - started - (pager.making - making)
        task.cancel()
        assert len(fleet.sessions.cache) == count
        return spent

    return asyncio.run(relist())


def relist_peak(count: int, *, views: bool) -> int:
    """Peak heap while a router's reflector relists ``count`` sessions into its table."""

    async def relist() -> BindingTable:
        table = BindingTable()
        pager: Any = Pager(count)
        if views:
            events = reflect(pager, SESSIONS, NAMESPACE, convert=SessionView.from_object)
        else:
            events = reflect(pager, SESSIONS, NAMESPACE)
        sync = await anext(events)
        if views:
            table.replace_session_views(sync.items)
        else:
            table.replace_sessions(sync.items)
        await events.aclose()
        return table

    gc.collect()
    tracemalloc.start()
    table = asyncio.run(relist())
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del table
    return peak


def measure(count: int) -> dict[str, Any]:
    tracemalloc.start()
    objects, raw = heap_of(lambda: [agent_session(i) for i in range(count)])
    table, table_bytes = heap_of(lambda: _table(objects))
    tracemalloc.stop()  # it slows allocation: the CPU figure is taken without it
    started = time.process_time()
    sample = objects[: min(count, 5000)]
    for obj in sample:
        session_record(obj)
    parse_us = (time.process_time() - started) / len(sample) * 1e6
    del table
    peak_objects = relist_peak(count, views=False)
    peak_views = relist_peak(count, views=True)
    fleet, operator_bytes, operator_peak = operator_relist(count)
    assert len(fleet.sessions.cache) == count
    del fleet
    relist_cpu = operator_relist_cpu(count)
    relist_again_cpu = operator_relist_again_cpu(count)
    return {
        "sessions": count,
        "relist_peak_objects_mib": round(peak_objects / 2**20, 1),
        "relist_peak_views_mib": round(peak_views / 2**20, 1),
        "objects_mib": round(raw / 2**20, 1),
        "object_bytes": raw // count,
        "router_table_mib": round(table_bytes / 2**20, 1),
        "router_bytes_per_session": table_bytes // count,
        "operator_mib": round(operator_bytes / 2**20, 1),
        "operator_bytes_per_session": operator_bytes // count,
        "operator_relist_peak_mib": round(operator_peak / 2**20, 1),
        "operator_relist_cpu_seconds": round(relist_cpu, 2),
        "operator_relist_unchanged_cpu_seconds": round(relist_again_cpu, 2),
        "session_record_cpu_us": round(parse_us, 1),
    }


def _table(objects: list[dict[str, Any]]) -> BindingTable:
    table = BindingTable()
    table.replace_sessions(objects)
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", default="10000,100000")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = []
    for count in (int(n) for n in args.sessions.split(",")):
        result = measure(count)
        results.append(result)
        print(json.dumps(result), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
