"""How long a restarted operator takes to be ready with N AgentSessions, and what it holds.

Run from the repository root (after ``make venv`` and ``make e2e-tools``)::

    .venv/bin/python bench/scale/restart.py [--sessions 2000,5000,10000,20000] [--out FILE]
        [--stock-kopf-start] [--before OTHER/.venv/bin/sessionfleet --before-label NAME]

It starts a real control plane (the e2e harness, one node) and creates the sessions in
one namespace with a Bound status as the operator and the routers write it
(``bench/scale/memory.py``'s objects). At each count the operator (``sessionfleet
operator``, a real process, the chart's Lease timings) is started with the sessions
already there, as after a restart or a failover: this tree's, and with
``--stock-kopf-start`` and ``--before`` those too (another checkout's executable: how
it was). Measured per start, until ``/readyz`` answers 200 (the indexes and the
session watch hold their first lists):

- wall seconds and the operator's CPU seconds;
- its resident memory then, and its peak;
- or, if it exits first, its exit status and last error.

The operator is stopped as soon as it is ready: what it then decides about sessions
bound to workers that do not exist is not what this measures. On a busy machine the
CPU seconds are the figure to compare; the wall time includes waiting for the API server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.append(str(REPO))  # after the standard library: see e2e/localcluster/__main__.py

from bench.operator.run import cpu_seconds, log, mib, proc_status, publish  # noqa: E402
from bench.scale.memory import agent_session  # noqa: E402
from e2e.helpers import wait_established  # noqa: E402
from e2e.localcluster import LocalCluster  # noqa: E402
from e2e.operator import CHART_ELECTION_ARGS, SESSIONFLEET, OperatorProcess  # noqa: E402
from sessionfleet.kube import SESSIONS, Kube, KubeConfig  # noqa: E402

NAMESPACE = "bench-restart"
CRDS_DIR = REPO / "crds"


def stored_session(index: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """One session to create, and the status to write on it."""
    whole = agent_session(index)
    metadata = whole["metadata"]
    body = {
        "apiVersion": whole["apiVersion"],
        "kind": whole["kind"],
        "metadata": {
            "name": metadata["name"],
            "labels": metadata["labels"],
            "annotations": metadata["annotations"],
        },
        "spec": whole["spec"],
    }
    return body, whole["status"]


async def create_sessions(kube: Kube, start: int, stop: int, concurrency: int = 32) -> None:
    """Create sessions ``start``..``stop`` with their Bound status."""
    semaphore = asyncio.Semaphore(concurrency)

    async def one(index: int) -> None:
        body, status = stored_session(index)
        async with semaphore:
            await kube.create(SESSIONS, body, NAMESPACE)
            name = body["metadata"]["name"]
            await kube.patch(SESSIONS, name, {"status": status}, NAMESPACE, status=True)

    await asyncio.gather(*(one(index) for index in range(start, stop)))


async def start_once(operator: OperatorProcess, timeout: float) -> dict[str, Any]:
    """Start the operator and wait for /readyz: wall and CPU seconds, memory, or its end.

    An operator that exits first (a leader whose event loop was blocked past its Lease's
    renew deadline exits) is reported with its exit status and the last line it logged.
    """
    started = time.monotonic()
    operator.start()
    process = operator.process
    assert process is not None
    url = f"http://127.0.0.1:{operator.health_port}/readyz"
    figures: dict[str, Any] = {"ready_seconds": None}
    try:
        async with httpx.AsyncClient(timeout=5) as http:
            while time.monotonic() - started < timeout and process.poll() is None:
                try:
                    cpu, status = cpu_seconds(process.pid), proc_status(process.pid)
                    rss, peak = status["VmRSS"], status["VmHWM"]
                except (OSError, KeyError):  # exited between the poll and the read
                    continue
                figures["cpu_seconds"] = round(cpu, 1)
                figures["rss_mib"] = round(mib(rss), 1)
                figures["peak_rss_mib"] = round(mib(peak), 1)
                try:
                    if (await http.get(url)).status_code == 200:
                        figures["ready_seconds"] = round(time.monotonic() - started, 1)
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.2)
        if process.poll() is not None:
            figures["exited"] = process.returncode
            figures["last_error"] = _last_error(operator.log_path)
        return figures
    finally:
        operator.stop()


def _last_error(log_path: Path) -> str:
    lines = [line for line in log_path.read_text().splitlines() if " ERROR " in line]
    return lines[-1][:300] if lines else ""


async def run(args: argparse.Namespace, cluster: LocalCluster, log_dir: Path) -> dict[str, Any]:
    """Fill up to each count; start each operator at each."""
    cluster.kubectl("apply", "--server-side", "-f", str(CRDS_DIR), timeout=120)
    wait_established(cluster.kubectl, "-l", "app.kubernetes.io/part-of=sessionfleet")
    cluster.kubectl("create", "namespace", NAMESPACE)
    kube = Kube(KubeConfig.load(str(cluster.kubeconfig)), user_agent="bench-restart")
    operators: list[tuple[str, Path, tuple[str, ...]]] = [("this tree", SESSIONFLEET, ())]
    if args.stock_kopf:
        operators.append(("this tree, --stock-kopf-start", SESSIONFLEET, ("--stock-kopf-start",)))
    if args.before is not None:
        operators.append((f"before: {args.before_label}", args.before, ()))
    results: dict[str, Any] = {}
    created = 0
    try:
        for count in args.sessions:
            began = time.monotonic()
            await create_sessions(kube, created, count)
            log(f"{count} sessions ({count - created} created in {time.monotonic() - began:.0f} s)")
            created = count
            figures: dict[str, Any] = {}
            for label, binary, extra in operators:
                operator = OperatorProcess(
                    cluster.kubeconfig,
                    NAMESPACE,
                    log_dir,
                    *CHART_ELECTION_ARGS,
                    *extra,
                    binary=binary,
                )
                figures[label] = await start_once(operator, args.timeout)
                log(f"  {label}: {figures[label]}")
            results[str(count)] = figures
            if args.out is not None:
                args.out.with_suffix(".partial.json").write_text(json.dumps(results, indent=2))
    finally:
        await kube.aclose()
    return results


def report(results: dict[str, Any]) -> str:
    """The figures as a Markdown table."""
    lines = [
        "| sessions | start | ready (s) | operator CPU (s) | RSS at ready (MiB) | peak (MiB) |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for count, figures in results.items():
        for mode, f in figures.items():
            lines.append(
                f"| {int(count):,} | {mode} | {_ready(f)} | {f.get('cpu_seconds')} | "
                f"{f.get('rss_mib')} | {f.get('peak_rss_mib')} |"
            )
    return "\n".join(lines)


def _ready(figures: dict[str, Any]) -> str:
    if figures["ready_seconds"] is not None:
        return str(figures["ready_seconds"])
    if "exited" in figures:
        return f"exited ({figures['exited']}) before ready"
    return "not ready in time"


def main(argv: list[str] | None = None) -> int:
    """Start a cluster, run the starts, print and save the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-dir", type=Path, help="state dir of the cluster started here")
    parser.add_argument(
        "--sessions",
        type=lambda text: sorted(int(n) for n in text.split(",")),
        default=[2000, 5000, 10000, 20000],
        help="session counts, comma-separated (ascending: each fills up from the last)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait per start")
    parser.add_argument(
        "--stock-kopf-start", dest="stock_kopf", action="store_true", help="also start it so"
    )
    parser.add_argument(
        "--before", type=Path, help="also start this sessionfleet executable (another checkout's)"
    )
    parser.add_argument("--before-label", default="before", help="its name in the figures")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-restart-"))
    cluster = LocalCluster.start(args.state_dir, gpu_nodes=1)
    try:
        results = asyncio.run(run(args, cluster, log_dir))
    finally:
        cluster.stop()
    publish(results, report(results), f"logs: {log_dir}", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
