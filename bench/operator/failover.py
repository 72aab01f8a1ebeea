"""Operator failover: from the leader's death to the new leader's first write.

Run from the repository root (after ``make venv`` and ``make e2e-tools``)::

    .venv/bin/python bench/operator/failover.py [--rounds 10] [--out FILE]   # make bench-failover

It starts a real control plane (the e2e harness; or uses ``--kubeconfig``), applies
the CRDs, creates one InferenceWorker running the simulated engine, and runs two
``sessionfleet operator`` processes with ``--leader-elect`` and the chart's lease
settings (15 s lease, 10 s renew deadline, 2 s retry; ``--lease-duration`` etc. to
change them). Then, ``--rounds`` times:

1. find the leader (the replica whose ``/readyz`` says ``role: leader``);
2. stop it — SIGKILL (``--stop kill``, a crash: it cannot release the Lease) or
   SIGTERM (``--stop term``, a rolling update: it releases it) — and at that instant
   create an AgentSession;
3. wait until this process's watch sees the session Bound: the new leader's first
   write that a client can see. The Lease's takeover (its holder changing) is timed
   on the way;
4. start the stopped replica again, as a standby, and wait until it is ready.

Nothing here is pass/fail; the figures are printed and, with ``--out``, written as JSON.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.append(str(REPO))  # appended: the root's operator/ must not hide the stdlib's

from kubernetes import client, watch  # noqa: E402

from e2e.helpers import wait_established, wait_until  # noqa: E402
from e2e.localcluster import LocalCluster, find_tools  # noqa: E402
from e2e.operator import GROUP, VERSION, OperatorProcess, session, sim_worker  # noqa: E402

NAMESPACE = f"bench-failover-{secrets.token_hex(3)}"
CRDS_DIR = REPO / "crds"


def lease_holder(coordination: Any, name: str) -> str:
    lease = coordination.read_namespaced_lease(name, NAMESPACE)
    return str(lease.spec.holder_identity or "")


def wait_bound(api: Any, name: str, timeout: float) -> float:
    """Watch the session until it is Bound; return the monotonic time it was seen so."""
    custom = client.CustomObjectsApi(api)
    stream = watch.Watch()
    deadline = time.monotonic() + timeout
    try:
        for event in stream.stream(
            custom.list_namespaced_custom_object,
            GROUP,
            VERSION,
            NAMESPACE,
            "agentsessions",
            field_selector=f"metadata.name={name}",
            timeout_seconds=int(timeout),
        ):
            if (event["object"].get("status") or {}).get("phase") == "Bound":
                return time.monotonic()
            if time.monotonic() > deadline:
                break
    finally:
        stream.stop()  # type: ignore[no-untyped-call]
    raise TimeoutError(f"session {name} not Bound within {timeout} s")


def run(args: argparse.Namespace) -> dict[str, Any]:
    cluster = (
        LocalCluster.attach(Path(args.kubeconfig))
        if args.kubeconfig
        else LocalCluster.start(gpu_nodes=1)
    )
    logs = Path(tempfile.mkdtemp(prefix="bench-failover-"))
    replicas: list[OperatorProcess] = []
    try:
        cluster.kubectl("apply", "--server-side", "-f", str(CRDS_DIR))
        wait_established(cluster.kubectl)
        cluster.kubectl("create", "namespace", NAMESPACE, check=False)
        api = cluster.api_client()
        core = client.CoreV1Api(api)
        wait_until(
            lambda: core.read_namespaced_service_account("default", NAMESPACE),
            timeout=30,
            what="the namespace's default ServiceAccount",
        )
        custom = client.CustomObjectsApi(api)
        coordination = client.CoordinationV1Api(api)
        custom.create_namespaced_custom_object(
            GROUP, VERSION, NAMESPACE, "inferenceworkers", sim_worker("w")
        )
        election = [
            f"--lease-duration={args.lease_duration}",
            f"--renew-deadline={args.renew_deadline}",
            f"--retry-period={args.retry_period}",
        ]
        for index in range(2):
            (logs / str(index)).mkdir()
            replica = OperatorProcess(cluster.kubeconfig, NAMESPACE, logs / str(index), *election)
            replica.start()
            replicas.append(replica)
        wait_until(
            lambda: sorted(str(r.role()) for r in replicas) == ["leader", "standby"],
            timeout=60,
            what="one leader and one standby",
        )

        def worker_ready() -> bool:
            worker: dict[str, Any] = custom.get_namespaced_custom_object(
                GROUP, VERSION, NAMESPACE, "inferenceworkers", "w"
            )
            return (worker.get("status") or {}).get("phase") == "Ready"

        wait_until(
            worker_ready,
            timeout=60,
            what="worker w Ready",
        )
        rounds = []
        for number in range(args.rounds):
            leader = next(r for r in replicas if r.role() == "leader")
            before = lease_holder(coordination, "sessionfleet-operator")
            name = f"probe-{number}"
            stopped = time.monotonic()
            if args.stop == "kill":
                leader.kill()
            else:
                assert leader.process is not None
                leader.process.terminate()
            custom.create_namespaced_custom_object(
                GROUP, VERSION, NAMESPACE, "agentsessions", session(name)
            )
            taken = wait_until(
                lambda previous=before: (  # type: ignore[misc]
                    time.monotonic()
                    if lease_holder(coordination, "sessionfleet-operator") not in ("", previous)
                    else None
                ),
                timeout=120,
                what="the Lease taken over",
                interval=0.05,
            )
            bound = wait_bound(api, name, timeout=120)
            rounds.append(
                {
                    "leaseTakenSeconds": round(taken - stopped, 2),
                    "firstWriteSeconds": round(bound - stopped, 2),
                }
            )
            print(
                f"round {number + 1}: Lease taken after {taken - stopped:.2f} s, "
                f"first write seen after {bound - stopped:.2f} s",
                flush=True,
            )
            leader.stop()
            leader.start()
            wait_until(
                lambda: sorted(str(r.role()) for r in replicas) == ["leader", "standby"],
                timeout=60,
                what="the restarted replica standing by",
            )
        writes = [r["firstWriteSeconds"] for r in rounds]
        leases = [r["leaseTakenSeconds"] for r in rounds]
        return {
            "stop": args.stop,
            "leaseDuration": args.lease_duration,
            "renewDeadline": args.renew_deadline,
            "retryPeriod": args.retry_period,
            "rounds": rounds,
            "firstWriteP50": round(statistics.median(writes), 2),
            "firstWriteMax": max(writes),
            "leaseTakenP50": round(statistics.median(leases), 2),
            "leaseTakenMax": max(leases),
        }
    finally:
        for replica in replicas:
            replica.stop()
        cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)
        if not args.kubeconfig:
            cluster.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kubeconfig", help="use this cluster instead of starting one")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--stop", choices=("kill", "term"), default="kill")
    parser.add_argument("--lease-duration", default="15s")
    parser.add_argument("--renew-deadline", default="10s")
    parser.add_argument("--retry-period", default="2s")
    parser.add_argument("--out", help="write the figures here as JSON")
    args = parser.parse_args()
    find_tools()
    figures = run(args)
    print(json.dumps({k: v for k, v in figures.items() if k != "rounds"}, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
