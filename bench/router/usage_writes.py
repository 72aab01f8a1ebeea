"""What one usage write costs the machine: the router, the API server and etcd.

    .venv/bin/python bench/router/usage_writes.py [--sessions 256] [--rounds 6]

Against the local control plane (e2e/localcluster, started and stopped here): creates
the sessions, then has the router's own :class:`~sessionfleet.fronts.kubesync.Flusher`
write one turn of usage to each of them per round, with the session watch running as
in the router (each write comes back through it). Prints the CPU time per write of this
process (the flusher, the client, the watch's echo), of kube-apiserver and of etcd,
from /proc. CPU time hardly depends on what else the machine runs; the wall time does.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from e2e.helpers import wait_established  # noqa: E402
from e2e.localcluster import LocalCluster  # noqa: E402
from sessionfleet.api import SessionClient  # noqa: E402
from sessionfleet.fronts.bindings import BindingTable  # noqa: E402
from sessionfleet.fronts.identity import Identity  # noqa: E402
from sessionfleet.fronts.kubesync import Flusher, new_session, watch_sessions  # noqa: E402
from sessionfleet.fronts.ledger import Totals, UsageLedger  # noqa: E402
from sessionfleet.fronts.metrics import RouterMetrics  # noqa: E402
from sessionfleet.kube import SESSIONS, Kube  # noqa: E402
from sessionfleet.kube.config import KubeConfig  # noqa: E402

NAMESPACE = "bench-usage"


def cpu_of(command: str) -> float:
    """CPU seconds used so far by every process named ``command`` (other than this one)."""
    total = 0.0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() != command:
                continue
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


async def measure(kubeconfig: Path, sessions: int, rounds: int) -> dict[str, float]:
    """Return the CPU microseconds per write of this process, the API server and etcd."""
    async with Kube(KubeConfig.from_kubeconfig(str(kubeconfig))) as kube:
        table, ledger = BindingTable(), UsageLedger(10.0)
        watch = asyncio.create_task(watch_sessions(kube, NAMESPACE, table, ledger))
        names = []
        for n in range(sessions):
            identity = Identity(f"s{n}", None, SessionClient.HEADER, False, "X-Session-Id")
            body = new_session(
                f"s-{n}", NAMESPACE, identity, "m", worker_hint="w1", owner=None, replica="r0"
            )
            names.append((await kube.create(SESSIONS, body, NAMESPACE))["metadata"]["name"])
        await asyncio.sleep(1)  # the watch has seen them
        flusher = Flusher(
            kube,
            NAMESPACE,
            table,
            ledger,
            RouterMetrics(table),
            replica="r0",
            writes_per_second=1e9,
        )
        before = 0.0, 0.0, 0.0
        for round_ in range(rounds + 1):  # the first round warms the connections up
            if round_ == 1:
                before = time.process_time(), cpu_of("kube-apiserver"), cpu_of("etcd")
            for name in names:
                turn = Totals(turns=1, prompt_tokens=1000, cached_tokens=900, completion_tokens=50)
                ledger.record(name, turn)
            await flusher.flush_all()
        await asyncio.sleep(1.5)  # the last writes' echoes arrive
        watch.cancel()
        writes = sessions * rounds
        after = time.process_time(), cpu_of("kube-apiserver"), cpu_of("etcd")
        places = ("router", "apiserver", "etcd")
        return {
            where: round(1e6 * (end - start) / writes)
            for where, start, end in zip(places, before, after, strict=True)
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=6, help="writes per session")
    args = parser.parse_args()
    cluster = LocalCluster.start()
    try:
        cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
        wait_established(cluster.kubectl, "-l", "app.kubernetes.io/part-of=sessionfleet")
        cluster.kubectl("create", "namespace", NAMESPACE)
        cost = asyncio.run(measure(cluster.kubeconfig, args.sessions, args.rounds))
    finally:
        cluster.stop()
    print(
        f"{args.sessions * args.rounds} usage writes, CPU per write: router {cost['router']} us, "
        f"kube-apiserver {cost['apiserver']} us, etcd {cost['etcd']} us"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
