"""Replay a hash-id trace (Claude Code, Mooncake) against routing strategies.

Each worker keeps a cache of whole blocks keyed by the trace's own block hashes, least
recently used first out, with the capacity of ``FleetConfig.kv_tokens``; a request
hits the leading run of its blocks that the chosen worker holds. Prefill is first come
first served per worker, at the cost model's rate, as in the session simulator.
Requests are sent at their recorded times (open loop).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from heapq import heappop, heappush
from zlib import crc32

from sessionfleet.fleetsim._config import FleetConfig
from sessionfleet.fleetsim._results import _quantile, new_histogram, ttft_bucket
from sessionfleet.fleetsim._traces import Trace, TraceRequest, cached_prefix
from sessionfleet.policy.placement import PlacementRequest, WorkerLoad, place

REPLAY_STRATEGIES = ("round-robin", "least-loaded", "affinity", "llm-d", "operator")


class _BlockCache:
    __slots__ = ("blocks", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def serve(self, request: TraceRequest, block_size: int) -> int:
        hit = cached_prefix(request, self.blocks.__contains__, block_size)
        blocks = self.blocks
        for block in request.hash_ids:
            blocks[block] = None
            blocks.move_to_end(block)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)
        return hit


class _ReplayWorker:
    __slots__ = ("bound", "cache", "free_at", "index", "inflight", "name")

    def __init__(self, index: int, capacity_blocks: int) -> None:
        self.index = index
        self.name = f"worker-{index:02d}"
        self.cache = _BlockCache(capacity_blocks)
        self.free_at = 0.0
        self.inflight: list[float] = []
        self.bound = 0

    def backlog(self, now: float) -> float:
        return self.free_at - now if self.free_at > now else 0.0

    def in_flight(self, now: float) -> int:
        while self.inflight and self.inflight[0] <= now:
            heappop(self.inflight)
        return len(self.inflight)


@dataclass(slots=True)
class ReplayResult:
    """What one strategy's replay measured."""

    strategy: str
    requests: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    ttft_max: float = 0.0
    ttft_histogram: list[int] = field(default_factory=new_histogram)
    end_time: float = 0.0

    @property
    def hit_rate(self) -> float:
        """Share of prompt tokens served from the chosen worker's cache."""
        return self.cached_tokens / self.input_tokens if self.input_tokens else 0.0

    def ttft_quantile(self, q: float) -> float:
        """Time to first token at quantile ``q`` (within 1%)."""
        return _quantile(self.ttft_histogram, self.requests, q, self.ttft_max)


Router = Callable[[TraceRequest, float], _ReplayWorker]


def replay(trace: Trace, strategy: str, fleet: FleetConfig | None = None) -> ReplayResult:
    """Replay ``trace`` with one strategy (see ``REPLAY_STRATEGIES``) and measure it."""
    config = fleet or FleetConfig()
    block = trace.block_size
    workers = [_ReplayWorker(i, max(1, config.kv_tokens // block)) for i in range(config.workers)]
    last_of = {r.session: index for index, r in enumerate(trace.requests)}
    route = _router(strategy, workers, config, block)
    cost = config.cost
    result = ReplayResult(strategy)
    bound: dict[str, _ReplayWorker] = {}
    for index, request in enumerate(trace.requests):
        now = request.at
        worker = route(request, now)
        if strategy == "operator" and request.session not in bound:
            bound[request.session] = worker
            worker.bound += 1
        hit = worker.cache.serve(request, block)
        start = worker.free_at if worker.free_at > now else now
        finish = (
            start
            + cost.prefill_overhead_seconds
            + (request.input_tokens - hit) * cost.prefill_seconds_per_token
        )
        worker.free_at = finish
        end = finish + request.output_tokens * cost.decode_seconds_per_token
        heappush(worker.inflight, end)
        ttft = finish - now
        result.requests += 1
        result.input_tokens += request.input_tokens
        result.cached_tokens += hit
        result.ttft_histogram[ttft_bucket(ttft)] += 1
        result.ttft_max = max(result.ttft_max, ttft)
        result.end_time = max(result.end_time, end)
        if strategy == "operator" and last_of[request.session] == index:
            bound.pop(request.session).bound -= 1
    return result


def _router(strategy: str, workers: list[_ReplayWorker], config: FleetConfig, block: int) -> Router:
    """Return the routing function of a strategy, over the replay's workers."""
    turn = iter(range(1 << 62))
    sticky: dict[str, tuple[_ReplayWorker, float]] = {}
    rng = random.Random(0)  # ties go to a random one of the best, reproducibly

    def round_robin(request: TraceRequest, now: float) -> _ReplayWorker:
        return workers[next(turn) % len(workers)]

    def least_loaded(request: TraceRequest, now: float) -> _ReplayWorker:
        return min(workers, key=lambda w: (w.in_flight(now), w.index))

    def affinity(request: TraceRequest, now: float) -> _ReplayWorker:
        key = crc32(request.session.encode())
        return max(workers, key=lambda w: hash((key, w.index)))

    def llmd(request: TraceRequest, now: float) -> _ReplayWorker:
        # The session simulator's LlmdScheduler, over blocks: prefix (3), queue (2),
        # session binding within its TTL (1).
        backlogs = [w.backlog(now) for w in workers]
        low, high = min(backlogs), max(backlogs)
        spread = high - low
        previous = sticky.get(request.session)
        bound = (
            previous[0] if previous and now - previous[1] <= config.session_ttl_seconds else None
        )
        best, best_score = workers[0], -1.0
        count = len(workers)
        first = rng.randrange(count)
        for index in range(first, first + count):
            worker, backlog = workers[index % count], backlogs[index % count]
            cached = cached_prefix(request, worker.cache.blocks.__contains__, block)
            score = 3.0 * cached / max(request.input_tokens, 1)
            score += 2.0 * ((high - backlog) / spread if spread else 1.0)
            score += 1.0 if worker is bound else 0.0
            if score > best_score:
                best, best_score = worker, score
        sticky[request.session] = (best, now)
        return best

    def operator(request: TraceRequest, now: float) -> _ReplayWorker:
        # policy.placement.place for a session's first request, then its bound worker.
        previous = sticky.get(request.session)
        if previous is not None:
            return previous[0]
        loads = [
            WorkerLoad(
                name=w.name,
                model=config.model,
                ready=True,
                pinned_sessions=w.bound,
                max_sessions=1 << 30,
            )
            for w in workers
        ]
        chosen = place(PlacementRequest(model=config.model), loads).worker
        worker = next((w for w in workers if w.name == chosen), workers[0])
        sticky[request.session] = (worker, now)
        return worker

    routers: dict[str, Router] = {
        "round-robin": round_robin,
        "least-loaded": least_loaded,
        "affinity": affinity,
        "llm-d": llmd,
        "operator": operator,
    }
    try:
        return routers[strategy]
    except KeyError:
        raise ValueError(
            f"unknown replay strategy {strategy!r}; choose from {', '.join(REPLAY_STRATEGIES)}"
        ) from None
