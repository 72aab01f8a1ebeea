"""PodDisruptionBudgets hold `kubectl drain` through the Eviction API's 429.

The drain runs against a node of its own, tainted for this test only, so cordoning
and evicting never touch pods of tests running in parallel on the shared cluster.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.helpers import Kubectl, gpu_pod, wait_until
from e2e.localcluster import gpu_node_manifest

pytestmark = pytest.mark.timeout(120)

DEDICATED = "e2e.sessionfleet.dev/dedicated"


@pytest.fixture
def dedicated_node(core: Any, namespace: str) -> Iterator[str]:
    """A fake GPU node that only this test's pods tolerate."""
    name = f"drain-{namespace}"[:63]
    node = gpu_node_manifest(name, 4)
    node["metadata"]["labels"][DEDICATED] = namespace
    node["spec"]["taints"].append({"key": DEDICATED, "value": namespace, "effect": "NoSchedule"})
    core.create_node(node)

    def ready() -> bool:
        conditions = core.read_node(name).status.conditions or []
        return any(c.type == "Ready" and c.status == "True" for c in conditions)

    wait_until(ready, timeout=30, what=f"node {name} Ready")
    yield name
    try:
        core.delete_node(name)
    except ApiException as error:
        if error.status != 404:
            raise


def _held_replica_set(namespace: str, node: str) -> dict[str, Any]:
    """One replica pinned to ``node``: `kubectl drain` only evicts controlled pods."""
    template = gpu_pod("held", labels={"app": "held"})
    template["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
    template["spec"]["tolerations"].append(
        {"key": DEDICATED, "operator": "Equal", "value": namespace, "effect": "NoSchedule"}
    )
    template["spec"]["restartPolicy"] = "Always"
    return {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "metadata": {"name": "held"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "held"}},
            "template": {"metadata": template["metadata"], "spec": template["spec"]},
        },
    }


def test_pdb_blocks_eviction_and_drain_until_it_is_removed(
    api: Any, core: Any, namespace: str, dedicated_node: str, kubectl: Kubectl
) -> None:
    apps: Any = client.AppsV1Api(api)
    policy: Any = client.PolicyV1Api(api)
    apps.create_namespaced_replica_set(namespace, _held_replica_set(namespace, dedicated_node))

    def running_pod() -> str | None:
        pods = core.list_namespaced_pod(namespace, label_selector="app=held").items
        running = [p for p in pods if p.status.phase == "Running"]
        return running[0].metadata.name if running else None

    pod_name = wait_until(running_pod, timeout=30, what="the ReplicaSet's pod Running")

    policy.create_namespaced_pod_disruption_budget(
        namespace,
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": "held"},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "held"}}},
        },
    )

    # Evictions are judged against the budget's status, which the disruption
    # controller fills in; wait until it has seen the pod.
    def budget_observed() -> bool:
        pdb = policy.read_namespaced_pod_disruption_budget("held", namespace)
        status = pdb.status
        return bool(
            status
            and status.observed_generation == pdb.metadata.generation
            and status.current_healthy == 1
            and status.disruptions_allowed == 0
        )

    wait_until(budget_observed, timeout=30, what="PDB held observed by the disruption controller")

    eviction = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": pod_name, "namespace": namespace},
    }
    with pytest.raises(ApiException) as refused:
        core.create_namespaced_pod_eviction(pod_name, namespace, eviction)
    assert refused.value.status == 429

    blocked = kubectl(
        "drain",
        dedicated_node,
        "--ignore-daemonsets",
        "--delete-emptydir-data",
        "--timeout=5s",
        check=False,
        timeout=60,
    )
    assert blocked.returncode != 0, blocked.stdout
    assert "disruption budget" in blocked.stderr + blocked.stdout
    core.read_namespaced_pod(pod_name, namespace)  # still there

    policy.delete_namespaced_pod_disruption_budget("held", namespace)
    drained = kubectl(
        "drain",
        dedicated_node,
        "--ignore-daemonsets",
        "--delete-emptydir-data",
        "--timeout=60s",
        check=False,
        timeout=90,
    )
    assert drained.returncode == 0, drained.stderr
    with pytest.raises(ApiException) as gone:
        core.read_namespaced_pod(pod_name, namespace)
    assert gone.value.status == 404
