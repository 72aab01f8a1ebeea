"""The worker's Pod and PodDisruptionBudget, built from its spec: pure functions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

from sessionfleet._version import __version__
from sessionfleet.api import API_VERSION, CheckpointDriver, EngineType, InferenceWorker
from sessionfleet.api.labels import (
    CA_SAFE_TO_EVICT,
    EPOCH_LABEL,
    KARPENTER_DO_NOT_DISRUPT,
    MANAGED_BY,
    MODEL_LABEL,
    WORKER_LABEL,
)
from sessionfleet.policy.worker import pod_name
from sessionfleet.resources.kvstore import kv_store_args, kv_store_env
from sessionfleet.resources.names import label_value

# vLLM's block hashes (and so the KV store's file names) start from a seed that
# PYTHONHASHSEED sets: the same everywhere, so one worker hits the prefixes another (or
# its own earlier epoch) saved (docs/kvstore.md).
PYTHONHASHSEED = "0"
VLLM_DEV_MODE = "VLLM_SERVER_DEV_MODE"


@dataclass(frozen=True, slots=True)
class EngineImages:
    """Default images when a worker's spec names none."""

    vllm: str = f"ghcr.io/sessionfleet/sessionfleet-vllm:{__version__}"
    """Dockerfile.vllm's image: vLLM with the KV connector the default kvStore loads."""
    sim: str = f"ghcr.io/sessionfleet/sessionfleet:{__version__}"


class OwnerReference(TypedDict):
    """A ``metadata.ownerReferences`` entry.

    A misspelt key is a type error, not a child the garbage collector never deletes.
    """

    apiVersion: str
    kind: str
    name: str
    uid: str
    controller: bool
    blockOwnerDeletion: bool


def owner_reference(worker: InferenceWorker) -> OwnerReference:
    """Return a controller reference to the worker (for garbage collection and drains)."""
    return {
        "apiVersion": API_VERSION,
        "kind": "InferenceWorker",
        "name": worker.metadata.name,
        "uid": worker.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def worker_labels(worker: InferenceWorker) -> dict[str, str]:
    """Return the labels every object of a worker carries."""
    return {
        **MANAGED_BY,
        WORKER_LABEL: worker.metadata.name,
        MODEL_LABEL: label_value(worker.spec.model),
    }


def engine_args(worker: InferenceWorker) -> list[str]:
    """Return the engine's arguments: the operator's, then the user's extra ones."""
    spec = worker.spec
    port = str(spec.engine.port)
    if spec.engine.type is EngineType.SIM:
        args = [
            "sim-engine",
            "--host=$(POD_IP)",
            f"--port={port}",
            f"--model={spec.model}",
            # Usage in every stream, as vLLM's --enable-force-include-usage: the router
            # counts a session's tokens from the final chunk of every turn.
            "--enable-force-include-usage",
        ]
        if spec.capacity.kv_tokens:
            args.append(f"--kv-tokens={spec.capacity.kv_tokens}")
        return [*args, *spec.engine.args]
    return [
        spec.model,
        "--served-model-name",
        spec.model,
        "--host=0.0.0.0",
        f"--port={port}",
        "--enable-prefix-caching",
        # cached_tokens per request, and usage in every stream, are what the router
        # counts hits and recomputation from (docs/background.md, "vLLM interfaces").
        "--enable-prompt-tokens-details",
        "--enable-force-include-usage",
        f"--tensor-parallel-size={max(spec.gpus, 1)}",
        *kv_store_args(worker),
        *spec.engine.args,
    ]


def engine_env(worker: InferenceWorker) -> list[dict[str, str]]:
    """Environment the operator's own features need from a vLLM engine.

    vLLM serves ``/pause`` and ``/resume`` only in its development mode
    (``VLLM_SERVER_DEV_MODE=1``; otherwise they answer 404), and the criu driver pauses
    the engine with ``mode=keep`` before it checkpoints the process. Development mode
    also serves ``/sleep``, ``/reset_prefix_cache`` and ``/collective_rpc``: keep the
    engine port reachable only from the routers and the node agent (docs/checkpoints.md).
    A variable the user sets in ``engine.env`` wins.
    """
    spec = worker.spec
    if (
        spec.engine.type is not EngineType.VLLM
        or spec.checkpoint.driver is not CheckpointDriver.CRIU
    ):
        return []
    if any(e.name == VLLM_DEV_MODE for e in spec.engine.env):
        return []
    return [{"name": VLLM_DEV_MODE, "value": "1"}]


def build_pod(
    worker: InferenceWorker,
    epoch: int,
    images: EngineImages | None = None,
    restore_args: Sequence[str] = (),
) -> dict[str, Any]:
    """Return the worker's pod for ``epoch``, named ``<worker>-<epoch>``.

    ``restore_args`` are the checkpoint driver's arguments that make the engine start
    from a saved state (a recovering epoch).
    """
    images = images or EngineImages()
    spec = worker.spec
    engine = spec.engine
    overlay = spec.template
    is_sim = engine.type is EngineType.SIM
    image = engine.image or (images.sim if is_sim else images.vllm)
    resources: dict[str, dict[str, Any]] = {
        "requests": dict(spec.resources.requests),
        "limits": dict(spec.resources.limits),
    }
    if spec.gpus:
        resources["limits"]["nvidia.com/gpu"] = spec.gpus
        resources["requests"]["nvidia.com/gpu"] = spec.gpus
    env: list[dict[str, Any]] = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "PYTHONHASHSEED", "value": PYTHONHASHSEED},
        *kv_store_env(worker),
        *engine_env(worker),
        *({"name": e.name, "value": e.value} for e in engine.env),
    ]
    volumes: list[dict[str, Any]] = list(overlay.volumes)
    mounts: list[dict[str, Any]] = list(overlay.volume_mounts)
    storage = spec.checkpoint.storage
    if storage.claim_name:
        # Checkpoints written by one epoch are read by the next, maybe on another node:
        # the claim must be ReadWriteMany, mounted at the same path in every pod.
        volumes.append(
            {"name": "checkpoints", "persistentVolumeClaim": {"claimName": storage.claim_name}}
        )
        mounts.append({"name": "checkpoints", "mountPath": storage.path})
    if not is_sim:
        # NCCL and PyTorch workers share tensors through /dev/shm; the runtime's
        # default 64 MiB is too small for tensor parallelism.
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    container: dict[str, Any] = {
        "name": "engine",
        "image": image,
        "args": [*engine_args(worker), *restore_args],
        "env": env,
        "ports": [{"name": "http", "containerPort": engine.port, "protocol": "TCP"}],
        "resources": resources,
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
        "volumeMounts": mounts,
    }
    if is_sim:
        container["command"] = ["sessionfleet"]
        container["securityContext"] = {
            "runAsNonRoot": True,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }
    tolerations = [t.wire() for t in overlay.tolerations]
    if spec.gpus and not any(t.get("key") == "nvidia.com/gpu" for t in tolerations):
        tolerations.append({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"})
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 30,
        "nodeSelector": dict(overlay.node_selector),
        "tolerations": tolerations,
        "volumes": volumes,
        "enableServiceLinks": False,
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
    }
    for key, value in (
        ("affinity", overlay.affinity),
        ("serviceAccountName", overlay.service_account_name),
        ("priorityClassName", overlay.priority_class_name),
        ("runtimeClassName", overlay.runtime_class_name),
    ):
        if value:
            pod_spec[key] = value
    name = worker.metadata.name
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(name, epoch),
            "namespace": worker.metadata.namespace,
            "labels": {**overlay.labels, **worker_labels(worker), EPOCH_LABEL: str(epoch)},
            "annotations": dict(overlay.annotations),
            "ownerReferences": [owner_reference(worker)],
        },
        "spec": pod_spec,
    }


class ObjectMeta(TypedDict):
    """The ``metadata`` the operator writes on a worker's child objects."""

    name: str
    namespace: str
    labels: dict[str, str]
    ownerReferences: list[OwnerReference]


class LabelSelector(TypedDict):
    """A selector by labels alone."""

    matchLabels: dict[str, str]


class PdbSpec(TypedDict):
    """The worker's hold budget: every key is one the disruption controller reads."""

    minAvailable: int
    unhealthyPodEvictionPolicy: str
    selector: LabelSelector


class PodDisruptionBudget(TypedDict):
    """A ``policy/v1`` PodDisruptionBudget as :func:`build_pdb` writes it.

    A misspelt key would be dropped by the API server with at most a warning, leaving
    a budget that holds a broken worker's pod or selects no pod at all: here it is a
    type error.
    """

    apiVersion: str
    kind: str
    metadata: ObjectMeta
    spec: PdbSpec


def build_pdb(worker: InferenceWorker) -> PodDisruptionBudget:
    """Return the PodDisruptionBudget that blocks eviction of the worker's pod.

    ``minAvailable: 1`` over the worker's one pod refuses every voluntary eviction of
    it while healthy (the Eviction API answers 429); ``unhealthyPodEvictionPolicy:
    AlwaysAllow`` still lets a pod that is not Ready go, so a broken worker never
    blocks a node drain. An integer ``minAvailable`` matters: with ``maxUnavailable``
    the disruption controller needs the owner's scale subresource to count expected
    pods, which an InferenceWorker does not have, and the budget never computes.
    """
    name = worker.metadata.name
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {
            "name": name,
            "namespace": worker.metadata.namespace,
            "labels": worker_labels(worker),
            "ownerReferences": [owner_reference(worker)],
        },
        "spec": {
            "minAvailable": 1,
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
            "selector": {"matchLabels": {WORKER_LABEL: name}},
        },
    }


def hold_annotations(karpenter: bool, autoscaler: bool) -> dict[str, str | None]:
    """Return the pod annotations of the hold mechanisms; ``None`` removes one."""
    return {
        KARPENTER_DO_NOT_DISRUPT: "true" if karpenter else None,
        CA_SAFE_TO_EVICT: "false" if autoscaler else None,
    }
