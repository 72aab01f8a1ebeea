"""The control plane itself: loopback addresses, GPU scheduling onto KWOK nodes."""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest

from e2e.helpers import gpu_pod, wait_until
from e2e.localcluster import GPU_RESOURCE, SERVICE_CLUSTER_IP_RANGE, LocalCluster

pytestmark = pytest.mark.timeout(90)

LOOPBACK = ipaddress.ip_network("127.0.0.0/8")


def test_every_address_of_the_cluster_is_on_loopback(core: Any, cluster: LocalCluster) -> None:
    service = core.read_namespaced_service("kubernetes", "default")
    assert ipaddress.ip_address(service.spec.cluster_ip) in ipaddress.ip_network(
        SERVICE_CLUSTER_IP_RANGE
    )
    assert cluster.api_server.startswith("https://127.0.0.1:")
    for node in core.list_node().items:
        for address in node.status.addresses or []:
            if address.type == "InternalIP":
                assert ipaddress.ip_address(address.address) in LOOPBACK, node.metadata.name


def test_gpu_nodes_are_ready_with_gpu_capacity_and_labels(core: Any) -> None:
    nodes = [n for n in core.list_node().items if n.metadata.name.startswith("gpu-node-")]
    assert len(nodes) >= 1
    for node in nodes:
        assert int(node.status.allocatable[GPU_RESOURCE]) > 0
        assert node.metadata.labels["nvidia.com/gpu.present"] == "true"
        assert node.metadata.labels["nvidia.com/gpu.product"]
        ready = {c.type: c.status for c in node.status.conditions}["Ready"]
        assert ready == "True", node.metadata.name


def test_gpu_pod_is_scheduled_onto_a_kwok_gpu_node_and_runs_with_a_loopback_ip(
    core: Any, namespace: str, cluster: LocalCluster
) -> None:
    core.create_namespaced_pod(namespace, gpu_pod("one-gpu"))

    def running() -> Any:
        pod = core.read_namespaced_pod("one-gpu", namespace)
        return pod if pod.status.phase == "Running" and pod.status.pod_ip else None

    pod = wait_until(running, timeout=30, what="pod one-gpu Running")
    node = core.read_node(pod.spec.node_name)
    assert node.metadata.labels["nvidia.com/gpu.present"] == "true"
    pod_ip = ipaddress.ip_address(pod.status.pod_ip)
    assert pod_ip in LOOPBACK
    if cluster.pod_cidr:
        assert pod_ip in ipaddress.ip_network(cluster.pod_cidr, strict=False)
    assert ipaddress.ip_address(pod.status.host_ip) in LOOPBACK


def test_pod_asking_for_more_gpus_than_any_node_has_stays_pending(
    core: Any, namespace: str
) -> None:
    most = max(int(n.status.allocatable.get(GPU_RESOURCE, 0)) for n in core.list_node().items)
    core.create_namespaced_pod(namespace, gpu_pod("too-many", gpus=most + 1))

    def unschedulable() -> Any:
        pod = core.read_namespaced_pod("too-many", namespace)
        for condition in pod.status.conditions or []:
            if condition.type == "PodScheduled" and condition.reason == "Unschedulable":
                return condition
        return None

    condition = wait_until(unschedulable, timeout=30, what="pod too-many Unschedulable")
    assert GPU_RESOURCE in condition.message
