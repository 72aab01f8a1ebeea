"""The ``kubelet`` driver: the kubelet checkpoint API, through the API server's node proxy.

``POST /api/v1/nodes/{node}/proxy/checkpoint/{namespace}/{pod}/{container}`` asks the
worker's kubelet to have the container runtime checkpoint the engine container (the
``ContainerCheckpoint`` feature, beta and on by default since Kubernetes 1.30; the
runtime must implement the CRI ``CheckpointContainer`` call: CRI-O, containerd 2.x).
The kubelet answers with the archive it wrote on the node, under
``/var/lib/kubelet/checkpoints``.

Costs and limits (docs/checkpoints.md):

- the operator needs ``create`` on ``nodes/proxy``, which reaches the whole kubelet API
  of every node, ``exec`` and ``run`` in any pod included; grant it only where this
  driver is used;
- a kubelet checkpoint restores only by building an OCI image from the archive and
  starting a pod from that image (CRI-O, containerd 2.x): :meth:`KubeletDriver.load`
  refuses, and :meth:`KubeletDriver.restore_args` adds nothing;
- a GPU container checkpoints only where the runtime's CRIU has the CUDA plugin and the
  node meets the ``criu`` driver's requirements (:mod:`sessionfleet.agent.capability`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from sessionfleet.api import CheckpointDriver, EngineType
from sessionfleet.checkpoint.driver import (
    CheckpointOutcome,
    CheckpointTarget,
    DriverError,
    DriverUnavailable,
)
from sessionfleet.kube import Forbidden, Kube, KubeError, NotFound

ENGINE_CONTAINER = "engine"
"""The engine's container name in a worker pod (:mod:`sessionfleet.resources.pods`)."""
CHECKPOINT_DIR = "/var/lib/kubelet/checkpoints"

RBAC_HINT = (
    "grant the operator's ServiceAccount `create` on `nodes/proxy`; beware that "
    "nodes/proxy reaches every kubelet's whole API, exec included (docs/checkpoints.md)"
)
FEATURE_HINT = (
    "the kubelet has no checkpoint endpoint: enable the ContainerCheckpoint feature "
    "gate (on by default since Kubernetes 1.30)"
)
RUNTIME_HINT = (
    "the container runtime cannot checkpoint containers (CRI CheckpointContainer is "
    "unimplemented): use CRI-O or containerd 2.x with CRIU installed"
)
LOAD_REFUSAL = (
    "a kubelet checkpoint restores only by starting a pod from an OCI image built from "
    "the archive (CRI-O, containerd 2.x), not into a running engine"
)


def checkpoint_path(node: str, namespace: str, pod: str, container: str) -> str:
    """Return the node-proxy path of the kubelet's checkpoint endpoint."""
    parts = (quote(part, safe="") for part in (node, namespace, pod, container))
    node_q, namespace_q, pod_q, container_q = parts
    return f"/api/v1/nodes/{node_q}/proxy/checkpoint/{namespace_q}/{pod_q}/{container_q}"


def archive_location(node: str, path: str) -> str:
    """Return where an archive is: ``kubelet://<node><path>``, the file on that node."""
    return f"kubelet://{node}{path}"


def parse_answer(answer: Mapping[str, Any]) -> str:
    """Return the archive path from the kubelet's ``{"items": ["/var/lib/…tar"]}``."""
    items = answer.get("items")
    if not isinstance(items, list) or not items or not all(isinstance(i, str) for i in items):
        raise DriverError(f"the kubelet's checkpoint answer names no archive: {dict(answer)!r}")
    path: str = items[0]
    if not path.startswith("/"):
        raise DriverError(f"the kubelet named a relative archive path {path!r}")
    return path


def classify(error: KubeError, node: str, where: str) -> DriverError:
    """Map an API server or kubelet error to the driver's exception tree.

    - 403: RBAC refuses ``nodes/proxy`` → unavailable, with the RBAC hint;
    - 404 from the API server (a Status naming the node) → the node is gone;
    - 404 from the kubelet naming the pod or container → the target is gone;
    - any other 404 (``404 page not found``) → the kubelet has no checkpoint endpoint;
    - a runtime without ``CheckpointContainer`` (the kubelet's 500 says Unimplemented)
      → unavailable;
    - anything else → a failed checkpoint.
    """
    message = error.message
    if isinstance(error, Forbidden):
        return DriverUnavailable(
            f"forbidden to checkpoint through node {node}: {message}; {RBAC_HINT}"
        )
    if isinstance(error, NotFound):
        details = error.body.get("details") or {}
        if error.body.get("kind") == "Status" and details.get("kind") == "nodes":
            return DriverError(f"node {node} not found: {message}")
        if "does not exist" in message:
            return DriverError(f"kubelet on {node} cannot checkpoint {where}: {message}")
        return DriverUnavailable(f"kubelet on {node}: {FEATURE_HINT} (it answered {message!r})")
    lowered = message.lower()
    if "unimplemented" in lowered or "not implemented" in lowered or "unknown method" in lowered:
        return DriverUnavailable(f"kubelet on {node}: {RUNTIME_HINT} ({message})")
    return DriverError(f"kubelet checkpoint of {where} on {node} failed: {error}")


class KubeletDriver:
    """Checkpoints the engine container through the kubelet, where the runtime can.

    ``kube`` should be a client whose timeout exceeds ``timeout``: a checkpoint holds
    the request open while the runtime dumps the container, memory included.
    """

    name = CheckpointDriver.KUBELET

    def __init__(
        self, kube: Kube, *, container: str = ENGINE_CONTAINER, timeout: int = 600
    ) -> None:
        self.kube = kube
        self.container = container
        self.timeout = timeout

    async def save(self, target: CheckpointTarget) -> CheckpointOutcome:
        """Checkpoint the worker's engine container; the archive stays on its node."""
        if target.sessions:
            raise DriverUnavailable(
                "the kubelet driver checkpoints a whole container, not single sessions: "
                "per-session migration needs the engine driver"
            )
        if not target.node or not target.pod:
            raise DriverError(f"worker {target.worker} has no scheduled pod to checkpoint")
        where = f"{target.namespace}/{target.pod}/{self.container}"
        started = time.monotonic()
        try:
            answer = await self.kube.request(
                "POST",
                checkpoint_path(target.node, target.namespace, target.pod, self.container),
                params={"timeout": self.timeout},
            )
        except KubeError as error:
            raise classify(error, target.node, where) from error
        path = parse_answer(answer)
        return CheckpointOutcome(
            location=archive_location(target.node, path), seconds=time.monotonic() - started
        )

    async def load(self, target: CheckpointTarget) -> CheckpointOutcome:
        """Refuse: see :data:`LOAD_REFUSAL`."""
        raise DriverUnavailable(LOAD_REFUSAL)

    def restore_args(self, engine: EngineType, location: str) -> list[str]:
        """Nothing: the restored container brings its own process."""
        return []


__all__ = [
    "CHECKPOINT_DIR",
    "ENGINE_CONTAINER",
    "LOAD_REFUSAL",
    "KubeletDriver",
    "archive_location",
    "checkpoint_path",
    "classify",
    "parse_answer",
]
