"""The operator as a real process against the real control plane.

Each test gets its own namespace, its own operator process serving only that
namespace, and — where it drains or breaks nodes — its own fake GPU nodes, tainted
so that no other test's pods land there. Tests therefore run in parallel on one
shared cluster without seeing each other.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.helpers import Kubectl, wait_until
from e2e.localcluster import (
    LocalCluster,
    container_id_pid,
)
from e2e.operator import (
    Custom,
    OperatorProcess,
    bound_to,
    condition,
    drain_policy,
    on_own_nodes,
    ready_workers,
    session,
    sim_worker,
    wait_for,
    worker_pods,
)

pytestmark = pytest.mark.timeout(240)

WORKER_LABEL = "sessionfleet.dev/worker"


def test_workers_become_ready_and_sessions_bind_balanced(
    operator: OperatorProcess, crs: Custom, core: Any, namespace: str
) -> None:
    for name in ("wa", "wb", "wc"):
        crs.create(sim_worker(name))
    ready_workers(crs, 3, operator)
    for name in ("wa", "wb", "wc"):
        status = crs.status("inferenceworkers", name)
        assert status["epoch"] == 1 and status["pod"] == f"{name}-1"
        assert status["endpoint"].startswith("http://127.")
        (pod,) = worker_pods(core, namespace, name)
        assert pod.spec.node_name.startswith("gpu-node-") or pod.spec.node_name
        assert pod.status.pod_ip.startswith("127.")
        assert condition(status, "Ready")["status"] == "True"

    for i in range(50):
        crs.create(session(f"s{i:02d}"))
    wait_for(
        operator,
        crs.all_in_phase("agentsessions", "Bound", 50),
        timeout=60,
        what="50 Bound sessions",
    )
    per_worker = Counter(bound_to(crs).values())
    assert set(per_worker) == {"wa", "wb", "wc"}
    assert max(per_worker.values()) - min(per_worker.values()) <= 1, per_worker

    # Pinned sessions put up the holds: a PDB per worker, annotations on the pod.
    policy = client.PolicyV1Api(core.api_client)
    wait_until(
        lambda: (
            {p.metadata.name for p in policy.list_namespaced_pod_disruption_budget(namespace).items}
            == {"wa", "wb", "wc"}
        ),
        timeout=15,
        what="a PodDisruptionBudget per worker",
    )
    wait_for(
        operator,
        lambda: (
            worker_pods(core, namespace, "wa")[0].metadata.annotations.get(
                "karpenter.sh/do-not-disrupt"
            )
            == "true"
        ),
        timeout=15,
        what="the do-not-disrupt annotation",
    )
    wait_until(
        lambda: crs.status("inferenceworkers", "wa").get("pinnedSessions") == per_worker["wa"],
        timeout=15,
        what="pinnedSessions in the worker's status",
    )
    assert "sessionfleet_bind_latency_seconds_count 50.0" in operator.metrics()


def test_drain_is_refused_while_sessions_are_pinned_then_completes(
    operator: OperatorProcess,
    crs: Custom,
    core: Any,
    namespace: str,
    own_nodes: list[str],
    kubectl: Kubectl,
) -> None:
    crs.create(drain_policy("hold", mode="Wait", deadline="30m"))
    # Start the worker on the first node, keeping the second free for it afterwards.
    kubectl("cordon", own_nodes[1])
    crs.create(on_own_nodes(sim_worker("w"), namespace))
    ready_workers(crs, 1, operator)
    assert crs.status("inferenceworkers", "w")["node"] == own_nodes[0]
    kubectl("uncordon", own_nodes[1])
    for i in range(3):
        crs.create(session(f"s{i}"))
    wait_until(crs.all_in_phase("agentsessions", "Bound", 3), timeout=30, what="bound sessions")
    wait_until(
        lambda: condition(crs.status("inferenceworkers", "w"), "DrainHeld").get("status") == "True",
        timeout=15,
        what="DrainHeld",
    )

    # The Eviction API refuses, and `kubectl drain` gives up at its timeout.
    with pytest.raises(ApiException) as refused:
        core.create_namespaced_pod_eviction(
            "w-1", namespace, {"metadata": {"name": "w-1", "namespace": namespace}}
        )
    assert refused.value.status == 429
    drain = kubectl("drain", own_nodes[0], "--ignore-daemonsets", "--timeout=4s", check=False)
    assert drain.returncode != 0
    status = crs.status("inferenceworkers", "w")
    assert status["phase"] == "Draining"
    assert condition(status, "Draining")["reason"] == "SessionsPinned"
    assert "DrainPolicy hold" in condition(status, "Draining")["message"]
    assert worker_pods(core, namespace, "w")[0].metadata.deletion_timestamp is None

    # The sessions finish; the hold goes; the drain goes through.
    for i in range(3):
        crs.patch("agentsessions", f"s{i}", {"spec": {"finished": True}})
    wait_until(
        lambda: crs.status("inferenceworkers", "w").get("phase") == "Drained",
        timeout=30,
        what="Drained",
    )
    assert set(crs.phases("agentsessions").values()) == {"Finished"}
    done = kubectl("drain", own_nodes[0], "--ignore-daemonsets", "--timeout=30s", check=False)
    assert done.returncode == 0, done.stderr
    # The worker comes back on the other node, as a new epoch.
    wait_for(
        operator,
        lambda: (
            crs.status("inferenceworkers", "w").get("node") == own_nodes[1]
            and crs.status("inferenceworkers", "w").get("phase") == "Ready"
        ),
        timeout=60,
        what="the worker Ready on the other node",
    )
    assert crs.status("inferenceworkers", "w")["epoch"] == 2


def test_wait_then_migrate_rebinds_at_the_grace_period(
    operator: OperatorProcess,
    crs: Custom,
    core: Any,
    namespace: str,
    own_nodes: list[str],
    kubectl: Kubectl,
) -> None:
    crs.create(drain_policy("grace", mode="WaitThenMigrate", gracePeriod="6s", deadline="5m"))
    crs.create(on_own_nodes(sim_worker("src"), namespace, own_nodes[0]))
    crs.create(on_own_nodes(sim_worker("dst"), namespace, own_nodes[1]))
    ready_workers(crs, 2, operator)
    for i in range(4):
        crs.create(session(f"s{i}", workerPin="src"))
    wait_until(crs.all_in_phase("agentsessions", "Bound", 4), timeout=30, what="bound sessions")
    assert set(bound_to(crs).values()) == {"src"}

    kubectl("cordon", own_nodes[0])
    started = time.monotonic()
    wait_until(
        lambda: crs.status("inferenceworkers", "src").get("phase") == "Draining",
        timeout=15,
        what="Draining",
    )
    time.sleep(3)
    assert set(bound_to(crs).values()) == {"src"}, "nothing moves inside the grace period"
    wait_until(
        lambda: set(bound_to(crs).values()) == {"dst"},
        timeout=30,
        what="sessions rebound to dst",
    )
    assert time.monotonic() - started >= 5.5
    for item in crs.list("agentsessions"):
        (move,) = item["status"]["migrations"]
        assert (move["from"], move["to"], move["reason"]) == ("src", "dst", "Drain")
    wait_for(
        operator,
        lambda: crs.status("inferenceworkers", "src").get("phase") == "Drained",
        timeout=15,
        what="src Drained",
    )
    drain_started = datetime.fromisoformat(
        crs.status("inferenceworkers", "src")["drainStartedAt"].replace("Z", "+00:00")
    )
    first_move = min(
        datetime.fromisoformat(o["status"]["migrations"][0]["at"].replace("Z", "+00:00"))
        for o in crs.list("agentsessions")
    )
    assert (first_move - drain_started).total_seconds() >= 5.5


def test_deleting_a_worker_pod_starts_a_new_epoch_with_sessions_still_bound(
    operator: OperatorProcess, crs: Custom, core: Any, namespace: str
) -> None:
    crs.create(sim_worker("w"))
    ready_workers(crs, 1, operator)
    for i in range(3):
        crs.create(session(f"s{i}"))
    wait_until(crs.all_in_phase("agentsessions", "Bound", 3), timeout=30, what="bound sessions")

    core.delete_namespaced_pod("w-1", namespace, grace_period_seconds=0)
    wait_until(
        lambda: crs.status("inferenceworkers", "w").get("epoch") == 2,
        timeout=30,
        what="epoch 2",
    )
    wait_until(
        lambda: crs.status("inferenceworkers", "w").get("phase") == "Ready",
        timeout=60,
        what="the new epoch Ready",
    )
    status = crs.status("inferenceworkers", "w")
    assert status["pod"] == "w-2"
    assert condition(status, "Recovering")["status"] == "False"
    wait_for(
        operator,
        lambda: all(
            (o.get("status") or {}).get("epoch") == 2 and o["status"]["phase"] == "Bound"
            for o in crs.list("agentsessions")
        ),
        timeout=30,
        what="sessions bound to epoch 2",
    )
    assert set(bound_to(crs).values()) == {"w"}
    assert 'sessionfleet_recoveries_total{reason="PodDeleted"} 1.0' in operator.metrics()


def test_a_failed_engine_process_is_replaced(
    operator: OperatorProcess, crs: Custom, core: Any, namespace: str
) -> None:
    crs.create(sim_worker("w"))
    ready_workers(crs, 1, operator)
    crs.create(session("s0"))
    wait_until(crs.all_in_phase("agentsessions", "Bound", 1), timeout=30, what="bound")
    endpoint = crs.status("inferenceworkers", "w")["endpoint"]
    # The engine answers; then it dies, as a crashed GPU worker would.
    assert httpx.get(f"{endpoint}/health", timeout=5).status_code == 200
    pod = core.api_client.sanitize_for_serialization(worker_pods(core, namespace, "w")[0])
    pid = container_id_pid(pod)
    assert pid is not None, pod["status"]
    os.kill(pid, signal.SIGKILL)
    wait_until(
        lambda: crs.status("inferenceworkers", "w").get("epoch") == 2,
        timeout=30,
        what="a new epoch after the engine died",
    )
    recovering = condition(crs.status("inferenceworkers", "w"), "Recovering")
    assert recovering.get("reason") in ("PodFailed", "NewEpoch", "PodReady")
    wait_for(
        operator,
        lambda: crs.status("inferenceworkers", "w").get("phase") == "Ready",
        timeout=60,
        what="the new epoch Ready",
    )
    assert 'sessionfleet_recoveries_total{reason="PodFailed"} 1.0' in operator.metrics()


def test_operator_restart_mid_drain_loses_nothing(
    operator: OperatorProcess,
    crs: Custom,
    core: Any,
    namespace: str,
    own_nodes: list[str],
    kubectl: Kubectl,
) -> None:
    crs.create(drain_policy("grace", mode="WaitThenMigrate", gracePeriod="8s", deadline="5m"))
    crs.create(on_own_nodes(sim_worker("src"), namespace, own_nodes[0]))
    crs.create(on_own_nodes(sim_worker("dst"), namespace, own_nodes[1]))
    ready_workers(crs, 2, operator)
    for i in range(4):
        crs.create(session(f"s{i}", workerPin="src"))
    wait_until(crs.all_in_phase("agentsessions", "Bound", 4), timeout=30, what="bound sessions")

    kubectl("cordon", own_nodes[0])
    wait_until(
        lambda: crs.status("inferenceworkers", "src").get("drainStartedAt"),
        timeout=15,
        what="the drain's start recorded",
    )
    started_at = crs.status("inferenceworkers", "src")["drainStartedAt"]
    operator.kill()
    time.sleep(2)
    operator.start()

    wait_until(
        lambda: set(bound_to(crs).values()) == {"dst"},
        timeout=40,
        what="sessions migrated after the restart",
    )
    status = crs.status("inferenceworkers", "src")
    assert status["drainStartedAt"] == started_at, "the drain resumed, it did not restart"
    assert len(worker_pods(core, namespace, "src")) == 1
    assert len(worker_pods(core, namespace, "dst")) == 1
    assert crs.status("inferenceworkers", "dst")["epoch"] == 1
    assert all(len(o["status"]["migrations"]) == 1 for o in crs.list("agentsessions"))


def test_sessions_that_cannot_be_placed_say_why(
    operator: OperatorProcess, crs: Custom, namespace: str
) -> None:
    crs.create(sim_worker("w", model="m"))
    ready_workers(crs, 1, operator)
    crs.create(session("no-model", model="other"))
    crs.create(session("bad-pin", workerPin="missing"))
    crs.create(sim_worker("x", drainPolicyRef="nope"))

    def pending(name: str, reason: str) -> bool:
        status = crs.status("agentsessions", name)
        ready = condition(status, "Ready")
        return status.get("phase") == "Pending" and ready.get("reason") == reason

    wait_until(lambda: pending("no-model", "NoReadyWorker"), timeout=30, what="NoReadyWorker")
    wait_until(
        lambda: pending("bad-pin", "PinnedWorkerUnavailable"),
        timeout=30,
        what="PinnedWorkerUnavailable",
    )
    wait_until(
        lambda: (
            condition(crs.status("inferenceworkers", "x"), "Conflict").get("reason")
            == "PolicyNotFound"
        ),
        timeout=30,
        what="PolicyNotFound",
    )
    # A second policy selecting everything conflicts with the first.
    crs.create(drain_policy("a"))
    crs.create(drain_policy("b"))
    wait_until(
        lambda: (
            condition(crs.status("inferenceworkers", "w"), "Conflict").get("reason")
            == "PolicyConflict"
        ),
        timeout=30,
        what="PolicyConflict",
    )
    assert "a, b" in condition(crs.status("inferenceworkers", "w"), "Conflict")["message"]


def test_sessions_of_a_deleted_worker_are_lost(
    operator: OperatorProcess, crs: Custom, namespace: str
) -> None:
    crs.create(sim_worker("w"))
    ready_workers(crs, 1, operator)
    crs.create(session("s0"))
    wait_until(crs.all_in_phase("agentsessions", "Bound", 1), timeout=30, what="bound")
    crs.api.delete_namespaced_custom_object(
        "sessionfleet.dev", "v1alpha1", namespace, "inferenceworkers", "w"
    )
    wait_for(
        operator,
        lambda: (
            condition(crs.status("agentsessions", "s0"), "Ready").get("reason") == "WorkerDeleted"
        ),
        timeout=30,
        what="the session Lost",
    )
    assert crs.status("agentsessions", "s0")["phase"] == "Lost"


def test_a_node_not_ready_beyond_the_toleration_moves_its_worker(
    operator: OperatorProcess,
    crs: Custom,
    core: Any,
    namespace: str,
    own_nodes: list[str],
    kubectl: Kubectl,
) -> None:
    kubectl("cordon", own_nodes[1])
    crs.create(on_own_nodes(sim_worker("w"), namespace))
    ready_workers(crs, 1, operator)
    kubectl("uncordon", own_nodes[1])
    crs.create(session("s0"))
    wait_until(crs.all_in_phase("agentsessions", "Bound", 1), timeout=30, what="bound")

    # KWOK's node-not-ready chaos stage makes the node report NotReady, as a node
    # whose kubelet died would.
    core.patch_node(
        own_nodes[0], {"metadata": {"labels": {"node-not-ready.stage.kwok.x-k8s.io": "true"}}}
    )
    wait_for(
        operator,
        lambda: crs.status("inferenceworkers", "w").get("epoch") == 2,
        timeout=40,
        what="a new epoch after the toleration (5 s)",
    )
    assert "NodeNotReady" in operator.metrics()
    wait_for(
        operator,
        lambda: (
            crs.status("inferenceworkers", "w").get("node") == own_nodes[1]
            and crs.status("inferenceworkers", "w").get("phase") == "Ready"
        ),
        timeout=60,
        what="the worker Ready on the healthy node",
    )
    wait_until(
        lambda: crs.status("agentsessions", "s0").get("epoch") == 2,
        timeout=30,
        what="the session follows the worker to epoch 2",
    )
    assert crs.status("agentsessions", "s0")["worker"] == "w"


def test_liveness_endpoint(operator: OperatorProcess, crs: Custom) -> None:
    crs.create(sim_worker("w"))
    ready_workers(crs, 1, operator)
    response = httpx.get(f"http://127.0.0.1:{operator.health_port}/healthz", timeout=5)
    assert response.status_code == 200


def finished_then_deleted(
    operator: OperatorProcess, crs: Custom, name: str, reason: str
) -> dict[str, Any]:
    """Wait for the session to finish for ``reason``, then to be deleted; its last status."""
    wait_for(
        operator,
        lambda: condition(crs.status("agentsessions", name), "Ready").get("reason") == reason,
        timeout=30,
        what=f"session {name} Finished ({reason})",
    )
    status = crs.status("agentsessions", name)
    assert status["phase"] == "Finished" and status["finishedAt"]
    wait_for(
        operator,
        lambda: not crs.list("agentsessions"),
        timeout=30,
        what=f"the finished session {name} deleted after its TTL",
    )
    return status


def test_idle_sessions_finish_and_expire(
    cluster: LocalCluster, namespace: str, crds_installed: None, crs: Custom, tmp_path: Path
) -> None:
    operator = OperatorProcess(cluster.kubeconfig, namespace, tmp_path, "--idle-timeout=4s")
    operator.start()
    try:
        crs.create(sim_worker("w"))
        ready_workers(crs, 1, operator)
        crs.create(session("idle", ttlSecondsAfterFinished=3))
        wait_until(crs.all_in_phase("agentsessions", "Bound", 1), timeout=30, what="bound")
        finished_then_deleted(operator, crs, "idle", "IdleTimeout")
    finally:
        operator.stop()


def test_lost_sessions_finish_and_are_deleted_after_the_lost_timeout(
    cluster: LocalCluster, namespace: str, crds_installed: None, crs: Custom, tmp_path: Path
) -> None:
    operator = OperatorProcess(cluster.kubeconfig, namespace, tmp_path, "--lost-session-timeout=4s")
    operator.start()
    try:
        crs.create(sim_worker("w"))
        ready_workers(crs, 1, operator)
        crs.create(session("lost", ttlSecondsAfterFinished=3))
        wait_until(crs.all_in_phase("agentsessions", "Bound", 1), timeout=30, what="bound")
        crs.api.delete_namespaced_custom_object(
            "sessionfleet.dev", "v1alpha1", namespace, "inferenceworkers", "w"
        )
        wait_for(
            operator,
            lambda: crs.status("agentsessions", "lost").get("phase") == "Lost",
            timeout=30,
            what="the session Lost",
        )
        status = finished_then_deleted(operator, crs, "lost", "LostExpired")
        assert "ttlSecondsAfterFinished" in condition(status, "Ready")["message"]
    finally:
        operator.stop()
