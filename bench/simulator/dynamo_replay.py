"""Replay a Mooncake trace through Dynamo's simulator (round-robin and KV router).

Runs in a throwaway virtual environment, never the project's (bench/README.md):
``python dynamo_replay.py TRACE.jsonl WORKERS BLOCKS_PER_WORKER``. Engines are Dynamo's
mocker with 512-token blocks, ``BLOCKS_PER_WORKER`` of them each; offline (virtual clock).
"""

import sys
import time

from dynamo.replay.api import run_trace_replay  # type: ignore[import-not-found]


def main() -> None:
    """Print one line per routing mode: prefix reuse, TTFT, simulated time."""
    trace, workers, blocks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    engine = {"engine": {"num_gpu_blocks": blocks, "block_size": 512}}
    for mode in ("round_robin", "kv_router"):
        started = time.time()
        summary = run_trace_replay(
            [trace],
            num_workers=workers,
            router_mode=mode,
            trace_block_size=512,
            extra_engine_args=engine,
        ).summary
        print(
            f"dynamo {mode:<12} prefix reuse {summary['prefix_cache_reused_ratio']:.1%}  "
            f"TTFT p50 {summary['median_ttft_ms'] / 1000:.2f}s "
            f"p99 {summary['p99_ttft_ms'] / 1000:.2f}s  "
            f"completed {summary['completed_requests']}/{summary['num_requests']}  "
            f"sim {summary['duration_ms'] / 1000:.0f}s  wall {time.time() - started:.1f}s"
        )


if __name__ == "__main__":
    main()
