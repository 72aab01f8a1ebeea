"""One faulty object never stops the fleet: the operator against the real control plane.

Each case breaks one thing — an engine that reports NaN, a pod the API server refuses,
a hold removed by hand, most of the fleet's nodes going NotReady at once — and checks
that the faulty object says what is wrong in its conditions while every other object
keeps being reconciled.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from e2e.localcluster import LocalCluster
from e2e.operator import (
    Custom,
    OperatorProcess,
    condition,
    on_own_nodes,
    ready_workers,
    session,
    sim_worker,
    wait_for,
)

pytestmark = pytest.mark.timeout(240)


def _condition(crs: Custom, kind: str, name: str, type_: str) -> dict[str, Any] | None:
    return condition(crs.status(kind, name), type_) or None


def test_an_engine_reporting_nan_is_marked_and_the_fleet_goes_on(
    operator: OperatorProcess, crs: Custom, namespace: str
) -> None:
    broken = sim_worker("broken")
    broken["spec"]["engine"]["args"] = ["--fault-metrics=nan"]
    crs.create(broken)
    crs.create(sim_worker("healthy"))
    ready_workers(crs, 2, operator)

    def says_nan() -> dict[str, Any] | None:
        found = _condition(crs, "inferenceworkers", "broken", "EngineMetrics")
        return found if found and found["reason"] == "NonFiniteMetrics" else None

    found = wait_for(operator, says_nan, timeout=40, what="EngineMetrics=False on the worker")
    assert found["status"] == "False" and "vllm:kv_cache_usage_perc" in found["message"]
    assert crs.status("inferenceworkers", "broken").get("kvCacheUsagePercent") is None
    # The other worker's figures are read, and sessions keep binding to both.
    wait_for(
        operator,
        lambda: (
            (_condition(crs, "inferenceworkers", "healthy", "EngineMetrics") or {}).get("status")
            == "True"
        ),
        timeout=40,
        what="EngineMetrics=True on the healthy worker",
    )
    for i in range(4):
        crs.create(session(f"s{i}"))
    wait_for(
        operator,
        crs.all_in_phase("agentsessions", "Bound", 4),
        timeout=40,
        what="every session bound",
    )
    for name in ("broken", "healthy"):
        assert (_condition(crs, "inferenceworkers", name, "Reconciled") or {}).get(
            "status"
        ) == "True"


def test_a_pod_the_api_server_refuses_is_reported_on_its_worker(
    operator: OperatorProcess, crs: Custom, core: Any, namespace: str
) -> None:
    refused = sim_worker("refused")
    # Accepted by the CRD (a label map), refused by the API server for a pod (422).
    refused["spec"]["template"]["labels"]["not a label key!"] = "x"
    crs.create(refused)
    crs.create(sim_worker("fine"))

    def refusal() -> dict[str, Any] | None:
        found = _condition(crs, "inferenceworkers", "refused", "Reconciled")
        return found if found and found["status"] == "False" else None

    found = wait_for(operator, refusal, timeout=40, what="Reconciled=False on the worker")
    assert found["reason"] == "ReconcileError"
    assert "not a label key!" in found["message"] or "Invalid" in found["message"]
    # The fault is the worker's own: the other worker comes up and binds sessions.
    wait_for(
        operator,
        lambda: crs.status("inferenceworkers", "fine").get("phase") == "Ready",
        timeout=60,
        what="the other worker Ready",
    )
    crs.create(session("s0"))
    wait_for(
        operator,
        lambda: crs.status("agentsessions", "s0").get("worker") == "fine",
        timeout=30,
        what="the session bound to the healthy worker",
    )
    # ... recovers: its pod deleted, a new epoch comes up ...
    core.delete_namespaced_pod("fine-1", namespace, grace_period_seconds=0)
    wait_for(
        operator,
        lambda: (
            crs.status("inferenceworkers", "fine").get("epoch") == 2
            and crs.status("inferenceworkers", "fine").get("phase") == "Ready"
        ),
        timeout=60,
        what="the healthy worker recovered as epoch 2",
    )
    # ... and drains: held while its session is pinned, Drained once it finishes.
    crs.patch("inferenceworkers", "fine", {"spec": {"drain": True}})
    wait_for(
        operator,
        lambda: crs.status("inferenceworkers", "fine").get("phase") == "Draining",
        timeout=30,
        what="the drain held by the pinned session",
    )
    crs.patch("agentsessions", "s0", {"spec": {"finished": True}})
    wait_for(
        operator,
        lambda: crs.status("inferenceworkers", "fine").get("phase") == "Drained",
        timeout=40,
        what="the drain completed",
    )
    # The faulty worker still says what is wrong, all along.
    assert (_condition(crs, "inferenceworkers", "refused", "Reconciled") or {}).get(
        "status"
    ) == "False"


def test_a_hold_deleted_by_hand_comes_back_while_sessions_are_pinned(
    operator: OperatorProcess, crs: Custom, api: Any, namespace: str
) -> None:
    policy = client.PolicyV1Api(api)
    crs.create(sim_worker("w"))
    ready_workers(crs, 1, operator)
    crs.create(session("s0", workerPin="w"))
    wait_for(
        operator,
        crs.all_in_phase("agentsessions", "Bound", 1),
        timeout=30,
        what="the session bound",
    )

    def pdb_uid() -> str | None:
        items = policy.list_namespaced_pod_disruption_budget(
            namespace, label_selector="sessionfleet.dev/worker=w"
        ).items
        return items[0].metadata.uid if items else None

    first = wait_for(operator, pdb_uid, timeout=30, what="the hold's PodDisruptionBudget")
    policy.delete_namespaced_pod_disruption_budget("w", namespace)
    second = wait_for(
        operator,
        lambda: (uid := pdb_uid()) is not None and uid != first and uid,
        timeout=30,
        what="the PodDisruptionBudget put back",
    )
    assert second != first
    assert condition(crs.status("inferenceworkers", "w"), "DrainHeld")["status"] == "True"


@pytest.fixture
def capped_operator(
    cluster: LocalCluster, namespace: str, crds_installed: None, tmp_path: Path
) -> Any:
    """An operator that moves at most one worker off a NotReady node at a time."""
    process = OperatorProcess(
        cluster.kubeconfig,
        namespace,
        tmp_path,
        "--max-node-recoveries=1",
        "--unhealthy-node-threshold=0.9",
    )
    process.start()
    yield process
    process.stop()


def test_two_of_three_nodes_not_ready_move_at_most_the_configured_workers(
    capped_operator: OperatorProcess,
    crs: Custom,
    core: Any,
    namespace: str,
    three_own_nodes: list[str],
) -> None:
    operator = capped_operator
    for i, node in enumerate(three_own_nodes):
        crs.create(on_own_nodes(sim_worker(f"w{i}"), namespace, node))
    ready_workers(crs, 3, operator)
    # New epochs may run on any of the test's nodes; the NotReady ones are tainted
    # not-ready by the node lifecycle controller, so they land on the healthy one.
    # (A merge patch: null removes the first epochs' pin to one node, or a moved worker's
    # new pod could only go back to its NotReady node and never be Ready.)
    pool = {"e2e.sessionfleet.dev/pool": namespace, "kubernetes.io/hostname": None}
    for i in range(3):
        crs.patch("inferenceworkers", f"w{i}", {"spec": {"template": {"nodeSelector": pool}}})
    for node in three_own_nodes[:2]:
        core.patch_node(
            node, {"metadata": {"labels": {"node-not-ready.stage.kwok.x-k8s.io": "true"}}}
        )

    def moved() -> list[str]:
        return [
            name
            for name in ("w0", "w1")
            if (crs.status("inferenceworkers", name).get("epoch") or 1) > 1
        ]

    def one_moved_one_waits() -> bool:
        waiting = [
            name
            for name in ("w0", "w1")
            if (_condition(crs, "inferenceworkers", name, "Recovering") or {}).get("reason")
            == "RecoveryCapped"
        ]
        return len(moved()) == 1 and len(waiting) == 1

    wait_for(operator, one_moved_one_waits, timeout=60, what="one worker moved, one capped")
    # Never both at once; the second moves once the first is Ready elsewhere.
    wait_for(operator, lambda: len(moved()) == 2, timeout=90, what="the second worker moved")
    assert crs.status("inferenceworkers", "w2").get("epoch") == 1


def test_a_checkpoint_left_running_by_a_dead_operator_fails_and_checkpoints_go_on(
    cluster: LocalCluster, crs: Custom, namespace: str, crds_installed: None, tmp_path: Path
) -> None:
    operator = OperatorProcess(cluster.kubeconfig, namespace, tmp_path, "--checkpoint-timeout=3s")
    operator.start()
    try:
        crs.create(
            sim_worker("w", checkpoint={"driver": "engine", "storage": {"path": str(tmp_path)}})
        )
        ready_workers(crs, 1, operator)
        operator.kill()  # SIGKILL, mid-checkpoint: what it had written stays behind
        crs.create(manual_checkpoint("left"))
        crs.api.patch_namespaced_custom_object_status(
            "sessionfleet.dev",
            "v1alpha1",
            namespace,
            "workercheckpoints",
            "left",
            {"status": {"phase": "Running", "startedAt": iso_now(), "epoch": 1}},
        )
        operator.start()

        def failed() -> dict[str, Any] | None:
            status = crs.status("workercheckpoints", "left")
            return status if status.get("phase") == "Failed" else None

        status = wait_for(operator, failed, timeout=40, what="the abandoned checkpoint Failed")
        assert "no operator finished it" in status["error"]
        # No longer counted as in flight: the next checkpoint runs.
        crs.create(manual_checkpoint("next"))
        wait_for(
            operator,
            lambda: crs.status("workercheckpoints", "next").get("phase") == "Succeeded",
            timeout=40,
            what="the next checkpoint Succeeded",
        )
    finally:
        operator.stop()


def manual_checkpoint(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "sessionfleet.dev/v1alpha1",
        "kind": "WorkerCheckpoint",
        "metadata": {"name": name},
        "spec": {"worker": "w", "reason": "Manual"},
    }


def iso_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def test_checkpoints_users_may_not_ask_for_are_refused_unrun(
    operator: OperatorProcess, crs: Custom, namespace: str, tmp_path: Path
) -> None:
    crs.create(sim_worker("w", checkpoint={"driver": "engine", "storage": {"path": str(tmp_path)}}))
    ready_workers(crs, 1, operator)
    forged = manual_checkpoint("forged")
    forged["spec"]["reason"] = "Periodic"  # the operator's own reason
    crs.create(forged)
    elsewhere = manual_checkpoint("elsewhere")
    elsewhere["spec"]["destination"] = f"{tmp_path}/other-namespace/w/x"
    crs.create(elsewhere)

    def refused(name: str) -> dict[str, Any] | None:
        status = crs.status("workercheckpoints", name)
        return status if status.get("phase") == "Failed" else None

    status = wait_for(operator, lambda: refused("forged"), timeout=30, what="forged refused")
    assert condition(status, "Valid")["reason"] == "ReservedCheckpointReason"
    assert "sizeBytes" not in status and "startedAt" not in status  # never run
    status = wait_for(operator, lambda: refused("elsewhere"), timeout=30, what="refused")
    assert condition(status, "Valid")["reason"] == "DestinationOutsideStorage"
    assert not (tmp_path / "other-namespace").exists()
