"""Run ``sessionfleet`` with probes for what stalls its event loop; report on exit.

    .venv/bin/python bench/router/stalls.py router --host=127.0.0.1 ... (the router's flags)

The probes, all in the process itself (bench/README.md, "Router: the tail"):

* garbage collection: ``gc.callbacks`` times every collection, per generation;
* loop lag: a task sleeps 1 ms in a loop; how late each wake-up comes is the time some
  callback held the loop (whatever it was);
* slow callbacks: asyncio's own check (``loop.slow_callback_duration``), which needs
  debug mode, is too costly to leave on under load, so each ``Handle._run`` is timed
  instead and the callbacks over 1 ms are counted by what they ran.

On SIGTERM the command ends as usual and a JSON summary goes to stderr.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import gc
import json
import sys
import time
from typing import Any

_gc_started: list[float] = [0.0]
_gc_pauses: dict[int, list[float]] = collections.defaultdict(list)
_lags: list[float] = []
_slow: collections.Counter[str] = collections.Counter()
_slow_ms: collections.defaultdict[str, float] = collections.defaultdict(float)


def _on_gc(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _gc_started[0] = time.perf_counter()
    else:
        _gc_pauses[info["generation"]].append(time.perf_counter() - _gc_started[0])


def _timed_run(original: Any) -> Any:
    def run(handle: asyncio.Handle) -> None:
        started = time.perf_counter()
        original(handle)
        spent = time.perf_counter() - started
        if spent > 0.001:
            callback = getattr(handle, "_callback", None)
            name = getattr(callback, "__qualname__", type(callback).__name__)
            task = getattr(callback, "__self__", None)
            if isinstance(task, asyncio.Task):
                coro = task.get_coro()
                name = getattr(coro, "__qualname__", name)
            _slow[name] += 1
            _slow_ms[name] += spent * 1000

    return run


async def _lag_probe() -> None:
    while True:
        started = time.perf_counter()
        await asyncio.sleep(0.001)
        _lags.append(time.perf_counter() - started - 0.001)


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 3)

    return {"n": len(ordered), "p50_ms": at(0.5), "p99_ms": at(0.99), "max_ms": at(1.0)}


def _report() -> None:
    summary = {
        "gc": {
            str(gen): _percentiles(p) | {"total_ms": round(sum(p) * 1000, 1)}
            for gen, p in sorted(_gc_pauses.items())
        },
        "loop_lag": _percentiles(_lags),
        "lag_over_2ms": sum(1 for lag in _lags if lag > 0.002),
        "slow_callbacks": [
            {"callback": name, "count": count, "total_ms": round(_slow_ms[name], 1)}
            for name, count in _slow.most_common(15)
        ],
    }
    print("STALLS " + json.dumps(summary), file=sys.stderr, flush=True)


def main() -> int:
    gc.callbacks.append(_on_gc)
    asyncio.Handle._run = _timed_run(asyncio.Handle._run)  # type: ignore[method-assign]
    original_run = asyncio.run

    def run(main_coro: Any, **kwargs: Any) -> Any:
        async def with_probe() -> Any:
            probe = asyncio.get_running_loop().create_task(_lag_probe())
            try:
                return await main_coro
            finally:
                probe.cancel()

        return original_run(with_probe(), **kwargs)

    asyncio.run = run  # type: ignore[assignment]
    atexit.register(_report)
    from sessionfleet.cli import main as sessionfleet_main

    sys.argv = ["sessionfleet", *sys.argv[1:]]
    return int(sessionfleet_main() or 0)


if __name__ == "__main__":
    raise SystemExit(main())
