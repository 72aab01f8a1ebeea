"""The KV connector vLLM loads: prefix blocks saved to and loaded from the block store.

Loaded by vLLM itself, with no fork and no patch::

    --kv-transfer-config '{"kv_connector": "SessionfleetKVConnector",
      "kv_connector_module_path": "sessionfleet.kvstore.connector",
      "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"root": "/checkpoints/kv/<ns>/<model>"}}'

The pod builder writes that for every vLLM worker whose ``checkpoint.kvStore`` is
``Sessionfleet`` (the default). Only this module imports vLLM and torch; it runs in the
engine's processes, and the operator never imports it.

Scheduler side (the engine core): for each new request, how many blocks after those
in vLLM's own prefix cache the store holds, by chained block hash; each step, which
blocks to load and which newly complete blocks to save; at a request's end, the
session's manifest (its latest chain) and the answers to the operator's control
requests (``kv_transfer_params: {"sessionfleet": {...}}``: ``report`` and ``forget``).
A housekeeping thread checks the storage, evicts the least recently used blocks above
``max_bytes`` and runs the forgets.

Worker side (the model runner): loads copy whole blocks from files into the paged KV
cache before the forward pass; saves copy the step's completed blocks out after it and
hand them to a writer thread through a bounded queue (full: the blocks are dropped and
counted, the engine never waits for the disk). A block that fails to load is reported
to vLLM (``get_block_ids_with_load_errors``), which recomputes it.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.logger import init_logger

from sessionfleet.engines.kvstore_wire import CONTROL_KEY, TOKEN_ENV
from sessionfleet.kvstore.plan import RequestBlocks, loadable_blocks, session_tag
from sessionfleet.kvstore.store import (
    BlockStore,
    Manifest,
    StoreError,
    describe,
    layout_fingerprint,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = init_logger(__name__)

WRITE_QUEUE_BATCHES = 256
"""Steps' worth of blocks waiting for the writer before new ones are dropped."""
RECENTLY_STORED = 200_000
"""Hashes remembered as stored, so a block is not stat()ed at every step."""
HOUSEKEEPING_SECONDS = 30.0


def _hex(block_hash: Any) -> str:
    return bytes(block_hash).hex()


def _layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> dict[str, Any]:
    """Describe what makes two engines' blocks interchangeable: model, KV format, hashing, rank."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
    from vllm.v1.core.kv_cache_utils import get_none_hash_seed

    model = vllm_config.model_config
    cache = vllm_config.cache_config
    groups = []
    for group in kv_cache_config.kv_cache_groups if kv_cache_config is not None else []:
        spec = group.kv_cache_spec
        groups.append(
            [
                type(spec).__name__,
                getattr(spec, "block_size", None),
                getattr(spec, "num_kv_heads", None),
                getattr(spec, "head_size", None),
                str(getattr(spec, "dtype", "")),
                list(group.layer_names),
            ]
        )
    parallel = vllm_config.parallel_config
    try:
        rank = get_tensor_model_parallel_rank() if parallel.tensor_parallel_size > 1 else 0
    except Exception:  # the scheduler process has no model-parallel group
        rank = 0
    return {
        "format": 1,
        "model": model.served_model_name,
        "architectures": list(getattr(model.hf_config, "architectures", None) or []),
        "dtype": str(model.dtype),
        "cache_dtype": str(cache.cache_dtype),
        "block_size": cache.block_size,
        "groups": groups,
        "hash": cache.prefix_caching_hash_algo,
        "none_hash_seed": get_none_hash_seed(),
        "tensor_parallel": parallel.tensor_parallel_size,
        "rank": rank,
    }


@dataclass
class SessionfleetMetadata(KVConnectorMetadata):
    """One step's work for the worker side."""

    loads: list[tuple[str, list[int], list[str]]] = field(default_factory=list)
    """(request id, block ids, block hashes) to fill from the store before the forward."""
    saves: list[tuple[int, str]] = field(default_factory=list)
    """(block id, block hash) completed by this step, to save after it."""


_COUNTERS = (
    "blocks_saved",
    "bytes_saved",
    "save_seconds",
    "blocks_dropped",
    "save_errors",
    "blocks_loaded",
    "bytes_loaded",
    "load_seconds",
    "load_misses",
)


@dataclass
class SessionfleetStats(KVConnectorStats):
    """The worker side's counters since the last report (vLLM sums the workers')."""

    def __post_init__(self) -> None:
        self.data: dict[str, float]
        for name in _COUNTERS:
            self.data.setdefault(name, 0)

    def reset(self) -> None:
        """Zero every counter."""
        self.data = {name: 0 for name in _COUNTERS}

    def aggregate(self, other: KVConnectorStats) -> SessionfleetStats:
        """Add another worker's or interval's counters."""
        for name in _COUNTERS:
            self.data[name] = self.data.get(name, 0) + other.data.get(name, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        """Return the counters, for vLLM's periodic log line."""
        return {name: round(self.data.get(name, 0), 3) for name in _COUNTERS}

    def is_empty(self) -> bool:
        """Whether nothing happened in the interval."""
        return not any(self.data.get(name) for name in _COUNTERS)


class SessionfleetPromMetrics(KVConnectorPromMetrics):
    """``sessionfleet:kvstore_*`` counters on vLLM's own /metrics."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        documentation = {
            "blocks_saved": "KV blocks written to the store.",
            "bytes_saved": "Bytes of KV blocks written to the store.",
            "save_seconds": "Seconds the writer spent writing blocks.",
            "blocks_dropped": "Completed KV blocks not saved: the writer's queue was full.",
            "save_errors": "KV blocks the storage refused (full, read-only, missing).",
            "blocks_loaded": "KV blocks loaded from the store into the engine.",
            "bytes_loaded": "Bytes of KV blocks loaded from the store.",
            "load_seconds": "Seconds spent loading blocks from the store.",
            "load_misses": "Blocks the scheduler expected that could not be loaded "
            "(corrupt, truncated, foreign or gone): recomputed.",
        }
        self._counters = {}
        for name, text in documentation.items():
            counter = self._counter_cls(
                name=f"sessionfleet:kvstore_{name}", documentation=text, labelnames=labelnames
            )
            self._counters[name] = {
                engine: counter.labels(*values) for engine, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one interval's counters."""
        for name, per_engine in self._counters.items():
            value = transfer_stats_data.get(name, 0)
            if value and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)


class SessionfleetKVConnector(KVConnectorBase_V1):
    """vLLM's connector to sessionfleet's block store (module docstring)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        if not extra.get("root"):
            raise ValueError("SessionfleetKVConnector needs kv_connector_extra_config.root")
        self.root = Path(str(extra["root"]))
        self.max_bytes = int(extra.get("max_bytes", 0))
        self.block_tokens = vllm_config.cache_config.block_size
        self.layout = _layout(vllm_config, kv_cache_config)
        self.store = BlockStore(self.root, layout_fingerprint(self.layout), self.block_tokens)
        self.health: str | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler_init()
        else:
            self._worker_init()
        log.info(
            "sessionfleet KV store (%s) at %s, layout %s",
            role.name.lower(),
            self.store.directory,
            self.store.fingerprint[:16],
        )

    # ================================================================================
    # Scheduler side
    # ================================================================================

    def _scheduler_init(self) -> None:
        self._requests: dict[str, Request] = {}
        self._chains: dict[str, list[str]] = {}
        self._tracked: dict[str, RequestBlocks] = {}
        self._computed: dict[str, int] = {}
        """Per request, the tokens vLLM's own cache held when the store was asked."""
        self._loads: list[tuple[str, list[int], list[str]]] = []
        self._recent: OrderedDict[str, None] = OrderedDict()
        self._forgets: queue.SimpleQueue[list[str]] = queue.SimpleQueue()
        self._forgotten = (0, 0)
        self.health = self.store.probe()
        threading.Thread(target=self._housekeeping, name="sf-kv-house", daemon=True).start()

    def _chain(self, request: Request) -> list[str]:
        """Return the request's block hashes as hex, extended as vLLM hashes new blocks."""
        chain = self._chains.setdefault(request.request_id, [])
        hashes = request.block_hashes
        if len(chain) < len(hashes):
            chain.extend(_hex(h) for h in hashes[len(chain) :])
        return chain

    def _stored(self, block_hash: str) -> bool:
        if block_hash in self._recent:
            self._recent.move_to_end(block_hash)
            return True
        if self.store.has(block_hash):
            self._remember(block_hash)
            return True
        return False

    def _remember(self, block_hash: str) -> None:
        self._recent[block_hash] = None
        if len(self._recent) > RECENTLY_STORED:
            self._recent.popitem(last=False)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens after vLLM's own prefix-cache hit that the store can fill."""
        self._requests[request.request_id] = request
        if self.health is not None:
            return 0, False
        chain = self._chain(request)
        # A hit is checked on the files themselves, not on what this engine remembers
        # saving: another engine's files count, and a file evicted since does not.
        blocks = loadable_blocks(
            chain, request.num_tokens, num_computed_tokens, self.block_tokens, self.store.has
        )
        self._computed[request.request_id] = num_computed_tokens
        return blocks * self.block_tokens, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Queue the load of the blocks the scheduler allocated for the store's tokens."""
        if num_external_tokens <= 0:
            return
        first = self._computed.get(request.request_id, 0) // self.block_tokens
        count = num_external_tokens // self.block_tokens
        block_ids = blocks.get_block_ids()[0][first : first + count]
        chain = self._chain(request)[first : first + count]
        self._loads.append((request.request_id, list(block_ids), list(chain)))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Return this step's loads, and the blocks it completes that the store lacks."""
        meta = SessionfleetMetadata(loads=self._loads)
        self._loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        steps: list[tuple[str, list[int] | None, bool, int]] = [
            (new.req_id, new.block_ids[0], True, new.num_computed_tokens)
            for new in scheduler_output.scheduled_new_reqs
        ]
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[index]
            steps.append(
                (
                    req_id,
                    new_ids[0] if new_ids is not None else None,
                    req_id in cached.resumed_req_ids,
                    cached.num_computed_tokens[index],
                )
            )
        if self.health is not None:
            return meta
        for req_id, block_ids, replace, computed in steps:
            request = self._requests.get(req_id)
            if request is None:
                continue
            tracked = self._tracked.setdefault(req_id, RequestBlocks())
            if block_ids is not None:
                tracked.allocate(block_ids, replace)
            saves = tracked.to_save(
                self._chain(request),
                computed + scheduled.get(req_id, 0),
                self.block_tokens,
                self._stored,
            )
            for _, block_hash in saves:
                self._remember(block_hash)
            meta.saves.extend(saves)
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Record the session's chain; answer a control request. Blocks are freed now."""
        req_id = request.request_id
        chain = self._chain(request)
        for table in (self._requests, self._chains, self._tracked, self._computed):
            table.pop(req_id, None)
        params = request.kv_transfer_params
        if isinstance(params, dict) and CONTROL_KEY in params:
            return False, {CONTROL_KEY: self._control(params[CONTROL_KEY])}
        session = session_tag(getattr(request, "session_id", None))
        if session is not None and self.health is None:
            full = min(len(chain), request.num_computed_tokens // self.block_tokens)
            manifest = Manifest(session, tuple(chain[:full]), request.num_tokens, time.time())
            try:
                self.store.write_manifest(manifest)
            except StoreError as error:
                self._degrade(error)
        return False, None

    def _degrade(self, error: OSError) -> None:
        if self.health is None:
            log.warning("KV store at %s degraded to recompute: %s", self.root, error)
        self.health = describe(error)

    def _control(self, body: Any) -> dict[str, Any]:
        """Answer the operator's report and forget requests (docs/kvstore.md, "Control")."""
        token = os.environ.get(TOKEN_ENV)
        if not isinstance(body, dict) or not token or body.get("token") != token:
            return {"error": "refused: no or wrong token"}
        self._check_storage()  # the operator's condition shows the storage as it is now
        sessions = [s for s in body.get("sessions", []) if isinstance(s, str)][:1_000_000]
        answer: dict[str, Any] = {
            "layout": self.store.fingerprint[:16],
            "health": self.health,
            "forgotten": {"blocks": self._forgotten[0], "bytes": self._forgotten[1]},
        }
        if body.get("op") == "forget":
            self._forgets.put(sessions)
            answer["queued"] = len(sessions)
        elif body.get("op") == "retain":
            # Level-triggered: every session not live for the operator, and idle for
            # the grace, is forgotten (missed finishes and deletions included).
            grace = float(body.get("grace", 300))
            self._forgets.put(self.store.stale_sessions(sessions, time.time(), grace))
            answer["retained"] = len(sessions)
        elif body.get("op") == "report":
            answer["sessions"] = {}
            for session in sessions:
                report = self.store.report(session)
                answer["sessions"][session] = {
                    "tokens": report.tokens,
                    "blocks": report.blocks,
                    "bytes": report.bytes,
                    "chain": report.chain,
                }
            if body.get("usage"):
                files, size = self.store.usage()
                answer["usage"] = {"blocks": files, "bytes": size, "maxBytes": self.max_bytes}
        else:
            answer["error"] = f"unknown op {body.get('op')!r}"
        return answer

    def _check_storage(self) -> None:
        """Probe the storage, and ask the files again about every block remembered as stored.

        A remembered block may never have reached the disk (the worker side's write
        failed, which it cannot tell this side) or been evicted since, by this engine or
        another: either way it must be saved again when a request computes it.
        """
        self.health = self.store.probe()
        self._recent.clear()

    def _housekeeping(self) -> None:
        """Storage checks, eviction and forgets, away from the scheduler's loop."""
        while True:
            try:
                sessions = self._forgets.get(timeout=HOUSEKEEPING_SECONDS)
            except queue.Empty:
                sessions = None
            try:
                if sessions:
                    removed, freed = self.store.forget(sessions)
                    self._forgotten = (self._forgotten[0] + removed, self._forgotten[1] + freed)
                    self._recent.clear()
                    continue
                if self.max_bytes:
                    self.store.evict(self.max_bytes)
                self._check_storage()
                self.store.sweep_temporaries()
            except Exception:  # housekeeping must never stop the engine
                log.exception("KV store housekeeping failed")

    # ================================================================================
    # Worker side
    # ================================================================================

    def _worker_init(self) -> None:
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._layers: list[tuple[str, int]] = []
        self._writes: queue.Queue[list[tuple[str, list[tuple[str, bytes]]]]] = queue.Queue(
            WRITE_QUEUE_BATCHES
        )
        self._load_errors: set[int] = set()
        self._stats = SessionfleetStats()
        self._stats_lock = threading.Lock()
        threading.Thread(target=self._writer, name="sf-kv-writer", daemon=True).start()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep the paged caches; blocks are their leading dimension (vLLM's standard view)."""
        num_blocks = self._kv_cache_config.num_blocks if self._kv_cache_config else None
        layers = []
        for name, tensor in kv_caches.items():
            if num_blocks is not None and tensor.shape[0] != num_blocks:
                self.health = (
                    f"LayoutUnsupported: layer {name} has shape {tuple(tensor.shape)}, "
                    f"not {num_blocks} blocks first"
                )
                log.error("KV store disabled: %s", self.health)
                self.kv_caches = {}
                return
            layers.append((name, tensor[0].numel() * tensor.element_size()))
        self.kv_caches = dict(kv_caches)
        self._layers = layers

    def _count(self, **amounts: float) -> None:
        with self._stats_lock:
            for name, amount in amounts.items():
                self._stats.data[name] = self._stats.data.get(name, 0) + amount

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Copy the step's stored blocks into the paged caches before the forward pass."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, SessionfleetMetadata) or not meta.loads:
            return
        if not self.kv_caches:  # the store is off on this worker: nothing can load
            for _, block_ids, _ in meta.loads:
                self._load_errors.update(block_ids)
            return
        started = time.monotonic()
        loaded = size = 0
        for _, block_ids, chain in meta.loads:
            for position, (block_id, block_hash) in enumerate(zip(block_ids, chain, strict=True)):
                payload = self.store.read_block(block_hash, self._layers)
                if payload is None:
                    # vLLM recomputes from the first block that failed; the ones after
                    # it in this request are recomputed too, so they need not load.
                    self._load_errors.update(block_ids[position:])
                    self._count(load_misses=len(block_ids) - position)
                    break
                for (name, _), data in zip(self._layers, payload, strict=True):
                    target = self.kv_caches[name][block_id]
                    source = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                    target.copy_(source.view(target.dtype).view(target.shape))
                loaded += 1
                size += sum(len(d) for d in payload)
        elapsed = time.monotonic() - started
        self._count(blocks_loaded=loaded, bytes_loaded=size, load_seconds=elapsed)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Return at once: loads are whole before the forward pass."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Blocks are copied once the step is done (:meth:`wait_for_save`), all layers at once."""

    def wait_for_save(self) -> None:
        """Copy the step's completed blocks out of the paged caches and queue their writes."""
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if not isinstance(meta, SessionfleetMetadata) or not meta.saves or not self.kv_caches:
            return
        block_ids = [block_id for block_id, _ in meta.saves]
        index = torch.tensor(block_ids, dtype=torch.long)
        copies = []
        for name, _ in self._layers:
            cache = self.kv_caches[name]
            blocks = cache.index_select(0, index.to(cache.device)).to("cpu")
            copies.append((name, blocks.contiguous().view(torch.uint8).numpy()))
        batch = [
            (block_hash, [(name, array[position].tobytes()) for name, array in copies])
            for position, (_, block_hash) in enumerate(meta.saves)
        ]
        try:
            self._writes.put_nowait(batch)
        except queue.Full:
            self._count(blocks_dropped=len(batch))

    def _writer(self) -> None:
        while True:
            batch = self._writes.get()
            started = time.monotonic()
            saved = size = errors = 0
            for block_hash, layers in batch:
                try:
                    size += self.store.write_block(block_hash, layers)
                    saved += 1
                except StoreError as error:
                    errors += 1
                    if self.health is None:
                        log.warning("KV store at %s refused a block: %s", self.root, error)
                    self.health = describe(error)
                except Exception:  # the writer must outlive any one block
                    errors += 1
                    log.exception("KV store: writing block %s failed", block_hash)
            if saved and not errors:
                self.health = None
            self._count(
                blocks_saved=saved,
                bytes_saved=size,
                save_errors=errors,
                save_seconds=time.monotonic() - started,
            )

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks promised to the scheduler that could not be loaded: vLLM recomputes them."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Return the counters since the last call (vLLM logs them and feeds /metrics)."""
        if self._role == KVConnectorRole.SCHEDULER:
            return None  # the counters are the worker side's
        with self._stats_lock:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, SessionfleetStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        """Rebuild the worker's counters in the process that logs them."""
        return SessionfleetStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        """Register the store's counters on vLLM's /metrics."""
        return SessionfleetPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    def shutdown(self) -> None:
        """Let queued writes finish for a moment; a write cut short is never renamed in."""
        if self._role == KVConnectorRole.WORKER:
            deadline = time.monotonic() + 5.0
            while not self._writes.empty() and time.monotonic() < deadline:
                time.sleep(0.05)
