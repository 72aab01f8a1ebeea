"""How fast the fleet simulator runs: sessions per second and peak memory.

The target (issue 7): 100,000 sessions of 33 turns in at most 60 s on one core.
Each strategy runs in its own process, so that the peak resident memory reported
is that run's alone. The workload is generated lazily during the run, and its
generation is included in the time.

    .venv/bin/python bench/simulator/bench_simulator.py                 # every strategy
    .venv/bin/python bench/simulator/bench_simulator.py --strategy operator --sessions 20000
    .venv/bin/python bench/simulator/bench_simulator.py --workload published  # exactly 33 turns

This is a measurement, not a test: it never fails on a slow machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time

from sessionfleet.fleetsim import STRATEGIES, FleetConfig, simulate
from sessionfleet.workload import WorkloadConfig, generate


def _one(strategy: str, sessions: int, workload: str, seed: int) -> dict[str, object]:
    if workload == "published":
        config = WorkloadConfig.back_of_envelope(sessions)
    else:
        config = WorkloadConfig(sessions=sessions)
    wall = time.perf_counter()
    cpu = time.process_time()
    result = simulate(generate(config, seed), strategy, FleetConfig())
    cpu = time.process_time() - cpu
    wall = time.perf_counter() - wall
    # ru_maxrss is in kilobytes on Linux (bytes on macOS).
    scale = 1 if sys.platform == "darwin" else 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    return {
        "strategy": strategy,
        "workload": workload,
        "sessions": result.sessions,
        "turns": result.turns,
        "cpu_s": round(cpu, 2),
        "wall_s": round(wall, 2),
        "sessions_per_s": round(result.sessions / cpu),
        "turns_per_s": round(result.turns / cpu),
        "peak_rss_mib": round(peak / 2**20, 1),
        "hit_rate": round(result.hit_rate, 4),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=list(STRATEGIES), help="one strategy (default: all)")
    parser.add_argument("--sessions", type=int, default=100_000)
    parser.add_argument("--workload", choices=("agentic", "published"), default="agentic")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if args.strategy:
        print(json.dumps(_one(args.strategy, args.sessions, args.workload, args.seed)))
        return 0

    print(
        f"# {platform.python_implementation()} {platform.python_version()} on "
        f"{platform.machine()}, {args.sessions:,} {args.workload} sessions, one process each"
    )
    print(
        f"{'strategy':<16} {'turns':>10} {'cpu s':>7} {'wall s':>7} {'sessions/s':>11} "
        f"{'turns/s':>9} {'peak MiB':>9} {'hit rate':>9}"
    )
    for strategy in STRATEGIES:
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--strategy",
                strategy,
                "--sessions",
                str(args.sessions),
                "--workload",
                args.workload,
                "--seed",
                str(args.seed),
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        row = json.loads(out)
        print(
            f"{strategy:<16} {row['turns']:>10,} {row['cpu_s']:>7} {row['wall_s']:>7} "
            f"{row['sessions_per_s']:>11,} {row['turns_per_s']:>9,} {row['peak_rss_mib']:>9} "
            f"{row['hit_rate']:>9.1%}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
