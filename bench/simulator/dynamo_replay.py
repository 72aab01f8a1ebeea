"""Replay a Mooncake trace through Dynamo's simulator (round-robin and KV router).

Runs in a throwaway virtual environment, never the project's (bench/README.md):
``python dynamo_replay.py TRACE.jsonl WORKERS BLOCKS_PER_WORKER [options]``. Engines are
Dynamo's mocker with 512-token blocks, ``BLOCKS_PER_WORKER`` of them each; offline
(virtual clock). The options separate the causes of the gap to our simulator
(docs/simulator.md): ``--speedup-ratio`` makes the mocker's engine that many times faster
(``--decode-speedup-ratio`` its decode steps alone); ``--arrival-speedup-ratio`` below 1
slows the trace's arrivals; ``--no-active-blocks`` takes the in-flight blocks out of the
KV router's cost (overlap and prefill load only); ``--overlap-credit`` weighs each cached
block as that many prompt blocks (Dynamo's default: 1).
"""

import argparse
import statistics
import time

from dynamo._core import KvRouterConfig  # type: ignore[import-not-found]
from dynamo.replay.api import (  # type: ignore[import-not-found]
    TelemetryOptions,
    run_trace_replay,
)


def main() -> None:
    """Print one line per routing mode: prefix reuse, TTFT, pinned cache, simulated time."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("workers", type=int)
    parser.add_argument("blocks", type=int, help="KV blocks of 512 tokens per worker")
    parser.add_argument("--speedup-ratio", type=float, default=1.0)
    parser.add_argument("--decode-speedup-ratio", type=float, default=1.0)
    parser.add_argument("--arrival-speedup-ratio", type=float, default=1.0)
    parser.add_argument("--no-active-blocks", action="store_true")
    parser.add_argument("--overlap-credit", type=float, default=1.0)
    parser.add_argument("--modes", default="round_robin,kv_router")
    args = parser.parse_args()
    engine = {
        "engine": {
            "num_gpu_blocks": args.blocks,
            "block_size": 512,
            "speedup_ratio": args.speedup_ratio,
            "decode_speedup_ratio": args.decode_speedup_ratio,
        }
    }
    router = None  # Dynamo's defaults unless a router option is given
    if args.no_active_blocks or args.overlap_credit != 1.0:
        router = KvRouterConfig(
            router_track_active_blocks=not args.no_active_blocks,
            overlap_score_credit=args.overlap_credit,
        )
    for mode in args.modes.split(","):
        started = time.time()
        report = run_trace_replay(
            [args.trace],
            num_workers=args.workers,
            router_mode=mode,
            router_config=router,
            trace_block_size=512,
            arrival_speedup_ratio=args.arrival_speedup_ratio,
            extra_engine_args=engine,
            telemetry_options=TelemetryOptions(sample_interval_ms=10_000.0),
        )
        summary = report.summary
        # The share of each worker's blocks held by running requests (vLLM's block pool
        # evicts only blocks no running request holds), averaged over 10 s samples.
        pinned = statistics.fmean(
            worker["active_cache_usage"]
            for sample in report.telemetry.samples
            for worker in sample["decode_scheduler_metrics"]
        )
        print(
            f"dynamo {mode:<12} prefix reuse {summary['prefix_cache_reused_ratio']:.1%}  "
            f"TTFT p50 {summary['median_ttft_ms'] / 1000:.2f}s "
            f"p99 {summary['p99_ttft_ms'] / 1000:.2f}s  pinned {pinned:.0%}  "
            f"completed {summary['completed_requests']}/{summary['num_requests']}  "
            f"sim {summary['duration_ms'] / 1000:.0f}s  wall {time.time() - started:.1f}s",
            flush=True,
        )


if __name__ == "__main__":
    main()
