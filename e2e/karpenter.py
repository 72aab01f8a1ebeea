"""Karpenter, with its KWOK cloud provider, as a local process against the e2e cluster.

Karpenter provisions Nodes for pending pods (a NodeClaim of a NodePool for each) and
disrupts them again: consolidation, and the forceful path of a deleted NodeClaim, which
is what its spot-interruption handling and expiry do. Its KWOK provider creates each
Node annotated ``kwok.x-k8s.io/node=fake``, which the cluster's KWOK keeps Ready, so a
backed pod on it gets a real process from the pod backer like on any other fake node.

Karpenter is cluster-wide: it watches every pending pod and every NodePool. Two at once
on one cluster would both provision for the same pods, so one runs at a time
(`e2e.helpers.exclusive`, a lock file in the cluster's state directory that every
pytest-xdist worker sees), and each test keeps Karpenter to its own pods with a
NodePool taint that only they tolerate (:func:`pool_placement`). Karpenter only
disrupts Nodes it launched (``spec.providerID`` ``kwok://…``); the cluster's static
GPU nodes have no provider ID.

All traffic stays on loopback: Karpenter talks only to the API server on 127.0.0.1,
and is called only on 127.0.0.1. It listens on every interface for its metrics and
health endpoints (it has no bind-address flag), on free ports.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from kubernetes import watch
from kubernetes.client.exceptions import ApiException

from e2e.helpers import Kubectl, gpu_pod, wait_established, wait_until
from e2e.localcluster import GPU_RESOURCE, Tools
from e2e.operator import GROUP as SESSIONFLEET_GROUP
from e2e.operator import VERSION as SESSIONFLEET_VERSION
from e2e.operator import free_port, sim_worker

GROUP, VERSION = "karpenter.sh", "v1"
KWOK_GROUP, KWOK_VERSION = "karpenter.kwok.sh", "v1alpha1"
NODEPOOL_LABEL = "karpenter.sh/nodepool"
CAPACITY_TYPE_LABEL = "karpenter.sh/capacity-type"
DISRUPTED_TAINT = "karpenter.sh/disrupted"
POOL_TAINT = "e2e.sessionfleet.dev/karpenter"
"""The taint of a test's NodePool (value: the pool): only that test's pods tolerate it."""
NODE_CLASS = "sessionfleet-e2e"
"""The one KWOKNodeClass every test's NodePool refers to (it has no settings to vary)."""

GPU_1X, GPU_4X = "gpu-1x-amd64-linux", "gpu-4x-amd64-linux"
ZONE = "test-zone-a"


def _instance_type(name: str, gpus: int, on_demand_price: float) -> dict[str, Any]:
    # Spot at a discount to on-demand, as in the provider's own types.
    offerings = [
        {
            "Price": price,
            "Available": True,
            "Requirements": [
                {"key": CAPACITY_TYPE_LABEL, "operator": "In", "values": [capacity]},
                {"key": "topology.kubernetes.io/zone", "operator": "In", "values": [ZONE]},
            ],
        }
        for capacity, price in (("on-demand", on_demand_price), ("spot", on_demand_price * 0.4))
    ]
    return {
        "name": name,
        "offerings": offerings,
        "architecture": "amd64",
        "operatingSystems": ["linux"],
        "resources": {
            "cpu": str(4 * gpus),
            "memory": f"{16 * gpus}Gi",
            "pods": "110",
            GPU_RESOURCE: str(gpus),
        },
    }


GPU_INSTANCE_TYPES = (_instance_type(GPU_1X, 1, 1.0), _instance_type(GPU_4X, 4, 4.0))
"""The instance types Karpenter offers here: GPU machines with one and with four GPUs.

The provider's 144 built-in types have no GPUs; these replace them
(``--instance-types-file-path``). The four-GPU machine costs four times as much, so a
four-GPU node left running one single-GPU pod is worth replacing: consolidation."""


def install(kubectl: Kubectl, tools: Tools) -> None:
    """Apply Karpenter's CRDs and the KWOKNodeClass; idempotent."""
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(tools.karpenter_crds_dir))
    wait_established(
        kubectl,
        "nodepools.karpenter.sh",
        "nodeclaims.karpenter.sh",
        "kwoknodeclasses.karpenter.kwok.sh",
    )
    node_class = {
        "apiVersion": f"{KWOK_GROUP}/{KWOK_VERSION}",
        "kind": "KWOKNodeClass",
        "metadata": {"name": NODE_CLASS},
    }
    kubectl("apply", "--server-side", "-f", "-", input=json.dumps(node_class))


class KarpenterProcess:
    """Karpenter's KWOK build, run against one cluster with the admin kubeconfig."""

    def __init__(self, tools: Tools, kubeconfig: Path, log_dir: Path) -> None:
        self.binary = tools.karpenter
        self.kubeconfig = kubeconfig
        self.log_path = log_dir / "karpenter.log"
        self.instance_types_path = log_dir / "karpenter-instance-types.json"
        self.metrics_port = free_port()
        self.health_port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60) -> None:
        """Start Karpenter and wait until its ``/readyz`` answers on 127.0.0.1."""
        self.instance_types_path.write_text(json.dumps(GPU_INSTANCE_TYPES, indent=2))
        argv = [
            str(self.binary),
            # One replica, and a lock keeps it the only one: nothing to elect.
            "--disable-leader-election",
            f"--metrics-port={self.metrics_port}",
            f"--health-probe-port={self.health_port}",
            f"--instance-types-file-path={self.instance_types_path}",
        ]
        # A minimal environment: no proxy variables or cloud credentials leak in.
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", "/"),
            "KUBECONFIG": str(self.kubeconfig),
        }
        with self.log_path.open("ab") as log:
            log.write(f"--- start: {' '.join(argv)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        url = f"http://127.0.0.1:{self.health_port}/readyz"

        def ready() -> bool:
            if self.process is not None and self.process.poll() is not None:
                raise AssertionError(f"karpenter exited:\n{self.log_tail()}")
            try:
                return httpx.get(url, timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            wait_until(ready, timeout=timeout, what=f"karpenter {url}")
        except AssertionError as error:
            self.stop()
            raise AssertionError(f"{error}\n--- karpenter log ---\n{self.log_tail()}") from None

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 15 s; idempotent."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)

    def log_tail(self, lines: int = 40) -> str:
        """The end of Karpenter's log, for failure messages."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def node_pool(
    name: str,
    *,
    instance_types: tuple[str, ...] = (GPU_1X,),
    capacity_type: str = "on-demand",
    consolidate_after: str = "5s",
) -> dict[str, Any]:
    """A NodePool that only its own pods can use, and that consolidates quickly.

    Its nodes carry the taint ``POOL_TAINT=<name>:NoSchedule``, which no other test's
    pod tolerates, so Karpenter never launches a node of this pool for them and they
    never land on one. ``WhenEmptyOrUnderutilized`` with a budget of all nodes lets
    consolidation act on any node ``consolidate_after`` after its last pod change.
    """
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "NodePool",
        "metadata": {"name": name},
        "spec": {
            "template": {
                "spec": {
                    "nodeClassRef": {
                        "group": KWOK_GROUP,
                        "kind": "KWOKNodeClass",
                        "name": NODE_CLASS,
                    },
                    "requirements": [
                        {
                            "key": "node.kubernetes.io/instance-type",
                            "operator": "In",
                            "values": list(instance_types),
                        },
                        {
                            "key": CAPACITY_TYPE_LABEL,
                            "operator": "In",
                            "values": [capacity_type],
                        },
                    ],
                    "taints": [{"key": POOL_TAINT, "value": name, "effect": "NoSchedule"}],
                    "expireAfter": "Never",
                }
            },
            "disruption": {
                "consolidationPolicy": "WhenEmptyOrUnderutilized",
                "consolidateAfter": consolidate_after,
                "budgets": [{"nodes": "100%"}],
            },
        },
    }


def pool_placement(pool: str) -> dict[str, Any]:
    """The node selector and tolerations that put a pod on the NodePool ``pool`` only."""
    return {
        "nodeSelector": {NODEPOOL_LABEL: pool},
        "tolerations": [
            {"key": POOL_TAINT, "operator": "Equal", "value": pool, "effect": "NoSchedule"}
        ],
    }


def pool_worker(name: str, pool: str, **spec: Any) -> dict[str, Any]:
    """A simulated-engine InferenceWorker whose pod only a node of ``pool`` takes."""
    return sim_worker(name, template=pool_placement(pool), **spec)


def filler_pod(name: str, pool: str, gpus: int) -> dict[str, Any]:
    """A plain KWOK pod (no process behind it) taking ``gpus`` GPUs of a node of ``pool``.

    It shapes the node Karpenter launches: three GPUs of filler need the four-GPU
    machine, and once the filler is deleted a single-GPU worker there leaves the node
    underutilized, so consolidation wants to replace it.
    """
    pod = gpu_pod(name, gpus=gpus)
    pod["spec"].update(pool_placement(pool))
    return pod


def node_exists(core: Any, name: str) -> bool:
    """Whether the Node exists (it may be terminating)."""
    try:
        core.read_node(name)
    except ApiException as error:
        if error.status == 404:
            return False
        raise
    return True


def wait_gone(core: Any, node: str, *, timeout: float, what: str) -> None:
    """Wait until the Node ``node`` no longer exists."""
    wait_until(lambda: not node_exists(core, node), timeout=timeout, what=what, interval=0.2)


def nodeclaims(custom: Any, pool: str) -> list[dict[str, Any]]:
    """The NodeClaims of one NodePool."""
    return list(
        custom.list_cluster_custom_object(
            GROUP, VERSION, "nodeclaims", label_selector=f"{NODEPOOL_LABEL}={pool}"
        )["items"]
    )


def nodeclaim_of(custom: Any, node: str) -> dict[str, Any] | None:
    """The NodeClaim whose ``status.nodeName`` is ``node``, if any."""
    claims = custom.list_cluster_custom_object(GROUP, VERSION, "nodeclaims")["items"]
    return next((c for c in claims if (c.get("status") or {}).get("nodeName") == node), None)


def delete_pool(custom: Any, pool: str, *, timeout: float = 120) -> None:
    """Delete a NodePool and wait until Karpenter has terminated its NodeClaims.

    Its nodes must hold no pod that Karpenter waits for: it never evicts a pod annotated
    ``karpenter.sh/do-not-disrupt`` and waits for it until the NodePool's
    ``terminationGracePeriod`` (none here). :func:`clear_namespace` first.
    """
    try:
        custom.delete_cluster_custom_object(GROUP, VERSION, "nodepools", pool)
    except ApiException as error:
        if error.status != 404:
            raise
    wait_until(
        lambda: not nodeclaims(custom, pool),
        timeout=timeout,
        what=f"the NodeClaims of NodePool {pool} terminated",
        interval=0.5,
    )


def clear_namespace(core: Any, custom: Any, namespace: str) -> None:
    """Delete the namespace's InferenceWorkers and pods, holds or not.

    A DELETE bypasses the PodDisruptionBudget and the do-not-disrupt annotation, which
    only govern evictions; without the workers, the operator recreates nothing.
    """
    workers = custom.list_namespaced_custom_object(
        SESSIONFLEET_GROUP, SESSIONFLEET_VERSION, namespace, "inferenceworkers"
    )["items"]
    for worker in workers:
        try:
            custom.delete_namespaced_custom_object(
                SESSIONFLEET_GROUP,
                SESSIONFLEET_VERSION,
                namespace,
                "inferenceworkers",
                worker["metadata"]["name"],
            )
        except ApiException as error:
            if error.status != 404:
                raise
    core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)


def disrupted(node: Any) -> bool:
    """Whether a Node (client model) carries Karpenter's ``karpenter.sh/disrupted`` taint."""
    return any(t.key == DISRUPTED_TAINT for t in node.spec.taints or ())


@dataclass
class NodeTimeline:
    """When a watch first saw one Node, its disruption taint, and its deletion."""

    name: str
    seen_at: float
    disrupted_at: float | None = None
    deleted_at: float | None = None


@dataclass
class NodeWatch:
    """Watches the Nodes of one NodePool in a thread and times what happens to them.

    Karpenter's ``karpenter.sh/disrupted`` taint lives for only a few seconds before an
    unheld node is gone, too short to catch by polling; a watch sees every change. The
    times are ``time.monotonic()`` at receipt.
    """

    core: Any
    pool: str
    nodes: dict[str, NodeTimeline] = field(default_factory=dict)
    error: Exception | None = None
    """The last error of the watch (it reconnects), for failure messages."""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __enter__(self) -> NodeWatch:
        # List first, so that every Node there now is known when this returns; the
        # watch goes on from the list's resourceVersion.
        listed = self.core.list_node(label_selector=f"{NODEPOOL_LABEL}={self.pool}")
        for node in listed.items:
            self._record("ADDED", node)
        self._thread = threading.Thread(
            target=self._run,
            args=(listed.metadata.resource_version,),
            name=f"watch {self.pool}",
            daemon=True,
        )
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def timeline(self, node: str) -> NodeTimeline | None:
        """What the watch saw of ``node`` so far (a copy)."""
        with self._lock:
            seen = self.nodes.get(node)
            return None if seen is None else NodeTimeline(**vars(seen))

    def _record(self, kind: str, node: Any) -> None:
        now = time.monotonic()
        with self._lock:
            seen = self.nodes.setdefault(node.metadata.name, NodeTimeline(node.metadata.name, now))
            if seen.disrupted_at is None and disrupted(node):
                seen.disrupted_at = now
            if kind == "DELETED" and seen.deleted_at is None:
                seen.deleted_at = now

    def _run(self, resource_version: str | None) -> None:
        while not self._stop.is_set():
            stream = watch.Watch()
            try:
                for event in stream.stream(
                    self.core.list_node,
                    label_selector=f"{NODEPOOL_LABEL}={self.pool}",
                    resource_version=resource_version,
                    timeout_seconds=2,  # how often _stop is looked at
                ):
                    node = event["object"]
                    resource_version = node.metadata.resource_version
                    self._record(event["type"], node)
                    if self._stop.is_set():
                        break
            except ApiException as error:
                self.error = error
                if error.status == 410:
                    resource_version = None  # too old: list again (the times stay as seen)
                else:
                    self._stop.wait(0.5)
            except Exception as error:  # a dropped connection: watch again from where it was
                self.error = error
                self._stop.wait(0.5)
            finally:
                stream.stop()
