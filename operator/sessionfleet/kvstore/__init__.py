"""A session-aware KV block store for vLLM workers (docs/kvstore.md).

Two halves:

* :mod:`sessionfleet.kvstore.store` and :mod:`sessionfleet.kvstore.plan`: the files on
  shared storage (one per KV block, named by vLLM's chained block hash), the sessions'
  manifests, eviction, and the pure decisions of which blocks a step saves or loads.
  They import neither vLLM nor torch, so the operator and the unit tests use them.
* :mod:`sessionfleet.kvstore.connector`: the class vLLM loads through its own connector
  interface (``--kv-transfer-config`` with ``kv_connector_module_path``). It runs only
  inside a vLLM engine and is the only module here that imports vLLM and torch.
"""

from sessionfleet.kvstore.store import (
    BlockStore,
    Manifest,
    StoreError,
    layout_fingerprint,
)

__all__ = ["BlockStore", "Manifest", "StoreError", "layout_fingerprint"]
