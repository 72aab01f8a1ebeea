"""Real Karpenter against the operator's drain holds and drains.

Karpenter (its KWOK cloud provider, ``e2e/karpenter.py``) runs as a local process
against the shared cluster and launches the GPU nodes the workers run on; the cluster's
KWOK keeps them Ready and the pod backer runs each worker's simulated engine. Each test
has its own NodePool, tainted so that only its own pods use it, and its own operator.

What is checked is what a user of Karpenter relies on:

- a worker with pinned sessions keeps its node: consolidation that would replace the
  node is blocked by the operator's holds (``karpenter.sh/do-not-disrupt``, the
  PodDisruptionBudget), and Karpenter says so in a ``DisruptionBlocked`` event; once the
  sessions finish, Karpenter consolidates the node;
- the forceful path (a deleted NodeClaim, which is what Karpenter's interruption
  handling and expiry do) taints the node ``karpenter.sh/disrupted``; the operator
  drains the worker under its DrainPolicy while its holds keep the node, and the node
  goes once the drain is done;
- a spot interruption under a spot DrainPolicy: the sessions migrate at once, or, with
  nowhere to go, the hold is released at the deadline;
- Karpenter leaves the nodes it does not own alone.

Karpenter's ``DisruptionBlocked`` events are deduplicated per node for two minutes, so
the tests assert that one exists, never when it came or what it says.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from e2e.helpers import Kubectl, exclusive, wait_until
from e2e.karpenter import (
    DISRUPTED_TAINT,
    GPU_1X,
    GPU_4X,
    GROUP,
    NODEPOOL_LABEL,
    POOL_TAINT,
    VERSION,
    KarpenterProcess,
    NodeWatch,
    clear_namespace,
    delete_pool,
    disrupted,
    filler_pod,
    install,
    node_exists,
    node_pool,
    nodeclaim_of,
    pool_worker,
    wait_gone,
)
from e2e.localcluster import LocalCluster, find_tools, gpu_node_manifest
from e2e.operator import (
    Custom,
    OperatorProcess,
    bound_to,
    condition,
    drain_policy,
    ready_workers,
    session,
    start_router,
    via_router,
    wait_for,
    worker_pods,
)
from sessionfleet.resources.names import session_object_name

# A test may first wait for another pytest worker's Karpenter test to end (one Karpenter
# runs per cluster at a time): up to one such test, about two minutes, on top of its own.
pytestmark = pytest.mark.timeout(420)

KARPENTER_LOCK_WAIT = 240.0


@pytest.fixture
def karpenter(
    cluster: LocalCluster, kubectl: Kubectl, tmp_path: Path
) -> Iterator[KarpenterProcess]:
    """Karpenter running against the cluster for this test only; its log in ``tmp_path``."""
    tools = find_tools()
    with exclusive(cluster.state_dir / "karpenter.lock", timeout=KARPENTER_LOCK_WAIT):
        install(kubectl, tools)
        process = KarpenterProcess(tools, cluster.kubeconfig, tmp_path)
        process.start()
        try:
            yield process
        finally:
            process.stop()


@pytest.fixture
def operator(steady_operator: OperatorProcess) -> OperatorProcess:
    """The chart's Lease timings: these tests run for minutes and test no failover."""
    return steady_operator


@pytest.fixture
def cluster_custom(api: Any) -> Any:
    """``CustomObjectsApi`` for Karpenter's cluster-scoped objects."""
    return client.CustomObjectsApi(api)


def _create_pool(custom: Any, body: dict[str, Any]) -> None:
    custom.create_cluster_custom_object(GROUP, VERSION, "nodepools", body)


@pytest.fixture
def pool(
    karpenter: KarpenterProcess,
    crds_installed: None,
    cluster_custom: Any,
    core: Any,
    namespace: str,
) -> Iterator[str]:
    """A name for the test's NodePool, which the test creates.

    Short: Karpenter's node names add about 40 characters to it, and a node name is also
    its ``kubernetes.io/hostname`` label (63 at most). Afterwards the namespace's workers
    and pods go, then the pool, and the fixture waits until Karpenter has removed its
    nodes, before Karpenter stops.
    """
    pool_name = f"e2e-{secrets.token_hex(3)}"
    yield pool_name
    clear_namespace(core, cluster_custom, namespace)
    try:
        delete_pool(cluster_custom, pool_name)
    except AssertionError as error:
        raise AssertionError(f"{error}\n--- karpenter log ---\n{karpenter.log_tail()}") from None


def running_on(core: Any, namespace: str, pod: str) -> str | None:
    """The node a Running pod is on, else None."""
    body = core.read_namespaced_pod(pod, namespace)
    return body.spec.node_name if body.status.phase == "Running" else None


def blocked_events(core: Any, node: str, claim: str) -> list[Any]:
    """Karpenter's ``DisruptionBlocked`` events on the Node or its NodeClaim."""
    events = core.list_event_for_all_namespaces(field_selector="reason=DisruptionBlocked").items
    return [e for e in events if e.involved_object.name in (node, claim)]


def holds_up(core: Any, namespace: str, worker: str) -> bool:
    """Whether the worker's pod carries do-not-disrupt and its PodDisruptionBudget exists."""
    (pod,) = worker_pods(core, namespace, worker)
    annotated = (pod.metadata.annotations or {}).get("karpenter.sh/do-not-disrupt") == "true"
    budgets = client.PolicyV1Api(core.api_client).list_namespaced_pod_disruption_budget(namespace)
    return annotated and worker in {b.metadata.name for b in budgets.items}


def worker_events(core: Any, namespace: str, worker: str) -> set[str]:
    """The reasons of the operator's Events on a worker."""
    events = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={worker}")
    return {e.reason for e in events.items}


def untouched_static_nodes(core: Any) -> None:
    """The cluster's own GPU nodes carry nothing of Karpenter's."""
    for node in core.list_node(label_selector="type=kwok").items:
        if NODEPOOL_LABEL in (node.metadata.labels or {}):
            continue
        assert not disrupted(node), node.metadata.name
        assert not any(f.startswith("karpenter.sh/") for f in node.metadata.finalizers or ())


def test_karpenter_consolidates_only_the_nodes_it_owns(
    karpenter: KarpenterProcess,
    pool: str,
    cluster_custom: Any,
    core: Any,
    namespace: str,
) -> None:
    _create_pool(cluster_custom, node_pool(pool))
    # A static KWOK node with the pool's taint and nothing on it: were Karpenter to
    # manage it, it would be empty and consolidated like the pool's own node below.
    static = f"static-{pool}"
    manifest = gpu_node_manifest(static, 1)
    manifest["metadata"]["labels"][POOL_TAINT] = pool
    manifest["spec"]["taints"].append({"key": POOL_TAINT, "value": pool, "effect": "NoSchedule"})
    uid = core.create_node(manifest).metadata.uid
    try:
        core.create_namespaced_pod(namespace, filler_pod("filler", pool, 1))
        node = wait_until(
            lambda: running_on(core, namespace, "filler"),
            timeout=60,
            what="the filler pod Running on a node Karpenter launched",
        )
        assert core.read_node(node).metadata.labels[NODEPOOL_LABEL] == pool
        wait_until(
            lambda: nodeclaim_of(cluster_custom, node),
            timeout=30,
            what=f"the NodeClaim of {node}",
        )

        with NodeWatch(core, pool) as nodes:
            core.delete_namespaced_pod("filler", namespace, grace_period_seconds=0)
            wait_gone(
                core, node, timeout=90, what=f"Karpenter consolidating the emptied node {node}"
            )
            seen = nodes.timeline(node)
        assert seen is not None and seen.disrupted_at is not None, "tainted before it went"

        body = core.read_node(static)
        assert body.metadata.uid == uid
        assert not disrupted(body)
        assert not body.metadata.finalizers
        untouched_static_nodes(core)
    finally:
        core.delete_node(static)


def test_pinned_sessions_block_consolidation_until_they_finish(
    karpenter: KarpenterProcess,
    operator: OperatorProcess,
    pool: str,
    cluster_custom: Any,
    crs: Custom,
    core: Any,
    namespace: str,
) -> None:
    _create_pool(cluster_custom, node_pool(pool, instance_types=(GPU_1X, GPU_4X)))
    crs.create(drain_policy("hold", mode="Wait", deadline="30m"))
    # Three GPUs of filler need the four-GPU machine; the worker takes the fourth.
    core.create_namespaced_pod(namespace, filler_pod("filler", pool, 3))
    node = wait_until(
        lambda: running_on(core, namespace, "filler"),
        timeout=60,
        what="the filler pod Running",
    )
    assert core.read_node(node).metadata.labels["node.kubernetes.io/instance-type"] == GPU_4X
    crs.create(pool_worker("w", pool))
    ready_workers(crs, 1, operator)
    assert crs.status("inferenceworkers", "w")["node"] == node
    held_epoch = crs.status("inferenceworkers", "w")["epoch"]
    for i in range(3):
        crs.create(session(f"s{i}"))
    wait_until(crs.all_in_phase("agentsessions", "Bound", 3), timeout=30, what="bound sessions")
    wait_for(operator, lambda: holds_up(core, namespace, "w"), timeout=30, what="the holds")

    with NodeWatch(core, pool) as nodes:
        # One GPU used of four: a one-GPU machine would do, for a quarter of the price.
        core.delete_namespaced_pod("filler", namespace, grace_period_seconds=0)
        deleted = time.monotonic()
        claim = nodeclaim_of(cluster_custom, node)
        assert claim is not None

        # The DisruptionBlocked event that names the hold (the pod, or its budget, both
        # in the test's namespace) can take two minutes: Karpenter first reports a node
        # it launched as "Node isn't initialized", and publishes no other
        # DisruptionBlocked event for the same node within 2 minutes of that one.
        while True:
            seen = nodes.timeline(node)
            assert seen is not None and seen.disrupted_at is None and seen.deleted_at is None, (
                f"{node} disrupted while sessions were pinned\n{karpenter.log_tail()}"
            )
            reported = any(
                namespace in (e.message or "")
                for e in blocked_events(core, node, claim["metadata"]["name"])
            )
            held_for = time.monotonic() - deleted
            # Unheld, such a node is tainted 18-28 s after its last pod change and gone
            # 8 s later (bench/karpenter); 45 s is nine times consolidateAfter.
            if reported and held_for >= 45:
                break
            assert held_for < 180, f"no DisruptionBlocked event naming the hold on {node}"
            time.sleep(1)
        assert crs.status("inferenceworkers", "w")["phase"] == "Ready"
        assert set(bound_to(crs).values()) == {"w"}

        for i in range(3):
            crs.patch("agentsessions", f"s{i}", {"spec": {"finished": True}})
        wait_gone(
            core,
            node,
            timeout=120,
            what=f"Karpenter consolidating {node} once the sessions finished",
        )
        seen = nodes.timeline(node)
        assert seen is not None and seen.disrupted_at is not None

    # Replaced, not just removed: the worker's next epoch runs on the cheaper machine.
    wait_for(
        operator,
        lambda: (
            crs.status("inferenceworkers", "w").get("phase") == "Ready"
            and (crs.status("inferenceworkers", "w").get("epoch") or 0) > held_epoch
        ),
        timeout=90,
        what="the worker Ready again, in a new epoch",
    )
    replacement = crs.status("inferenceworkers", "w")["node"]
    labels = core.read_node(replacement).metadata.labels
    assert (labels[NODEPOOL_LABEL], labels["node.kubernetes.io/instance-type"]) == (pool, GPU_1X)


def _delete_nodeclaim(custom: Any, node: str) -> str:
    """Delete the NodeClaim of ``node``, as Karpenter's interruption handling does."""
    claim = nodeclaim_of(custom, node)
    assert claim is not None, f"no NodeClaim for {node}"
    name = str(claim["metadata"]["name"])
    custom.delete_cluster_custom_object(GROUP, VERSION, "nodeclaims", name)
    return name


def _draining(crs: Custom, worker: str) -> dict[str, Any] | None:
    status = crs.status("inferenceworkers", worker)
    draining = condition(status, "Draining")
    return draining if status.get("phase") == "Draining" and draining else None


def test_the_disrupted_taint_of_a_deleted_nodeclaim_drains_the_worker(
    karpenter: KarpenterProcess,
    operator: OperatorProcess,
    pool: str,
    cluster_custom: Any,
    crs: Custom,
    core: Any,
    namespace: str,
) -> None:
    _create_pool(cluster_custom, node_pool(pool))
    crs.create(drain_policy("karpenter", mode="WaitThenMigrate", gracePeriod="10s", deadline="5m"))
    crs.create(pool_worker("src", pool))
    crs.create(pool_worker("dst", pool))
    ready_workers(crs, 2, operator)
    src_epoch = crs.status("inferenceworkers", "src")["epoch"]
    src_node = crs.status("inferenceworkers", "src")["node"]
    dst_node = crs.status("inferenceworkers", "dst")["node"]
    assert src_node != dst_node  # one GPU per machine
    for i in range(4):
        crs.create(session(f"s{i}", workerPin="src"))
    wait_until(crs.all_in_phase("agentsessions", "Bound", 4), timeout=30, what="bound sessions")
    wait_for(operator, lambda: holds_up(core, namespace, "src"), timeout=30, what="the holds")

    _delete_nodeclaim(cluster_custom, src_node)
    wait_until(
        lambda: disrupted(core.read_node(src_node)),
        timeout=30,
        what=f"Karpenter's {DISRUPTED_TAINT} taint on {src_node}",
    )
    draining = wait_for(operator, lambda: _draining(crs, "src"), timeout=30, what="src Draining")
    assert draining["reason"] == "SessionsPinned"
    assert "triggered by DisruptionTaint under DrainPolicy karpenter" in draining["message"]
    # Inside the grace period the holds keep the node: Karpenter does not evict the pod.
    assert set(bound_to(crs).values()) == {"src"}
    assert worker_pods(core, namespace, "src")[0].metadata.deletion_timestamp is None
    assert node_exists(core, src_node)

    wait_for(
        operator,
        lambda: set(bound_to(crs).values()) == {"dst"},
        timeout=60,
        what="the sessions migrated to dst after the grace period",
    )
    for item in crs.list("agentsessions"):
        (move,) = item["status"]["migrations"]
        assert (move["from"], move["to"], move["reason"]) == ("src", "dst", "Drain")
    wait_gone(core, src_node, timeout=90, what=f"{src_node} gone once the drain was done")
    # src comes back on a node Karpenter launches for its new epoch; dst was never touched.
    wait_for(
        operator,
        lambda: (
            crs.status("inferenceworkers", "src").get("phase") == "Ready"
            and (crs.status("inferenceworkers", "src").get("epoch") or 0) > src_epoch
        ),
        timeout=90,
        what="src Ready again on a new node",
    )
    assert crs.status("inferenceworkers", "src")["node"] not in (src_node, dst_node)
    assert crs.status("inferenceworkers", "dst")["node"] == dst_node
    assert not disrupted(core.read_node(dst_node))


SPOT_DEADLINE_SECONDS = 20
SYSTEM_PROMPT = "You are a coding agent working in a large repository. " * 300


def _spot_policy() -> dict[str, Any]:
    # As examples/drainpolicies/spot.yaml, with a deadline sized to a test.
    return drain_policy(
        "spot",
        mode="Migrate",
        gracePeriod="0s",
        deadline=f"{SPOT_DEADLINE_SECONDS}s",
        onDeadline="Release",
        holds=["PodDisruptionBudget", "KarpenterDoNotDisrupt"],
    )


def test_a_spot_interruption_migrates_the_sessions_at_once(
    karpenter: KarpenterProcess,
    operator: OperatorProcess,
    pool: str,
    cluster: LocalCluster,
    cluster_custom: Any,
    crs: Custom,
    core: Any,
    namespace: str,
    tmp_path: Path,
) -> None:
    _create_pool(cluster_custom, node_pool(pool, capacity_type="spot"))
    crs.create(_spot_policy())
    # The engine's own checkpoint driver, on storage both workers' processes reach.
    checkpoint = {"driver": "engine", "storage": {"path": str(tmp_path / "checkpoints")}}
    crs.create(pool_worker("a", pool, checkpoint=checkpoint))
    crs.create(pool_worker("b", pool, checkpoint=checkpoint))
    ready_workers(crs, 2, operator)
    a_node = crs.status("inferenceworkers", "a")["node"]
    assert core.read_node(a_node).metadata.labels["karpenter.sh/capacity-type"] == "spot"
    url, router = start_router(cluster.kubeconfig, namespace, "r1", tmp_path)
    try:
        # Pre-created where their turns must land, under the names the router derives
        # from their ids: the router routes an id by that object only. Every session has
        # had turns, so the Drain checkpoint has something of each to carry.
        agents = {f"id-agent-{i}": session_object_name(f"id-agent-{i}") for i in range(3)}
        for session_id, name in agents.items():
            body = session(name, workerPin="a")
            body["spec"]["sessionId"] = session_id
            crs.create(body)
        wait_until(crs.all_in_phase("agentsessions", "Bound", 3), timeout=30, what="bound")
        histories = {sid: [{"role": "system", "content": SYSTEM_PROMPT}] for sid in agents}
        for turn in range(2):
            for session_id, history in histories.items():
                answer = via_router(url, session_id, history, f"turn {turn}")
                assert answer.headers["x-sessionfleet-worker"] == "a"
        wait_for(operator, lambda: holds_up(core, namespace, "a"), timeout=30, what="the holds")

        with NodeWatch(core, pool) as nodes:
            interrupted = time.monotonic()
            _delete_nodeclaim(cluster_custom, a_node)
            wait_for(
                operator,
                lambda: set(bound_to(crs).values()) == {"b"},
                timeout=SPOT_DEADLINE_SECONDS,
                what="every session migrated to b before the deadline",
            )
            wait_gone(core, a_node, timeout=60, what=f"the interrupted node {a_node} gone")
            seen = nodes.timeline(a_node)
        assert seen is not None and seen.disrupted_at is not None
        assert seen.disrupted_at >= interrupted
        # Each session's cache went along through the Drain checkpoint: its next turn,
        # on b, is served from cache but for the new message.
        for session_id, name in agents.items():
            (move,) = crs.status("agentsessions", name)["migrations"]
            assert (move["from"], move["to"], move["reason"]) == ("a", "b", "Drain")
            assert move.get("checkpoint") and move.get("recomputedTokens") == 0, (
                move,
                crs.status("agentsessions", name),
                [(c["metadata"]["name"], c.get("status")) for c in crs.list("workercheckpoints")],
            )
            answer = via_router(url, session_id, histories[session_id], "after the interruption")
            assert answer.headers["x-sessionfleet-worker"] == "b"
            usage = answer.json()["usage"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            assert cached >= usage["prompt_tokens"] - 64, usage
    finally:
        router.stop()


def test_a_spot_interruption_with_nowhere_to_migrate_releases_at_the_deadline(
    karpenter: KarpenterProcess,
    operator: OperatorProcess,
    pool: str,
    cluster_custom: Any,
    crs: Custom,
    core: Any,
    namespace: str,
) -> None:
    _create_pool(cluster_custom, node_pool(pool, capacity_type="spot"))
    crs.create(_spot_policy())
    crs.create(pool_worker("only", pool))
    ready_workers(crs, 1, operator)
    before = crs.status("inferenceworkers", "only")
    node = before["node"]
    for i in range(2):
        crs.create(session(f"s{i}"))
    wait_until(crs.all_in_phase("agentsessions", "Bound", 2), timeout=30, what="bound sessions")
    wait_for(operator, lambda: holds_up(core, namespace, "only"), timeout=30, what="the holds")

    with NodeWatch(core, pool) as nodes:
        interrupted = time.monotonic()
        _delete_nodeclaim(cluster_custom, node)
        wait_gone(
            core,
            node,
            timeout=SPOT_DEADLINE_SECONDS + 60,
            what=f"{node} gone after the deadline released the hold",
        )
        seen = nodes.timeline(node)
    assert seen is not None and seen.deleted_at is not None
    # Held for the policy's deadline (less a second of clock granularity), then released.
    assert seen.deleted_at - interrupted >= SPOT_DEADLINE_SECONDS - 1
    wait_until(
        lambda: "DrainDeadlineReached" in worker_events(core, namespace, "only"),
        timeout=15,
        what="the worker's DrainDeadlineReached event",
    )
    # The sessions stay with their worker, which Karpenter gives a new node.
    wait_for(
        operator,
        lambda: (
            crs.status("inferenceworkers", "only").get("phase") == "Ready"
            # A later epoch than the one interrupted (not "2": a first pod can be
            # replaced before the test starts, as one run showed).
            and (crs.status("inferenceworkers", "only").get("epoch") or 0) > before["epoch"]
        ),
        timeout=90,
        what="the worker Ready again on a new node",
    )
    assert set(bound_to(crs).values()) == {"only"}
    assert crs.status("inferenceworkers", "only")["node"] != node
