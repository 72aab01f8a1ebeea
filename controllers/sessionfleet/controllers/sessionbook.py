"""The operator's book of AgentSessions: what the watch shows and what is in flight.

Sessions, counted in tens of thousands, come from the operator's own watch
(:mod:`.sessionwatch` keeps :attr:`SessionBook.cache`); the rest of the book covers
the gap between a write and the watch event that reports it back, and the counts
placement reads:

- :class:`BindingLedger` counts sessions bound but not yet seen bound, so a burst of
  new sessions is spread over workers instead of piling onto the one that looked
  least loaded a moment ago;
- :class:`~.loads.WorkerLoads` and :class:`~.loads.PlacementViews` keep placement's
  view of each worker up to date as events arrive instead of counting per placement;
- the sessions being written or deleted, and the turns session writes take.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from sessionfleet.controllers.engines import EngineStats
from sessionfleet.controllers.indexes import Indexes
from sessionfleet.controllers.loads import PlacementViews, WorkerLoads, placement_identity
from sessionfleet.controllers.records import Key, WorkerRecord
from sessionfleet.controllers.sessioncache import SessionCache
from sessionfleet.controllers.turns import WriteTurns
from sessionfleet.policy.placement import WorkerLoad
from sessionfleet.policy.sessions import SessionState


@dataclass
class BindingLedger:
    """Bindings written but not yet observed, counted per worker.

    The counts are kept as bindings are added and settled, so that placing a session
    costs nothing per binding in flight: in a burst there are thousands.
    """

    pending: dict[Key, tuple[str, int]] = field(default_factory=dict)
    unseen: Counter[Key] = field(default_factory=Counter)
    """Pending bindings per (namespace, worker)."""
    touched: set[Key] = field(default_factory=set)
    """Workers whose count changed since placement last read them (it clears this)."""

    def add(self, session: Key, worker: str, tokens: int) -> None:
        """Record a binding we just wrote."""
        self.settle(session)
        self.pending[session] = (worker, tokens)
        self.unseen[(session[0], worker)] += 1
        self.touched.add((session[0], worker))

    def settle(self, session: Key) -> None:
        """Forget a binding the index now shows."""
        entry = self.pending.pop(session, None)
        if entry is not None:
            worker = (session[0], entry[0])
            self.unseen[worker] -= 1
            self.touched.add(worker)
            if self.unseen[worker] <= 0:
                del self.unseen[worker]

    def observe(self, session: Key, worker: str | None) -> None:
        """Settle the session's binding once the watch shows it bound where we wrote."""
        entry = self.pending.get(session)
        if entry is not None and entry[0] == worker:
            self.settle(session)


@dataclass
class SessionBook:
    """Every AgentSession the operator knows of, and its session bookkeeping."""

    cache: SessionCache = field(default_factory=SessionCache)
    """Every AgentSession, written by :mod:`.sessionwatch` only (from its watch)."""
    sources: int = 1
    """How many AgentSession watches list before the fleet counts as indexed (set once,
    by :mod:`sessionfleet.operator.main`)."""
    ledger: BindingLedger = field(default_factory=BindingLedger)
    """Bindings :mod:`.sessions` wrote; settled by :mod:`.sessions` and by
    :mod:`.sessionwatch` as the watch shows each one."""
    worker_loads: WorkerLoads = field(default_factory=WorkerLoads)
    """Pinned sessions and tokens per worker, as the session events showed them: counted
    by :mod:`.sessionwatch`, checked and put right by :mod:`.loop`'s full pass."""
    placement: PlacementViews = field(default_factory=PlacementViews)
    """Placement's view of each namespace's workers, kept between placements: told of
    worker changes by :mod:`.handlers` and of engine figures and full passes by
    :mod:`.loop`."""
    busy: set[Key] = field(default_factory=set)
    """Sessions :mod:`.sessions` is writing now (it alone adds and removes them)."""
    deleted: dict[Key, int] = field(default_factory=dict)
    """Sessions :mod:`.sessions` deleted, with their resourceVersion, until the index
    drops them (:meth:`forget_deleted`, called by :mod:`.loop`)."""
    writes: WriteTurns = field(default_factory=lambda: WriteTurns(16))
    """Turns for session writes, the most urgent first (:mod:`.turns`), taken by
    :mod:`.sessions`."""

    def sessions_of(self, key: Key) -> list[SessionState]:
        """Return the sessions whose status binds them to the worker."""
        return self.cache.of_worker(key)

    def all_sessions(self) -> list[SessionState]:
        """Return every session."""
        return self.cache.all()

    def session(self, namespace: str, name: str) -> SessionState | None:
        """Return one session's state."""
        return self.cache.get((namespace, name))

    def worker_of_session_id(self, namespace: str, session_id: str) -> str | None:
        """Return the worker a session id is bound to (for a child's parent)."""
        parent = self.cache.pinned_with_id(namespace, session_id)
        return parent.worker if parent is not None else None

    def forget_deleted(self) -> None:
        """Drop the deleted sessions the index no longer shows (or shows created anew)."""
        for key, version in list(self.deleted.items()):
            seen = self.session(*key)
            if seen is None or seen.resource_version > version:
                del self.deleted[key]

    def loads(
        self, namespace: str, indexes: Indexes, engines: Mapping[Key, EngineStats]
    ) -> list[WorkerLoad]:
        """Return placement's view of the namespace's workers, unseen bindings added.

        Session events settle the ledger as the watch shows each binding, and count
        the binding in :attr:`worker_loads` in the same step. The view is kept between
        placements (:class:`PlacementViews`): only the workers whose counts or engine
        figures changed since are looked at again. Callers must not change it.
        """
        views = self.placement
        for changed in (self.worker_loads.touched, self.ledger.touched):
            views.touched |= changed
            changed.clear()

        return views.view(
            namespace,
            lambda: [
                load for r in indexes.all_workers() if (load := self._load(r, namespace, engines))
            ],
            lambda key: self._load(indexes.worker(*key), namespace, engines),
        )

    def _load(
        self, record: WorkerRecord | None, namespace: str, engines: Mapping[Key, EngineStats]
    ) -> WorkerLoad | None:
        if record is None or record.namespace != namespace:
            return None
        identity = placement_identity(record)
        if identity is None:
            return None
        model, ready, max_sessions, kv_tokens = identity
        key = record.key
        engine = engines.get(key)
        return WorkerLoad(
            name=record.name,
            model=model,
            ready=ready,
            pinned_sessions=self.worker_loads.pinned.get(key, 0) + self.ledger.unseen.get(key, 0),
            max_sessions=max_sessions,
            kv_tokens_capacity=kv_tokens,
            kv_tokens_pinned=self.worker_loads.tokens.get(key, 0),
            kv_usage=(engine.kv_usage or 0.0) if engine is not None else 0.0,
        )


__all__ = ["BindingLedger", "SessionBook"]
