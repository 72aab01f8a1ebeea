"""Fake GPU nodes that KWOK keeps Ready and "runs" pods on."""

from __future__ import annotations

from typing import Any

from ._components import HOST, KWOK_NODE_ANNOTATION

GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT = "NVIDIA-H100-80GB-HBM3"

#: The taint every fake node carries; pods that should land on one tolerate it.
KWOK_TAINT = {
    "key": KWOK_NODE_ANNOTATION[0],
    "value": KWOK_NODE_ANNOTATION[1],
    "effect": "NoSchedule",
}


def gpu_node_manifest(name: str, gpus: int, *, product: str = GPU_PRODUCT) -> dict[str, Any]:
    """Return a Node with ``gpus`` ``nvidia.com/gpu`` and the labels GPU operators set.

    The labels are those of NVIDIA's GPU feature discovery, so node selectors written
    for real clusters match. Capacity goes in at create time: the API server keeps a
    Node's status on create (a kubelet registers the same way), and KWOK's
    node-initialize stage keeps what is there.
    """
    capacity = {
        "cpu": "32",
        "memory": "256Gi",
        "ephemeral-storage": "1Ti",
        "pods": "110",
        GPU_RESOURCE: str(gpus),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {
                KWOK_NODE_ANNOTATION[0]: KWOK_NODE_ANNOTATION[1],
                "node.alpha.kubernetes.io/ttl": "0",
            },
            "labels": {
                "type": "kwok",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "node.kubernetes.io/instance-type": "gpu-sim-4x",
                "topology.kubernetes.io/zone": "local-a",
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": product,
                "nvidia.com/gpu.count": str(gpus),
                "nvidia.com/gpu.memory": "81559",
                "nvidia.com/gpu.family": "hopper",
                "nvidia.com/cuda.driver-version.major": "580",
            },
        },
        "spec": {"taints": [KWOK_TAINT]},
        "status": {
            "capacity": capacity,
            "allocatable": dict(capacity),
            "addresses": [
                {"type": "InternalIP", "address": HOST},
                {"type": "Hostname", "address": name},
            ],
        },
    }


def gpu_node_names(count: int) -> list[str]:
    """Names of the fake GPU nodes: ``gpu-node-0`` ... ``gpu-node-{count-1}``."""
    return [f"gpu-node-{index}" for index in range(count)]


def gpu_pod_tolerations() -> list[dict[str, str]]:
    """Tolerations a pod needs to be scheduled onto a fake GPU node."""
    return [{"key": KWOK_TAINT["key"], "operator": "Exists", "effect": "NoSchedule"}]
