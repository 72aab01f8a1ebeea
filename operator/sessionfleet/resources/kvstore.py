"""A vLLM worker's KV store, as engine arguments and environment: pure builders.

Every engine of a model in a namespace gets the same store settings (the same root,
the same hash settings through ``PYTHONHASHSEED``), so worker B loads what worker A
saved, and epoch 2 of a worker what epoch 1 saved (docs/kvstore.md).
"""

from __future__ import annotations

import json
from typing import Any, Final

from sessionfleet.api import CheckpointDriver, EngineType, InferenceWorker, KVStoreType
from sessionfleet.engines.kvstore_wire import CONNECTOR_CLASS, CONNECTOR_MODULE, TOKEN_ENV
from sessionfleet.resources.names import label_value

KV_TRANSFER_FLAG: Final = "--kv-transfer-config"
LMCACHE_CONNECTOR: Final = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
OFFLOAD_CPU_BYTES: Final = 10 * 2**30
"""vLLM's OffloadingConnector needs a CPU tier in front of its file-system tier."""


def kv_store_of(worker: InferenceWorker) -> KVStoreType:
    """Return the store the worker's engine uses: none for the simulated engine or driver none."""
    spec = worker.spec
    if spec.engine.type is not EngineType.VLLM or spec.checkpoint.driver is CheckpointDriver.NONE:
        return KVStoreType.NONE
    return spec.checkpoint.kv_store.type


def store_root(worker: InferenceWorker) -> str:
    """Return the directory every engine of the worker's model and namespace shares."""
    base = worker.spec.checkpoint.storage.path.rstrip("/")
    return f"{base}/kv/{worker.metadata.namespace}/{label_value(worker.spec.model)}"


def kv_transfer_config(worker: InferenceWorker) -> dict[str, Any] | None:
    """Return ``--kv-transfer-config`` for the worker's store, or None for no store."""
    store = kv_store_of(worker)
    if store is KVStoreType.SESSIONFLEET:
        return {
            "kv_connector": CONNECTOR_CLASS,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both",
            # A block that fails to load (corrupt, truncated, gone) is computed again,
            # never a failed request.
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "root": store_root(worker),
                "max_bytes": worker.spec.checkpoint.kv_store.max_gib * 2**30,
            },
        }
    if store is KVStoreType.LMCACHE:
        return dict(LMCACHE_CONNECTOR)
    if store is KVStoreType.VLLM_OFFLOADING:
        return {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "TieringOffloadingSpec",
                "cpu_bytes_to_use": OFFLOAD_CPU_BYTES,
                "secondary_tiers": [{"type": "fs", "root_dir": store_root(worker)}],
            },
        }
    return None


def kv_store_args(worker: InferenceWorker) -> list[str]:
    """Return the engine arguments of the store; none when the user passes their own connector."""
    config = kv_transfer_config(worker)
    if config is None or any(a.startswith(KV_TRANSFER_FLAG) for a in worker.spec.engine.args):
        return []
    return [KV_TRANSFER_FLAG, json.dumps(config, separators=(",", ":"), sort_keys=True)]


def kv_store_env(worker: InferenceWorker) -> list[dict[str, Any]]:
    """Return the store's environment: the control token, or LMCache's settings.

    LMCache gets a local CPU tier in front of the shared remote store
    (``storage.remoteUrl``, such as ``redis://lmcache:6379``). A variable the user sets
    in ``engine.env`` wins.
    """
    spec = worker.spec
    mine = {e.name for e in spec.engine.env}
    store = kv_store_of(worker)
    if store is KVStoreType.SESSIONFLEET and TOKEN_ENV not in mine:
        return [{"name": TOKEN_ENV, "value": worker.metadata.uid}]
    url = spec.checkpoint.storage.remote_url
    if store is not KVStoreType.LMCACHE or not url:
        return []
    settings = {
        "LMCACHE_REMOTE_URL": url,
        "LMCACHE_REMOTE_SERDE": "naive",
        "LMCACHE_CHUNK_SIZE": "256",
        "LMCACHE_LOCAL_CPU": "True",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": "20",
    }
    return [{"name": k, "value": v} for k, v in settings.items() if k not in mine]
