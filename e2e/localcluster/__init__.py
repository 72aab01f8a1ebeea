"""A real Kubernetes control plane on loopback, for the e2e suite and the demo.

etcd, kube-apiserver, kube-controller-manager, kube-scheduler and KWOK (fake GPU
nodes) built by ``make e2e-tools``, plus a pod backer that runs real local processes
behind opted-in pods. Use ``LocalCluster.start()`` in code, or from a shell::

    python e2e/localcluster up|down|status|run -- CMD...   # from the repository root
"""

from ._cluster import (
    COMPONENTS,
    DEFAULT_STATE_DIR,
    ENV_KEEP_STATE,
    ENV_KUBECONFIG,
    ClusterError,
    LocalCluster,
    running_cluster,
)
from ._components import BACKED_LABEL, KWOK_CUSTOM_STATUS_ANNOTATION, SERVICE_CLUSTER_IP_RANGE
from ._nodes import GPU_RESOURCE, KWOK_TAINT, gpu_node_manifest, gpu_pod_tolerations
from ._tools import K8S_VERSION, Tools, ToolsMissingError, find_tools
from .backer import container_id_pid

__all__ = [
    "BACKED_LABEL",
    "COMPONENTS",
    "DEFAULT_STATE_DIR",
    "ENV_KEEP_STATE",
    "ENV_KUBECONFIG",
    "GPU_RESOURCE",
    "K8S_VERSION",
    "KWOK_TAINT",
    "KWOK_CUSTOM_STATUS_ANNOTATION",
    "SERVICE_CLUSTER_IP_RANGE",
    "ClusterError",
    "LocalCluster",
    "Tools",
    "ToolsMissingError",
    "container_id_pid",
    "find_tools",
    "gpu_node_manifest",
    "gpu_pod_tolerations",
    "running_cluster",
]
