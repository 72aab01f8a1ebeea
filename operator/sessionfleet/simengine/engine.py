"""The simulated engine's state, without HTTP: admission, pause, prefix cache, counters.

SIMULATOR. :class:`SimEngine` serves one request at a time through :meth:`SimEngine.run`
(tokenize, queue for a slot, look the prompt up in the prefix cache, spend the simulated
prefill time, generate filler tokens at the simulated decode rate, cache the blocks the
prompt and the reply filled) and answers vLLM's pause, resume and metrics questions.
:mod:`.server` puts vLLM's HTTP API in front of it.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sessionfleet.engines import vllm
from sessionfleet.simengine.cache import CacheSnapshot, PrefixCache, SessionRecord, SnapshotError
from sessionfleet.simengine.cost import FREE, CostModel
from sessionfleet.simengine.tokenizer import ROOT_HASH, chain_hash, filler_words, split_blocks

MAX_TRACKED_SESSIONS: Final = 4096
"""Sessions whose block chains are remembered for per-session export (LRU beyond)."""

PAUSE_MODES: Final = ("abort", "wait", "keep")
"""vLLM's pause modes: end in-flight requests, let them finish, or freeze them."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How a simulated engine is set up (the ``sim-engine`` flags)."""

    model: str
    kv_tokens: int = 1 << 20
    block_size: int = 16
    cost: CostModel = FREE
    max_num_seqs: int = 256
    max_model_len: int = 1 << 18
    default_max_tokens: int = 16
    enable_prompt_tokens_details: bool = True
    force_include_usage: bool = False
    session_header: str = "X-Session-Id"
    metrics_fault: float | None = None
    """Fault injection: report this value (NaN, ±Inf) for the KV usage and running-requests
    gauges, as a broken engine might, to test what reads them."""


class RequestError(Exception):
    """A request the engine refuses, with the HTTP status and vLLM's error type."""

    def __init__(self, message: str, status: int = 400, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.kind = kind


@dataclass(slots=True, eq=False)
class Generation:
    """One request being served: what it asked for and what it produced."""

    prompt: str
    max_tokens: int
    explicit_max_tokens: bool
    session_id: str | None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    words: list[str] = field(default_factory=list)
    finish_reason: str = "stop"
    aborted: bool = False

    @property
    def completion_tokens(self) -> int:
        """Tokens generated (each filler word is one token)."""
        return len(self.words)

    def usage(self, details: bool) -> dict[str, Any]:
        """Return the ``usage`` object, with ``prompt_tokens_details`` when enabled."""
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "completion_tokens": self.completion_tokens,
            "prompt_tokens_details": ({"cached_tokens": self.cached_tokens} if details else None),
        }
        return usage


Emit = Callable[[int, str, bool], Awaitable[None]]
"""Called for each generated token: (index, text delta, whether more time passes next)."""


class SimEngine:
    """The engine's state: cache, admission, pause, counters. No HTTP here."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.cache = PrefixCache(config.kv_tokens, config.block_size)
        self.sessions: OrderedDict[str, SessionRecord] = OrderedDict()
        self.running = 0
        self.waiting = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.finished: dict[str, int] = {}
        self.started_at = time.time()
        self._slots = asyncio.Semaphore(config.max_num_seqs)
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._frozen = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._in_flight: set[Generation] = set()

    # --- pause / resume (vLLM's /pause, /resume, /is_paused) -------------------------

    @property
    def paused(self) -> bool:
        """Whether the engine is paused."""
        return not self._resumed.is_set()

    async def pause(self, mode: str, clear_cache: bool) -> None:
        """Pause: new requests wait; in-flight ones freeze (keep), finish (wait) or end (abort)."""
        if mode not in PAUSE_MODES:
            raise RequestError(f"mode must be one of {', '.join(PAUSE_MODES)}, not {mode!r}")
        self._resumed.clear()
        if mode == "keep":
            # vLLM ignores clear_cache with mode=keep: the frozen requests need their KV.
            self._frozen = True
            return
        if mode == "abort":
            for generation in self._in_flight:
                generation.aborted = True
        await self._idle.wait()
        if clear_cache:
            self.cache.clear()

    def resume(self) -> None:
        """Resume: frozen requests continue, waiting ones are admitted."""
        self._frozen = False
        self._resumed.set()

    # --- serving --------------------------------------------------------------------

    async def run(self, generation: Generation, emit: Emit | None) -> Generation:
        """Serve one request: admission, cache lookup, prefill, decode, cache update."""
        split = split_blocks(generation.prompt, self.config.block_size)
        generation.prompt_tokens = split.num_tokens
        if split.num_tokens + generation.max_tokens > self.config.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.config.max_model_len} tokens. "
                f"However, you requested {split.num_tokens + generation.max_tokens} tokens "
                f"({split.num_tokens} in the messages, {generation.max_tokens} in the "
                "completion). Please reduce the length of the messages or completion."
            )
        await self._admit()
        cost = self.config.cost
        block = self.config.block_size
        private = -(-(split.num_tokens % block + generation.max_tokens) // block)
        held: list[bytes] = []
        extra: list[bytes] = []
        self.running += 1
        self._idle.clear()
        try:
            self._in_flight.add(generation)
            lookup = self.cache.lookup(split.hashes, split.num_tokens)
            generation.cached_tokens = lookup.hit_tokens
            held = self.cache.acquire(split.hashes, private)
            self.prompt_tokens_total += split.num_tokens
            await self._spend(cost.prefill_seconds(split.num_tokens - lookup.hit_tokens))
            seed = split.last_hash or chain_hash(ROOT_HASH, generation.prompt)
            words = filler_words(seed, generation.max_tokens)
            delay = cost.decode_seconds()
            for index, word in enumerate(words):
                if self._frozen:
                    await self._resumed.wait()
                if generation.aborted:
                    generation.finish_reason = "abort"
                    break
                if index and delay:
                    await asyncio.sleep(delay)
                generation.words.append(word)
                self.generation_tokens_total += 1
                if emit is not None:
                    await emit(index, word, bool(delay))
            else:
                generation.finish_reason = "length" if generation.explicit_max_tokens else "stop"
            if len(held) == len(split.hashes):
                extra = self._cache_generated(generation, split.tail_start, split.last_hash)
        finally:
            self.cache.release(held + extra, private)
            self._in_flight.discard(generation)
            self.running -= 1
            if not self.running:
                self._idle.set()
            self._slots.release()
        self.finished[generation.finish_reason] = self.finished.get(generation.finish_reason, 0) + 1
        if generation.session_id is not None:
            self._remember(generation.session_id, held + extra, generation)
        return generation

    async def _admit(self) -> None:
        """Wait while paused, then for one of ``max_num_seqs`` slots."""
        self.waiting += 1
        try:
            while True:
                await self._resumed.wait()
                await self._slots.acquire()
                if not self.paused:
                    return
                # Paused while we waited for the slot: give it back and wait again.
                self._slots.release()
        finally:
            self.waiting -= 1

    async def _spend(self, seconds: float) -> None:
        """Sleep the simulated time, staying frozen while paused with mode=keep."""
        if seconds > 0:
            await asyncio.sleep(seconds)
        if self._frozen:
            await self._resumed.wait()

    def _cache_generated(
        self, generation: Generation, tail_start: int, parent: bytes | None
    ) -> list[bytes]:
        """Cache the full blocks of the prompt's tail plus the generated text.

        vLLM caches the blocks that generation fills, so the next turn (whose prompt
        is this prompt, this reply and a new message) hits them too.
        """
        if not generation.words:
            return []
        text = generation.prompt[tail_start:] + "".join(generation.words)
        extra = split_blocks(text, self.config.block_size, parent or ROOT_HASH)
        return self.cache.acquire(extra.hashes)

    def _remember(self, session_id: str, chain: list[bytes], gen: Generation) -> None:
        """Record the block chain of a session's latest request, for per-session export."""
        self.sessions[session_id] = SessionRecord(chain, gen.prompt_tokens + gen.completion_tokens)
        self.sessions.move_to_end(session_id)
        while len(self.sessions) > MAX_TRACKED_SESSIONS:
            self.sessions.popitem(last=False)

    # --- snapshots ------------------------------------------------------------------

    def snapshot(self, session_id: str | None = None) -> CacheSnapshot:
        """Return the state to export: all blocks, or the cached blocks of one session."""
        if session_id is None:
            return CacheSnapshot(
                self.config.model,
                self.config.block_size,
                self.cache.lru_order(),
                dict(self.sessions),
            )
        record = self.sessions.get(session_id)
        if record is None:
            raise RequestError(f"no session {session_id!r} is known", 404, "NotFoundError")
        cached = []
        for block_hash in record.hashes:
            if block_hash not in self.cache:
                break  # evicted: the rest of the chain cannot hit any more
            cached.append(block_hash)
        # Least recent first, with the session's first block last: an import then
        # evicts the chain tail-first, as the engine itself would.
        blocks = list(reversed(cached))
        return CacheSnapshot(
            self.config.model,
            self.config.block_size,
            blocks,
            {session_id: SessionRecord(cached, record.tokens)},
        )

    def restore(self, snapshot: CacheSnapshot) -> int:
        """Load a snapshot into the cache; return the blocks added."""
        if snapshot.model != self.config.model:
            raise SnapshotError(
                f"the snapshot is of model {snapshot.model!r}; this engine serves "
                f"{self.config.model!r}"
            )
        if snapshot.block_size != self.config.block_size:
            raise SnapshotError(
                f"the snapshot has block size {snapshot.block_size}; this engine uses "
                f"{self.config.block_size}"
            )
        added = self.cache.insert(snapshot.blocks)
        for session_id, record in snapshot.sessions.items():
            self.sessions[session_id] = record
            self.sessions.move_to_end(session_id)
        return added

    def summary(self) -> dict[str, Any]:
        """Return what ``GET /sim/cache`` answers."""
        return {
            "model": self.config.model,
            "blockSize": self.config.block_size,
            "capacityBlocks": self.cache.num_blocks,
            "cachedBlocks": self.cache.cached_blocks,
            "cachedTokens": self.cache.cached_blocks * self.config.block_size,
            "kvCacheUsage": self.cache.kv_usage,
            "evictedBlocks": self.cache.evicted_blocks,
            "prefixCacheQueries": self.cache.queries_tokens,
            "prefixCacheHits": self.cache.hits_tokens,
            "sessions": {sid: rec.tokens for sid, rec in self.sessions.items()},
        }


# --- metrics ----------------------------------------------------------------------------


class EngineCollector(Collector):
    """Reads the engine's state at scrape time: nothing to update on the hot path."""

    def __init__(self, engine: SimEngine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        """Yield vLLM's metrics and a few simulator-only ones."""
        engine = self._engine
        model = engine.config.model
        labels = ["model_name", "engine"]
        values = [model, "0"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        fault = engine.config.metrics_fault
        yield gauge(
            vllm.NUM_REQUESTS_RUNNING,
            "Number of requests in model execution batches.",
            engine.running if fault is None else fault,
        )
        yield gauge(
            vllm.NUM_REQUESTS_WAITING, "Number of requests waiting to be processed.", engine.waiting
        )
        yield gauge(
            vllm.KV_CACHE_USAGE_PERC,
            "KV-cache usage. 1 means 100 percent usage.",
            engine.cache.kv_usage if fault is None else fault,
        )
        yield counter(
            vllm.PREFIX_CACHE_QUERIES,
            "Prefix cache queries, in terms of number of queried tokens.",
            engine.cache.queries_tokens,
        )
        yield counter(
            vllm.PREFIX_CACHE_HITS,
            "Prefix cache hits, in terms of number of cached tokens.",
            engine.cache.hits_tokens,
        )
        yield counter(
            vllm.PROMPT_TOKENS, "Number of prefill tokens processed.", engine.prompt_tokens_total
        )
        yield counter(
            vllm.GENERATION_TOKENS,
            "Number of generation tokens processed.",
            engine.generation_tokens_total,
        )
        success = CounterMetricFamily(
            vllm.REQUEST_SUCCESS,
            "Count of successfully processed requests.",
            labels=[*labels, "finished_reason"],
        )
        for reason, count in sorted(engine.finished.items()):
            success.add_metric([*values, reason], count)
        yield success
        info = GaugeMetricFamily(
            vllm.CACHE_CONFIG_INFO,
            "Information of the LLMEngine CacheConfig",
            labels=["block_size", "num_gpu_blocks", "enable_prefix_caching", "cache_dtype"],
        )
        info.add_metric(
            [str(engine.config.block_size), str(engine.cache.num_blocks), "True", "auto"], 1
        )
        yield info
        yield gauge(
            "sessionfleet_sim_cached_blocks",
            "SIMULATOR: blocks held in the prefix cache, referenced or free.",
            engine.cache.cached_blocks,
        )
        yield counter(
            "sessionfleet_sim_evicted_blocks",
            "SIMULATOR: blocks evicted from the prefix cache.",
            engine.cache.evicted_blocks,
        )
        yield gauge(
            "sessionfleet_sim_paused",
            "SIMULATOR: 1 while the engine is paused.",
            1 if engine.paused else 0,
        )
