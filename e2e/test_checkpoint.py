"""Checkpoints on the real control plane: a session's work survives the worker that did it.

Worker pods are backed by real simulated-engine processes; turns are sent straight to
the engines (with the session header the router forwards), and ``cached_tokens`` in
their answers shows what was saved and restored.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client

from e2e.helpers import Kubectl, namespace_admission_policy, wait_until
from e2e.localcluster import LocalCluster, container_id_pid
from e2e.operator import (
    GROUP,
    VERSION,
    Custom,
    OperatorProcess,
    Process,
    bound_to,
    condition,
    drain_policy,
    on_own_nodes,
    ready_workers,
    session,
    sim_worker,
    start_router,
    via_router,
    wait_for,
    worker_pods,
)
from sessionfleet.api.labels import PROVENANCE_ANNOTATION
from sessionfleet.resources.names import session_object_name

pytestmark = pytest.mark.timeout(240)

SESSION_HEADER = "X-Sessionfleet-Session-Id"
SYSTEM = "You are a coding agent working in a large repository. " * 300


def turn(
    endpoint: str, session_id: str, history: list[dict[str, str]], text: str
) -> dict[str, Any]:
    """One turn of a session, sent straight to an engine; the history grows."""
    history.append({"role": "user", "content": text})
    response = httpx.post(
        f"{endpoint}/v1/chat/completions",
        json={"model": "m", "messages": history, "max_tokens": 16},
        headers={SESSION_HEADER: session_id},
        timeout=30,
    )
    response.raise_for_status()
    answer = response.json()
    history.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
    return answer  # type: ignore[no-any-return]


def cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def kill_engine(core: Any, namespace: str, worker: str) -> None:
    pod = core.api_client.sanitize_for_serialization(worker_pods(core, namespace, worker)[0])
    pid = container_id_pid(pod)
    assert pid is not None, pod["status"]
    os.kill(pid, signal.SIGKILL)


def checkpointed_worker(name: str, storage: Path, **checkpoint: Any) -> dict[str, Any]:
    return sim_worker(
        name, checkpoint={"driver": "engine", "storage": {"path": str(storage)}, **checkpoint}
    )


def test_a_manual_checkpoint_is_restored_by_the_next_epoch(
    operator: OperatorProcess, crs: Custom, core: Any, namespace: str, tmp_path: Path
) -> None:
    crs.create(checkpointed_worker("w", tmp_path))
    ready_workers(crs, 1, operator)
    endpoint = crs.status("inferenceworkers", "w")["endpoint"]
    history = [{"role": "system", "content": SYSTEM}]
    for step in range(3):
        last = turn(endpoint, "sid-1", history, f"step {step}: run the tests")
    prefix = last["usage"]["prompt_tokens"]

    crs.create(
        {
            "apiVersion": "sessionfleet.dev/v1alpha1",
            "kind": "WorkerCheckpoint",
            "metadata": {"name": "by-hand"},
            "spec": {"worker": "w", "reason": "Manual"},
        }
    )
    wait_for(
        operator,
        lambda: crs.status("workercheckpoints", "by-hand").get("phase") == "Succeeded",
        timeout=30,
        what="the manual checkpoint Succeeded",
    )
    saved = crs.status("workercheckpoints", "by-hand")
    assert saved["epoch"] == 1 and saved["sizeBytes"] > 0
    assert saved["location"] == f"{tmp_path}/{namespace}/w/by-hand"
    (captured,) = saved["sessions"]
    assert captured["sessionId"] == "sid-1" and captured["tokens"] >= prefix - 16
    wait_until(
        lambda: crs.status("inferenceworkers", "w").get("lastCheckpoint") == "by-hand",
        timeout=15,
        what="lastCheckpoint",
    )

    kill_engine(core, namespace, "w")
    wait_for(
        operator,
        lambda: (
            crs.status("inferenceworkers", "w").get("epoch") == 2
            and crs.status("inferenceworkers", "w").get("phase") == "Ready"
        ),
        timeout=60,
        what="epoch 2 Ready",
    )
    status = crs.status("inferenceworkers", "w")
    assert status["restoreCount"] == 1
    (pod,) = worker_pods(core, namespace, "w")
    assert f"--import-cache={saved['location']}" in pod.spec.containers[0].args
    # The next turn hits the cache for everything the checkpoint held.
    after = turn(status["endpoint"], "sid-1", history, "continue")
    assert cached(after) >= captured["tokens"] - 16, after["usage"]
    assert "sessionfleet_restores_total 1.0" in operator.metrics()


def test_periodic_checkpoints_skip_idle_workers_and_keep_the_newest(
    operator: OperatorProcess, crs: Custom, tmp_path: Path
) -> None:
    crs.create(checkpointed_worker("w", tmp_path, interval="2s", retention=2))
    ready_workers(crs, 1, operator)
    endpoint = crs.status("inferenceworkers", "w")["endpoint"]
    # An AgentSession bound here, so its activity tells the operator something changed.
    crs.create(session("s0", workerPin="w"))
    wait_until(crs.all_in_phase("agentsessions", "Bound", 1), timeout=30, what="bound")
    assert crs.list("workercheckpoints") == [], "an idle worker is not checkpointed"

    history = [{"role": "system", "content": SYSTEM}]
    for step in range(4):
        turn(endpoint, "id-s0", history, f"step {step}")
        crs.api.patch_namespaced_custom_object_status(
            "sessionfleet.dev",
            "v1alpha1",
            crs.namespace,
            "agentsessions",
            "s0",
            {"status": {"lastActivity": _now()}},
        )
        wait_for(
            operator,
            lambda n=step: (
                sum(
                    1
                    for c in crs.list("workercheckpoints")
                    if (c.get("status") or {}).get("phase") == "Succeeded"
                )
                >= min(n + 1, 2)
            ),
            timeout=30,
            what="a periodic checkpoint after activity",
        )
    names = [c["metadata"]["name"] for c in crs.list("workercheckpoints")]
    assert all("-periodic-e1-" in n for n in names)
    wait_until(lambda: len(crs.list("workercheckpoints")) <= 2, timeout=30, what="retention of 2")


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def test_drain_migrates_a_session_through_a_checkpoint(
    operator: OperatorProcess,
    crs: Custom,
    core: Any,
    namespace: str,
    own_nodes: list[str],
    kubectl: Kubectl,
    tmp_path: Path,
) -> None:
    crs.create(drain_policy("move", mode="Migrate", deadline="5m"))
    crs.create(on_own_nodes(checkpointed_worker("src", tmp_path), namespace, own_nodes[0]))
    crs.create(on_own_nodes(checkpointed_worker("dst", tmp_path), namespace, own_nodes[1]))
    ready_workers(crs, 2, operator)
    crs.create(session("s0", workerPin="src"))
    wait_until(crs.all_in_phase("agentsessions", "Bound", 1), timeout=30, what="bound")
    source = crs.status("inferenceworkers", "src")["endpoint"]
    history = [{"role": "system", "content": SYSTEM}]
    for step in range(20):
        last = turn(source, "id-s0", history, f"turn {step}")
    assert cached(last) > 0.9 * last["usage"]["prompt_tokens"]

    kubectl("cordon", own_nodes[0])
    wait_for(
        operator,
        lambda: bound_to(crs) == {"s0": "dst"},
        timeout=30,
        what="the session moved to dst",
    )
    (move,) = crs.status("agentsessions", "s0")["migrations"]
    assert move["reason"] == "Drain" and move["recomputedTokens"] == 0
    drain_checkpoint = crs.status("workercheckpoints", move["checkpoint"])
    assert drain_checkpoint["phase"] == "Succeeded"
    assert "through checkpoint" in condition(crs.status("agentsessions", "s0"), "Ready")["message"]

    target = crs.status("inferenceworkers", "dst")["endpoint"]
    moved = turn(target, "id-s0", history, "next turn, on the new worker")
    # Nearly the whole prefix comes from the imported blocks, not recomputed.
    assert cached(moved) >= last["usage"]["prompt_tokens"] - 32, moved["usage"]
    wait_until(
        lambda: crs.status("inferenceworkers", "src").get("phase") == "Drained",
        timeout=30,
        what="src Drained",
    )


def test_a_migration_waits_for_every_live_router_to_acknowledge(
    operator: OperatorProcess,
    crs: Custom,
    core: Any,
    namespace: str,
    own_nodes: list[str],
    kubectl: Kubectl,
    tmp_path: Path,
) -> None:
    coordination = client.CoordinationV1Api(core.api_client)
    coordination.create_namespaced_lease(
        namespace,
        {
            "metadata": {"name": "router-r1", "labels": {"sessionfleet.dev/component": "router"}},
            "spec": {
                "holderIdentity": "r1",
                "leaseDurationSeconds": 600,
                "renewTime": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
            },
        },
    )
    crs.create(drain_policy("move", mode="Migrate", deadline="5m"))
    crs.create(on_own_nodes(checkpointed_worker("src", tmp_path), namespace, own_nodes[0]))
    crs.create(on_own_nodes(checkpointed_worker("dst", tmp_path), namespace, own_nodes[1]))
    ready_workers(crs, 2, operator)
    crs.create(session("s0", workerPin="src"))
    wait_until(crs.all_in_phase("agentsessions", "Bound", 1), timeout=30, what="bound")

    kubectl("cordon", own_nodes[0])
    wait_for(
        operator,
        lambda: crs.status("agentsessions", "s0").get("phase") == "Migrating",
        timeout=30,
        what="the session Migrating",
    )
    since = crs.status("agentsessions", "s0")["migratingSince"]
    time.sleep(3)
    assert bound_to(crs) == {"s0": "src"}, "no move before router r1 acknowledges"
    crs.patch(
        "agentsessions",
        "s0",
        {"metadata": {"annotations": {"ack.sessionfleet.dev/r1": since}}},
    )
    wait_for(
        operator,
        lambda: bound_to(crs) == {"s0": "dst"},
        timeout=30,
        what="the session moved after the acknowledgement",
    )
    status = crs.status("agentsessions", "s0")
    assert status["phase"] == "Bound" and "migratingSince" not in status


def test_a_drain_through_two_real_routers_moves_the_session_between_turns(
    operator: OperatorProcess,
    crs: Custom,
    cluster: Any,
    namespace: str,
    own_nodes: list[str],
    kubectl: Kubectl,
    tmp_path: Path,
) -> None:
    crs.create(drain_policy("move", mode="Migrate", deadline="5m"))
    crs.create(on_own_nodes(checkpointed_worker("src", tmp_path), namespace, own_nodes[0]))
    crs.create(on_own_nodes(checkpointed_worker("dst", tmp_path), namespace, own_nodes[1]))
    ready_workers(crs, 2, operator)
    routers: list[Process] = []
    try:
        urls = []
        for i in (1, 2):
            url, router = start_router(cluster.kubeconfig, namespace, f"r{i}", tmp_path)
            routers.append(router)
            urls.append(url)
        # Pre-created where its first turn must land, under the name the routers derive
        # from its id: they route an id by that object only.
        name = session_object_name("id-agent")
        crs.create(session("agent", workerPin="src") | {"metadata": {"name": name}})
        wait_until(crs.all_in_phase("agentsessions", "Bound", 1), timeout=30, what="bound")
        history = [{"role": "system", "content": SYSTEM}]
        for step in range(10):
            last = via_router(urls[step % 2], "id-agent", history, f"turn {step}")
        assert last.headers["x-sessionfleet-worker"] == "src"

        kubectl("cordon", own_nodes[0])
        wait_for(
            operator,
            lambda: bound_to(crs) == {name: "dst"},
            timeout=60,
            what="the session moved once both routers acknowledged",
        )
        acks = crs.get("agentsessions", name)["metadata"].get("annotations", {})
        assert {"ack.sessionfleet.dev/r1", "ack.sessionfleet.dev/r2"} <= set(acks)
        moved = via_router(urls[0], "id-agent", history, "the next turn")
        assert moved.headers["x-sessionfleet-worker"] == "dst"
        usage = moved.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 64
    finally:
        for router in routers:
            router.stop()


def whole_worker_with_a_session(
    crs: Custom,
    namespace: str,
    own_nodes: list[str],
    kubectl: Kubectl,
    storage: Path,
    operator: OperatorProcess,
) -> tuple[list[dict[str, str]], dict[str, Any]]:
    """Worker w Ready on the first own node under a Worker-scope Migrate DrainPolicy, and
    session s0 bound to it after a few turns; return its history and the last answer."""
    crs.create(drain_policy("whole", mode="Migrate", migrationScope="Worker", deadline="5m"))
    kubectl("cordon", own_nodes[1])
    crs.create(on_own_nodes(checkpointed_worker("w", storage), namespace))
    ready_workers(crs, 1, operator)
    assert crs.status("inferenceworkers", "w")["node"] == own_nodes[0]
    kubectl("uncordon", own_nodes[1])
    crs.create(session("s0", workerPin="w"))
    wait_until(crs.all_in_phase("agentsessions", "Bound", 1), timeout=30, what="bound")
    endpoint = crs.status("inferenceworkers", "w")["endpoint"]
    history = [{"role": "system", "content": SYSTEM}]
    for step in range(8):
        last = turn(endpoint, "id-s0", history, f"turn {step}")
    return history, last


def test_migration_scope_worker_moves_the_whole_worker_and_its_sessions_follow(
    operator: OperatorProcess,
    crs: Custom,
    core: Any,
    namespace: str,
    own_nodes: list[str],
    kubectl: Kubectl,
    tmp_path: Path,
) -> None:
    history, last = whole_worker_with_a_session(
        crs, namespace, own_nodes, kubectl, tmp_path, operator
    )

    kubectl("cordon", own_nodes[0])
    wait_for(
        operator,
        lambda: (
            crs.status("inferenceworkers", "w").get("node") == own_nodes[1]
            and crs.status("inferenceworkers", "w").get("phase") == "Ready"
        ),
        timeout=60,
        what="the worker moved to the other node",
    )
    status = crs.status("inferenceworkers", "w")
    assert status["epoch"] == 2 and status["restoreCount"] == 1
    drains = [
        c
        for c in crs.list("workercheckpoints")
        if c["spec"]["reason"] == "Drain" and not c["spec"].get("sessions")
    ]
    assert len(drains) == 1 and drains[0]["status"]["phase"] == "Succeeded"
    wait_until(
        lambda: crs.status("agentsessions", "s0").get("epoch") == 2,
        timeout=30,
        what="the session follows its worker",
    )
    after = turn(status["endpoint"], "id-s0", history, "the next turn")
    assert cached(after) >= last["usage"]["prompt_tokens"] - 32, after["usage"]


def hold_checkpoint_starts(namespace: str) -> list[dict[str, Any]]:
    """A ValidatingAdmissionPolicy refusing every status write of the namespace's checkpoints.

    With it in force, the leader can create a drain's checkpoint but not mark it Running:
    the checkpoint stays not yet started for as long as the test wants, without racing
    the operator to a signal.
    """
    return namespace_admission_policy(
        f"e2e-hold-checkpoints-{secrets.token_hex(3)}",
        namespace,
        {
            "apiGroups": ["sessionfleet.dev"],
            "apiVersions": ["*"],
            "operations": ["UPDATE"],
            "resources": ["workercheckpoints/status"],
        },
        [{"expression": "false", "message": "held by the test"}],
    )


def status_write_refused(crs: Custom, name: str) -> bool:
    try:
        crs.api.patch_namespaced_custom_object_status(
            GROUP, VERSION, crs.namespace, "workercheckpoints", name, {"status": {}}
        )
    except client.ApiException as error:
        return "held by the test" in str(error.body)
    return False


def test_a_drain_checkpoint_survives_a_failover_before_it_starts(
    cluster: LocalCluster,
    crds_installed: None,
    crs: Custom,
    namespace: str,
    own_nodes: list[str],
    kubectl: Kubectl,
    tmp_path: Path,
) -> None:
    """Leader A creates the drain's checkpoint and dies; leader B runs it and the drain ends.

    The checkpoint's signed provenance annotation, not A's memory, tells B that the
    operator created it. A user's checkpoint carrying that annotation is still refused.
    """
    policy, binding = hold_checkpoint_starts(namespace)
    apply = json.dumps({"apiVersion": "v1", "kind": "List", "items": [policy, binding]})
    kubectl("apply", "-f", "-", input=apply)
    replicas = [
        OperatorProcess(cluster.kubeconfig, namespace, tmp_path / name) for name in ("a", "b")
    ]
    try:
        # A checkpoint of no worker, which no operator looks at: a probe of the policy.
        crs.create(
            {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "WorkerCheckpoint",
                "metadata": {"name": "probe"},
                "spec": {"worker": "nobody"},
            }
        )
        wait_until(lambda: status_write_refused(crs, "probe"), timeout=30, what="policy in force")
        leader, standby = replicas
        for replica in replicas:
            replica.log_path.parent.mkdir(parents=True)
        leader.start()
        (tmp_path / "storage").mkdir()
        # Only a leader makes a worker Ready: the first replica leads.
        history, last = whole_worker_with_a_session(
            crs, namespace, own_nodes, kubectl, tmp_path / "storage", leader
        )
        standby.start()
        wait_until(
            lambda: standby.role() == "standby", timeout=30, what="the second replica stands by"
        )

        kubectl("cordon", own_nodes[0])

        def drain_checkpoints() -> list[dict[str, Any]]:
            return [c for c in crs.list("workercheckpoints") if c["spec"]["reason"] == "Drain"]

        (created,) = wait_for(leader, drain_checkpoints, timeout=30, what="A's drain checkpoint")
        # A tried to start it and could not: it is the operator's, signed, and not started.
        assert PROVENANCE_ANNOTATION in created["metadata"]["annotations"]
        assert not created.get("status", {}).get("phase"), created
        leader.kill()
        kubectl("delete", "validatingadmissionpolicybinding", binding["metadata"]["name"])

        wait_for(
            standby,
            lambda: (
                crs.status("inferenceworkers", "w").get("node") == own_nodes[1]
                and crs.status("inferenceworkers", "w").get("phase") == "Ready"
            ),
            timeout=90,
            what="B moved the worker to the other node",
        )
        # B ran A's checkpoint, the same object, and restored the new epoch from it.
        drains = drain_checkpoints()
        assert [c["metadata"]["uid"] for c in drains] == [created["metadata"]["uid"]], [
            (c["metadata"]["name"], c.get("status")) for c in drains
        ]
        ran = drains[0]
        assert ran["status"]["phase"] == "Succeeded", ran["status"]
        status = crs.status("inferenceworkers", "w")
        assert status["epoch"] == 2 and status["restoreCount"] == 1
        wait_until(
            lambda: crs.status("agentsessions", "s0").get("epoch") == 2,
            timeout=30,
            what="the session follows its worker",
        )
        after = turn(status["endpoint"], "id-s0", history, "the next turn")
        assert cached(after) >= last["usage"]["prompt_tokens"] - 32, after["usage"]

        # A user copies the genuine annotation onto a Drain checkpoint of their own.
        crs.create(
            {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "WorkerCheckpoint",
                "metadata": {
                    "name": "copied",
                    "annotations": {
                        PROVENANCE_ANNOTATION: created["metadata"]["annotations"][
                            PROVENANCE_ANNOTATION
                        ]
                    },
                },
                "spec": {"worker": "w", "reason": "Drain"},
            }
        )
        refused = wait_for(
            standby,
            lambda: (
                crs.status("workercheckpoints", "copied").get("phase") == "Failed"
                and crs.status("workercheckpoints", "copied")
            ),
            timeout=30,
            what="the copied checkpoint refused",
        )
        valid = condition(refused, "Valid")
        assert (valid["status"], valid["reason"]) == ("False", "ReservedCheckpointReason")
        assert "does not match" in valid["message"], valid
        assert not refused.get("startedAt") and not refused.get("location"), refused
    finally:
        for replica in replicas:
            replica.stop()
        for kind, body in (
            ("validatingadmissionpolicybinding", binding),
            ("validatingadmissionpolicy", policy),
        ):
            kubectl("delete", kind, body["metadata"]["name"], "--ignore-not-found")
