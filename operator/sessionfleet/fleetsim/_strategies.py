"""Routing strategies: where each turn goes.

Four baselines stand for what routers do without an operator, and ``operator`` is
sessionfleet itself: placement by :func:`sessionfleet.policy.placement.place`, the
very function the router and the operator call, then hard affinity, with drains
and recoveries decided by the operator's own
:func:`~sessionfleet.policy.worker.plan_worker`,
:func:`~sessionfleet.policy.migration.plan_migration` and
:func:`~sessionfleet.policy.sessions.decide_session` (see ``_sim.py``).

The baselines have no drain hold and no recovery: a drained or failed worker's pod
goes at once, its cache with it, and its sessions' next turns go elsewhere.
"""

from __future__ import annotations

import random
from typing import ClassVar, Protocol

from sessionfleet.fleetsim._config import FleetConfig
from sessionfleet.fleetsim._observed import worker_loads
from sessionfleet.fleetsim._state import Live, Worker
from sessionfleet.policy.placement import PlacementRequest, place


class FleetView(Protocol):
    """What a strategy sees of the simulation."""

    config: FleetConfig
    workers: list[Worker]
    up_workers: list[Worker]
    """Workers whose pod serves, in index order."""
    by_name: dict[str, Worker]
    generation: int
    """Incremented whenever the set of serving workers changes."""


class Strategy:
    """Base of the strategies: ``route`` returns the worker for a session's next turn."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    operator: ClassVar[bool] = False
    """Whether drains are held and failed workers recovered by the operator's policies."""

    def route(self, fleet: FleetView, live: Live, now: float) -> Worker | None:
        """Return the worker for ``live``'s next turn, or ``None`` to try again later."""
        raise NotImplementedError

    @property
    def label(self) -> str:
        """The name shown in tables."""
        return self.name


class RoundRobin(Strategy):
    """Every turn to the next worker in turn, as a plain Kubernetes Service spreads them."""

    name = "round-robin"
    description = "each turn to the next worker in turn; no affinity"

    def __init__(self) -> None:
        self._next = 0

    def route(self, fleet: FleetView, live: Live, now: float) -> Worker | None:
        """Return the next serving worker in order."""
        up = fleet.up_workers
        if not up:
            return None
        self._next += 1
        return up[self._next % len(up)]


def _least_inflight(up: list[Worker], now: float, start: int) -> Worker:
    """Return the worker with the fewest turns in flight; ties rotate from ``start``."""
    count = len(up)
    first = start % count
    best = up[first]
    best_load = best.inflight_count(now)
    for worker in up[first + 1 :] + up[:first]:
        inflight = worker.inflight
        if inflight and inflight[0][0] <= now:
            worker.expire(now)
        if len(inflight) < best_load:
            best, best_load = worker, len(inflight)
            if not best_load:
                break
    return best


class LeastLoaded(Strategy):
    """Every turn to the worker with the fewest requests in flight (least-request balancing)."""

    name = "least-loaded"
    description = "each turn to the worker with the fewest turns in flight; no affinity"

    def __init__(self) -> None:
        self._turns = 0

    def route(self, fleet: FleetView, live: Live, now: float) -> Worker | None:
        """Return the least-loaded serving worker."""
        up = fleet.up_workers
        if not up:
            return None
        self._turns += 1
        return _least_inflight(up, now, self._turns)


class HardAffinity(Strategy):
    """Every turn to the worker the session id hashes to (rendezvous hashing).

    What a router hashing a session header does: no state, no load awareness, and
    when the set of workers changes only the sessions of the changed worker move.
    """

    name = "affinity"
    description = "hash of the session id over the serving workers; sticky, load-blind"

    def route(self, fleet: FleetView, live: Live, now: float) -> Worker | None:
        """Return the worker the session hashes to among the serving ones."""
        if live.route_generation == fleet.generation and live.worker is not None:
            return live.worker
        up = fleet.up_workers
        if not up:
            return None
        session_hash = live.hash
        chosen = max(up, key=lambda w: hash((session_hash, w.index)))
        live.route_generation = fleet.generation
        return chosen


class GatedAffinity(Strategy):
    """Sticky while the bound worker keeps up; moved when its queue passes a load gate.

    A new session goes to the worker with the fewest turns in flight. A later turn
    goes back to the bound worker unless its prefill backlog exceeds the gate and
    another worker would give an earlier first token even though it must recompute
    the whole prefix there.
    """

    name = "affinity-gated"
    description = "sticky binding, moved when the bound worker's queue exceeds a gate"

    def __init__(self) -> None:
        self._placed = 0

    def route(self, fleet: FleetView, live: Live, now: float) -> Worker | None:
        """Return the bound worker, or a less loaded one past the gate."""
        up = fleet.up_workers
        if not up:
            return None
        bound = live.worker
        if bound is None or not bound.up:
            self._placed += 1
            return _least_inflight(up, now, self._placed)
        backlog = bound.backlog(now)
        config = fleet.config
        if backlog <= config.load_gate_seconds:
            return bound
        best = min(up, key=lambda w: (w.backlog(now), w.index))
        per_token = config.cost.prefill_seconds_per_token
        session = live.session
        new_tokens = session.new_tokens[live.turn] if live.turn < live.turns else 0
        stay = backlog + new_tokens * per_token
        move = best.backlog(now) + (live.prompt + new_tokens - live.shared) * per_token
        return best if move < stay else bound


class LlmdScheduler(Strategy):
    """What llm-d's inference scheduler does with its default scorers, per request.

    Filter, score, pick (llm-d's Request Scheduler): every serving worker is scored by
    a weighted sum and the highest wins —

    - prefix-cache scorer (weight 3): the share of the prompt the worker holds in its
      prefix cache (the precise scorer, which follows the engines' KV events, so the
      simulator reads the worker's cache itself);
    - queue scorer (weight 2): ``(max - q) / (max - min)`` of the workers' queues, 1
      when all are equal; the queue is the prefill backlog in seconds;
    - session-affinity scorer (weight 1): 1 for the worker that served the session's
      last turn, while that binding is younger than ``session_ttl_seconds``.

    A saturation signal stands in for GAIE's saturation detector: when every worker's
    backlog passes ``saturation_seconds`` the request is not placed and waits (it is
    retried, as flow control would release it). No drain hold, no recovery.
    """

    name = "llm-d"
    description = "llm-d-style scoring: prefix cache (3) + queue (2) + session (1), TTL, saturation"
    prefix_weight: ClassVar[float] = 3.0
    queue_weight: ClassVar[float] = 2.0
    session_weight: ClassVar[float] = 1.0

    def __init__(self) -> None:
        self._rng = random.Random(0)

    def route(self, fleet: FleetView, live: Live, now: float) -> Worker | None:
        """Return the best-scoring serving worker, or ``None`` when all are saturated."""
        up = fleet.up_workers
        if not up:
            return None
        config = fleet.config
        backlogs = [w.backlog(now) for w in up]
        low, high = min(backlogs), max(backlogs)
        if low > config.saturation_seconds:
            return None
        session = live.session
        prompt = live.prompt + (session.new_tokens[live.turn] if live.turn < live.turns else 0)
        bound = live.worker
        if bound is not None and now - live.busy_until > config.session_ttl_seconds:
            bound = None
        spread = high - low
        best: Worker | None = None
        best_score = -1.0
        # Ties go to a random one of the best, as the max-score picker shuffles the
        # endpoints before it picks (seeded: runs are reproducible).
        count = len(up)
        first = self._rng.randrange(count)
        for index in range(first, first + count):
            worker = up[index % count]
            backlog = backlogs[index % count]
            cached = worker.cache.lookup(live.key, live.group, live.shared, prompt)
            score = self.prefix_weight * (cached / prompt if prompt else 0.0)
            score += self.queue_weight * ((high - backlog) / spread if spread else 1.0)
            if worker is bound:
                score += self.session_weight
            if score > best_score:
                best, best_score = worker, score
        return best


class Operator(Strategy):
    """sessionfleet: the shared placement function, then hard affinity.

    A session's first turn is placed by :func:`~sessionfleet.policy.placement.place`
    (a child on its parent's worker when it has room, otherwise the least-loaded
    worker by pinned sessions and KV); every later turn goes to the bound worker. The
    simulation carries out drains and recoveries with the operator's policies.
    """

    name = "operator"
    description = "sessionfleet: policy.placement.place, then bound; drains and recovery by policy"
    operator = True

    def __init__(self, label: str = "") -> None:
        self._label = label

    @property
    def label(self) -> str:
        """``operator`` and its drain settings."""
        return f"operator ({self._label})" if self._label else self.name

    def route(self, fleet: FleetView, live: Live, now: float) -> Worker | None:
        """Return the bound worker, or place the session."""
        bound = live.worker
        if bound is not None:
            # A bound session goes back to its worker; while that worker is down the
            # simulation holds the turn (Restoring) or retries it (not yet noticed).
            return bound if bound.up else None
        return self.place(fleet, live, now)

    def place(self, fleet: FleetView, live: Live, now: float) -> Worker | None:
        """Place a new session with the operator's placement function."""
        config = fleet.config
        parent = live.parent
        parent_worker = (
            parent.worker.name
            if parent is not None and parent.worker is not None and live.turn == 0
            else None
        )
        session = live.session
        tokens = live.prompt + (session.new_tokens[live.turn] if live.turn < live.turns else 0)
        request = PlacementRequest(
            model=config.model, parent_worker=parent_worker, expected_tokens=tokens
        )
        # A draining worker is not ready for placement (worker_loads), as in the operator.
        loads = worker_loads(fleet.workers, config, now)
        placement = place(request, loads)
        if placement.worker is None:
            return None
        return fleet.by_name[placement.worker]


STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (RoundRobin, LeastLoaded, HardAffinity, GatedAffinity, LlmdScheduler, Operator)
}
"""Every strategy by name, in the order tables show them."""
