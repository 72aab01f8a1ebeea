"""Karpenter consolidation and the operator's holds: from the decision to the node gone.

Run from the repository root (after ``make venv`` and ``make e2e-tools``)::

    .venv/bin/python bench/karpenter/run.py [--rounds 3] [--out FILE]   # make bench-karpenter

It starts a real control plane (the e2e harness; or uses ``--kubeconfig``), applies
the CRDs, and runs Karpenter with its KWOK provider (``e2e/karpenter.py``) and one
``sessionfleet operator`` for one namespace, under a DrainPolicy that waits (``Wait``,
30 minutes). Then, ``--rounds`` times, each case on a NodePool of its own
(``consolidateAfter: 5s``; one- and four-GPU machines, the four-GPU one four times
the price):

1. a filler pod of three GPUs makes Karpenter launch a four-GPU node; an
   InferenceWorker of one GPU (the simulated engine) joins it there;
2. ``pinned`` only: three AgentSessions bind to the worker, and the operator puts up
   its holds (PodDisruptionBudget, ``karpenter.sh/do-not-disrupt``);
3. the filler is deleted: one GPU of four in use, so consolidation wants to replace the
   node with a one-GPU machine;
4. ``pinned`` only: once Karpenter marks the NodeClaim ``Consolidatable``, the node is
   held for ``--held`` seconds (asserted untouched), then the sessions finish;
5. the node is timed until it is gone.

Times are taken from a watch of the pool's Nodes (the ``karpenter.sh/disrupted`` taint
and the deletion, as received here) and from Karpenter's log (``disrupting node(s)``,
its decision, with millisecond timestamps on the same clock). The start is the filler's
deletion (``unpinned``) or the sessions' finish (``pinned``).

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
from contextlib import ExitStack
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.append(str(REPO))  # appended: the root's operator/ must not hide the stdlib's

from kubernetes import client  # noqa: E402
from kubernetes.client.exceptions import ApiException  # noqa: E402

from e2e.helpers import wait_established, wait_until  # noqa: E402
from e2e.karpenter import (  # noqa: E402
    GPU_1X,
    GPU_4X,
    GROUP,
    VERSION,
    KarpenterProcess,
    NodeWatch,
    clear_namespace,
    delete_pool,
    exclusive,
    filler_pod,
    install,
    node_pool,
    nodeclaim_of,
    pool_worker,
    wait_gone,
)
from e2e.localcluster import LocalCluster, find_tools  # noqa: E402
from e2e.operator import GROUP as SF_GROUP  # noqa: E402
from e2e.operator import VERSION as SF_VERSION  # noqa: E402
from e2e.operator import OperatorProcess, drain_policy, session  # noqa: E402

NAMESPACE = f"bench-karpenter-{secrets.token_hex(3)}"
CRDS_DIR = REPO / "crds"
SESSIONS = 3


def decided_at(log: Path, node: str, since_wall: float) -> float | None:
    """Wall-clock time of Karpenter's ``disrupting node(s)`` line naming ``node``, if any."""
    for line in log.read_text(errors="replace").splitlines():
        if '"disrupting node(s)"' not in line or node not in line:
            continue
        entry = json.loads(line)
        when = datetime.fromisoformat(entry["time"].replace("Z", "+00:00")).timestamp()
        if when >= since_wall:
            return when
    return None


def nodeclaim_condition(custom: Any, node: str, kind: str) -> str | None:
    claim = nodeclaim_of(custom, node) or {}
    conditions = (claim.get("status") or {}).get("conditions") or []
    return next((c["status"] for c in conditions if c["type"] == kind), None)


def worker_phase(custom: Any, name: str) -> str | None:
    body = custom.get_namespaced_custom_object(
        SF_GROUP, SF_VERSION, NAMESPACE, "inferenceworkers", name
    )
    return (body.get("status") or {}).get("phase")


def holds_up(core: Any, name: str) -> bool:
    pods = core.list_namespaced_pod(NAMESPACE, label_selector=f"sessionfleet.dev/worker={name}")
    budgets = client.PolicyV1Api(core.api_client).list_namespaced_pod_disruption_budget(NAMESPACE)
    annotated = any(
        (p.metadata.annotations or {}).get("karpenter.sh/do-not-disrupt") == "true"
        for p in pods.items
    )
    return annotated and name in {b.metadata.name for b in budgets.items}


def one_case(
    args: argparse.Namespace,
    core: Any,
    custom: Any,
    karpenter: KarpenterProcess,
    pinned: bool,
    number: int,
) -> dict[str, Any]:
    """Lay out one node, let Karpenter consolidate it, and time it."""
    pool = f"bk-{secrets.token_hex(3)}"
    worker = f"w{number}{'p' if pinned else 'u'}"
    custom.create_cluster_custom_object(
        GROUP, VERSION, "nodepools", node_pool(pool, instance_types=(GPU_1X, GPU_4X))
    )
    try:
        core.create_namespaced_pod(NAMESPACE, filler_pod("filler", pool, 3))

        def filler_node() -> str | None:
            pod = core.read_namespaced_pod("filler", NAMESPACE)
            return pod.spec.node_name if pod.status.phase == "Running" else None

        node = wait_until(filler_node, timeout=60, what="the filler pod Running")
        custom.create_namespaced_custom_object(
            SF_GROUP, SF_VERSION, NAMESPACE, "inferenceworkers", pool_worker(worker, pool)
        )
        wait_until(
            lambda: worker_phase(custom, worker) == "Ready", timeout=60, what="the worker Ready"
        )
        names = [f"{worker}-s{i}" for i in range(SESSIONS if pinned else 0)]
        for name in names:
            custom.create_namespaced_custom_object(
                SF_GROUP, SF_VERSION, NAMESPACE, "agentsessions", session(name, workerPin=worker)
            )
        if pinned:
            wait_until(lambda: holds_up(core, worker), timeout=30, what="the holds")

        offset = time.time() - time.monotonic()  # watch times are monotonic
        with NodeWatch(core, pool) as nodes:
            core.delete_namespaced_pod("filler", NAMESPACE, grace_period_seconds=0)
            start = time.monotonic()
            held = 0.0
            if pinned:
                wait_until(
                    lambda: nodeclaim_condition(custom, node, "Consolidatable") == "True",
                    timeout=60,
                    what="the NodeClaim Consolidatable",
                )
                consolidatable = time.monotonic()
                while time.monotonic() - consolidatable < args.held:
                    seen = nodes.timeline(node)
                    if seen is None or seen.disrupted_at is not None or seen.deleted_at:
                        raise AssertionError(f"{node} disrupted while sessions were pinned")
                    time.sleep(0.5)
                held = time.monotonic() - start
                for name in names:
                    custom.patch_namespaced_custom_object(
                        SF_GROUP,
                        SF_VERSION,
                        NAMESPACE,
                        "agentsessions",
                        name,
                        {"spec": {"finished": True}},
                    )
                start = time.monotonic()
            wait_gone(core, node, timeout=180, what=f"{node} consolidated")
            seen = nodes.timeline(node)
        assert seen is not None and seen.deleted_at is not None
        decided_wall = decided_at(karpenter.log_path, node, start + offset - 1)
        decided = decided_wall - offset if decided_wall is not None else None
        figures = {
            "pinned": pinned,
            "heldSeconds": round(held, 1) if pinned else None,
            "decisionSeconds": round(decided - start, 2) if decided is not None else None,
            "taintSeconds": (
                round(seen.disrupted_at - start, 2) if seen.disrupted_at is not None else None
            ),
            "goneSeconds": round(seen.deleted_at - start, 2),
            "decisionToGoneSeconds": (
                round(seen.deleted_at - decided, 2) if decided is not None else None
            ),
            "taintToGoneSeconds": (
                round(seen.deleted_at - seen.disrupted_at, 2)
                if seen.disrupted_at is not None
                else None
            ),
        }
        print(
            f"round {number + 1} {'pinned' if pinned else 'unpinned'}: "
            + ", ".join(f"{k} {v}" for k, v in figures.items() if k != "pinned"),
            flush=True,
        )
        return figures
    finally:
        for name in [f"{worker}-s{i}" for i in range(SESSIONS)]:
            try:
                custom.delete_namespaced_custom_object(
                    SF_GROUP, SF_VERSION, NAMESPACE, "agentsessions", name
                )
            except ApiException as error:
                if error.status != 404:
                    raise
        clear_namespace(core, custom, NAMESPACE)
        delete_pool(custom, pool)


def summary(rounds: list[dict[str, Any]], key: str) -> dict[str, float] | None:
    values = [r[key] for r in rounds if r.get(key) is not None]
    if not values:
        return None
    return {
        "p50": round(statistics.median(values), 2),
        "min": min(values),
        "max": max(values),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    cluster = (
        LocalCluster.attach(Path(args.kubeconfig))
        if args.kubeconfig
        else LocalCluster.start(gpu_nodes=1)
    )
    logs = Path(tempfile.mkdtemp(prefix="bench-karpenter-"))
    tools = find_tools()
    karpenter = KarpenterProcess(tools, cluster.kubeconfig, logs)
    operator = OperatorProcess(cluster.kubeconfig, NAMESPACE, logs)
    # One Karpenter per cluster: e2e/test_karpenter.py takes the same lock.
    with ExitStack() as cleanup:
        cleanup.enter_context(exclusive(cluster.state_dir / "karpenter.lock", timeout=600))
        if not args.kubeconfig:
            cleanup.callback(cluster.stop)  # last: callbacks run in reverse
        cleanup.callback(
            cluster.kubectl, "delete", "namespace", NAMESPACE, "--wait=false", check=False
        )
        return measure(args, cluster, tools, karpenter, operator, logs)


def measure(
    args: argparse.Namespace,
    cluster: LocalCluster,
    tools: Any,
    karpenter: KarpenterProcess,
    operator: OperatorProcess,
    logs: Path,
) -> dict[str, Any]:
    """Set the namespace up, start Karpenter and the operator, and run every round."""
    try:
        cluster.kubectl("apply", "--server-side", "-f", str(CRDS_DIR))
        wait_established(cluster.kubectl)
        install(cluster.kubectl, tools)
        cluster.kubectl("create", "namespace", NAMESPACE, check=False)
        api = cluster.api_client()
        core = client.CoreV1Api(api)
        custom = client.CustomObjectsApi(api)
        wait_until(
            lambda: core.read_namespaced_service_account("default", NAMESPACE),
            timeout=30,
            what="the namespace's default ServiceAccount",
        )
        custom.create_namespaced_custom_object(
            SF_GROUP,
            SF_VERSION,
            NAMESPACE,
            "drainpolicies",
            drain_policy("hold", mode="Wait", deadline="30m"),
        )
        karpenter.start()
        operator.start()
        rounds = []
        for number in range(args.rounds):
            for pinned in (False, True):
                rounds.append(one_case(args, core, custom, karpenter, pinned, number))
        result: dict[str, Any] = {"held": args.held, "rounds": rounds}
        for case, pinned in (("unpinned", False), ("pinned", True)):
            of_case = [r for r in rounds if r["pinned"] is pinned]
            result[case] = {
                key: summary(of_case, key)
                for key in (
                    "decisionSeconds",
                    "taintSeconds",
                    "goneSeconds",
                    "decisionToGoneSeconds",
                    "taintToGoneSeconds",
                )
            }
        print(f"logs in {logs}", flush=True)
        return result
    finally:
        operator.stop()
        karpenter.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kubeconfig", help="use this cluster instead of starting one")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--held",
        type=float,
        default=30.0,
        help="seconds to hold a Consolidatable node before the sessions finish",
    )
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
