"""The router's in-memory view of workers and sessions, fed by watches.

Every turn is routed from here without an API call: the table holds each
InferenceWorker (phase, endpoint, capacity, reported load) and each AgentSession
(its id, model, phase and the worker it is bound to), rebuilt from a LIST on start and
kept current by WATCH events. A router restart therefore loses nothing: the bindings
live in the API server.

A session's worker is ``status.worker`` once the operator has bound it, and until then
``spec.workerPin`` or ``spec.workerHint`` (the creating router's choice), so a session
is routable from the moment it is created, before the operator acts on it.

Pure: no I/O (the watch loops in :mod:`.kubesync` call the ``apply_*`` methods).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from sessionfleet.api import SessionPhase, WorkerPhase
from sessionfleet.api.labels import (
    CREATED_BY_ANNOTATION,
    OWNER_LABEL,
    SERVED_BY_ANNOTATION,
)
from sessionfleet.fronts.ledger import Totals
from sessionfleet.policy.holds import context_tokens, holds_worker, takes_new_sessions
from sessionfleet.policy.placement import WorkerLoad

SERVING_PHASES: Final = frozenset({WorkerPhase.READY.value, WorkerPhase.DRAINING.value})
"""A worker in these phases serves the sessions bound to it (a draining one takes no new)."""
HELD_PHASES: Final = frozenset({SessionPhase.MIGRATING.value, SessionPhase.RESTORING.value})
"""A turn of a session in these phases waits for the operator to bind it again."""


@dataclass(slots=True)
class WorkerView:
    """What the router knows of one InferenceWorker."""

    name: str
    model: str
    phase: str | None
    endpoint: str | None
    max_sessions: int
    kv_tokens: int
    kv_usage: float
    drain_requested: bool = False
    """``spec.drain``: asked to drain, whether or not the operator has acted yet."""
    in_flight: int = 0
    """Requests this router replica has sent to the worker and not finished."""

    @property
    def ready(self) -> bool:
        """Whether new sessions and stateless requests may go here."""
        return takes_new_sessions(self.phase, self.drain_requested) and bool(self.endpoint)

    @property
    def serving(self) -> bool:
        """Whether turns of sessions already bound here may go here."""
        return self.phase in SERVING_PHASES and bool(self.endpoint)

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> WorkerView:
        """Read an InferenceWorker as the API server returns it."""
        spec = obj.get("spec") or {}
        status = obj.get("status") or {}
        capacity = spec.get("capacity") or {}
        usage = status.get("kvCacheUsagePercent")
        return cls(
            name=str(obj["metadata"]["name"]),
            model=str(spec.get("model", "")),
            phase=status.get("phase"),
            endpoint=(status.get("endpoint") or "").rstrip("/") or None,
            max_sessions=int(capacity.get("maxSessions", 32)),
            kv_tokens=int(capacity.get("kvTokens", 0)),
            kv_usage=float(usage) / 100 if isinstance(usage, int | float) else 0.0,
            drain_requested=spec.get("drain") is True,
        )


@dataclass(slots=True)
class SessionView:
    """What the router knows of one AgentSession."""

    name: str
    session_id: str
    model: str
    phase: str | None
    worker: str | None
    finished: bool
    resource_version: str
    usage: Totals = field(default_factory=Totals)
    parent_id: str | None = None
    migrating_since: str | None = None
    """While Migrating: the operator's migratingSince, as written (the handshake's stamp)."""
    acks: dict[str, str] = field(default_factory=dict)
    """Annotations acknowledging a migration, ``ack.sessionfleet.dev/<replica>``."""
    owner: str | None = None
    """The owner label: the authenticated client that created it through a router."""
    uid: str = ""
    usage_writes: dict[str, int] = field(default_factory=dict)
    """``status.usageWrites``: each replica's last applied usage write (:mod:`.ledger`)."""
    created_by: str | None = None
    """The router replica that created it (None: created otherwise, kubectl say)."""
    served_by: str | None = None
    """A replica other than its creator that claimed it before serving a turn of it."""

    @property
    def pins_worker(self) -> bool:
        """Whether it counts against its worker's capacity."""
        return holds_worker(self.worker, self.phase)

    @property
    def context_tokens(self) -> int:
        """The prefix it is estimated to hold in its worker's KV cache, in tokens."""
        return context_tokens(self.usage.prompt_tokens, self.usage.turns)

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> SessionView:
        """Read an AgentSession as the API server returns it."""
        meta = obj["metadata"]
        spec = obj.get("spec") or {}
        status = obj.get("status") or {}
        return cls(
            name=str(meta["name"]),
            session_id=str(spec.get("sessionId", "")),
            model=str(spec.get("model", "")),
            phase=status.get("phase"),
            worker=status.get("worker") or spec.get("workerPin") or spec.get("workerHint"),
            finished=bool(spec.get("finished")),
            resource_version=str(meta.get("resourceVersion", "")),
            usage=Totals.from_status(status),
            parent_id=spec.get("parentSessionId"),
            migrating_since=status.get("migratingSince"),
            acks={
                k: v
                for k, v in (meta.get("annotations") or {}).items()
                if k.startswith("ack.sessionfleet.dev/")
            },
            owner=(meta.get("labels") or {}).get(OWNER_LABEL),
            uid=str(meta.get("uid", "")),
            usage_writes={
                k: v
                for k, v in (status.get("usageWrites") or {}).items()
                if isinstance(v, int) and not isinstance(v, bool)
            },
            created_by=(meta.get("annotations") or {}).get(CREATED_BY_ANNOTATION),
            served_by=(meta.get("annotations") or {}).get(SERVED_BY_ANNOTATION),
        )


class BindingTable:
    """Workers and sessions by name, and who waits for a change."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerView] = {}
        self._by_model: dict[str, list[WorkerView]] = {}
        self._sessions: dict[str, SessionView] = {}
        self._migrating: dict[str, SessionView] = {}
        """The Migrating sessions, which the handshake reads on every change: a drain's
        few hundred among tens of thousands."""
        self._pinned: Counter[str] = Counter()
        self._tokens: Counter[str] = Counter()
        """The pinned sessions' prefix tokens, by worker (as the operator counts them)."""
        self._turn = itertools.count()
        self._changed = asyncio.Event()
        self.workers_synced = False
        self.sessions_synced = False

    # --- reading --------------------------------------------------------------------

    @property
    def synced(self) -> bool:
        """Whether both initial lists have been loaded."""
        return self.workers_synced and self.sessions_synced

    def session_named(self, name: str) -> SessionView | None:
        """Return the session with this object name, if known."""
        return self._sessions.get(name)

    def sessions(self) -> Iterable[SessionView]:
        """Every known session."""
        return self._sessions.values()

    def migrating_sessions(self) -> Iterable[SessionView]:
        """Return the sessions Migrating now (each with the operator's migratingSince)."""
        return self._migrating.values()

    def pinned_sessions(self, worker: str) -> int:
        """Sessions bound to ``worker`` that count against its capacity."""
        return self._pinned[worker]

    def has_model(self, model: str) -> bool:
        """Whether any worker, in any phase, serves ``model``."""
        return bool(self._by_model.get(model))

    def loads(self) -> list[WorkerLoad]:
        """Every worker as the placement function sees it.

        Pinned sessions and their prefix tokens are counted from the sessions this router
        sees, which includes the ones it created a moment ago (the worker's own
        ``pinnedSessions`` status lags until the operator's next write), by the same
        rules as the operator's count (:mod:`sessionfleet.policy.holds`): a worker this
        router finds full, the operator would not admit as the session's hint either.
        """
        return [
            WorkerLoad(
                name=w.name,
                model=w.model,
                ready=w.ready,
                pinned_sessions=self._pinned[w.name],
                max_sessions=w.max_sessions,
                kv_tokens_capacity=w.kv_tokens,
                kv_tokens_pinned=self._tokens[w.name],
                kv_usage=w.kv_usage,
            )
            for w in self.workers.values()
        ]

    def least_loaded(self, model: str) -> WorkerView | None:
        """Return the Ready worker of ``model`` with the fewest requests in flight from here.

        Ties rotate, so that idle workers share stateless requests evenly.
        """
        candidates = [w for w in self._by_model.get(model, ()) if w.ready]
        if not candidates:
            return None
        lowest = min(w.in_flight for w in candidates)
        tied = [w for w in candidates if w.in_flight == lowest]
        return tied[next(self._turn) % len(tied)]

    def rendezvous(self, model: str, key: str) -> WorkerView | None:
        """Return the Ready worker of ``model`` that ``key`` hashes to (rendezvous hashing).

        Every replica that sees the same Ready workers picks the same one, and when a
        worker comes or goes only the keys that hashed to it move.
        """
        best: WorkerView | None = None
        best_score = b""
        for worker in self._by_model.get(model, ()):
            if not worker.ready:
                continue
            score = hashlib.blake2b(f"{key}\0{worker.name}".encode(), digest_size=8).digest()
            if best is None or score > best_score:
                best, best_score = worker, score
        return best

    # --- change notification -----------------------------------------------------------

    def changed(self) -> asyncio.Event:
        """Return an event set at the next change of a worker or session (holds wait on it)."""
        return self._changed

    def _notify(self) -> None:
        # A fresh event per change: every waiter wakes, re-checks its turn, and waits
        # on the new event if it must still wait.
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    # --- writing (from watches and API answers) ---------------------------------------

    def apply_worker(self, obj: Mapping[str, Any]) -> WorkerView:
        """Add or update a worker from its object."""
        view = WorkerView.from_object(obj)
        previous = self.workers.get(view.name)
        if previous is not None:
            view.in_flight = previous.in_flight
            self._unindex_worker(previous)
        self.workers[view.name] = view
        self._by_model.setdefault(view.model, []).append(view)
        self._notify()
        return view

    def remove_worker(self, name: str) -> None:
        """Forget a deleted worker."""
        previous = self.workers.pop(name, None)
        if previous is not None:
            self._unindex_worker(previous)
            self._notify()

    def replace_workers(self, objects: Iterable[Mapping[str, Any]]) -> None:
        """Replace every worker with a fresh list (after a LIST)."""
        in_flight = {name: w.in_flight for name, w in self.workers.items()}
        self.workers.clear()
        self._by_model.clear()
        for obj in objects:
            view = WorkerView.from_object(obj)
            view.in_flight = in_flight.get(view.name, 0)
            self.workers[view.name] = view
            self._by_model.setdefault(view.model, []).append(view)
        self.workers_synced = True
        self._notify()

    def _unindex_worker(self, view: WorkerView) -> None:
        siblings = self._by_model.get(view.model, [])
        self._by_model[view.model] = [w for w in siblings if w.name != view.name]
        if not self._by_model[view.model]:
            del self._by_model[view.model]

    def apply_session(self, obj: Mapping[str, Any]) -> SessionView:
        """Add or update a session from its object.

        The version already held is kept as it is, waking nobody: that is the watch
        bringing back this replica's own write, whose answer was applied already (every
        usage write comes back so; the versions are compared for equality only, as
        they are opaque).
        """
        meta = obj.get("metadata") or {}
        held = self._sessions.get(str(meta.get("name", "")))
        version = str(meta.get("resourceVersion", ""))
        if held is not None and version and held.resource_version == version:
            return held
        view = SessionView.from_object(obj)
        self._drop_session(view.name)
        self._add_session(view)
        self._notify()
        return view

    def remove_session(self, name: str) -> None:
        """Forget a deleted session."""
        if self._drop_session(name):
            self._notify()

    def replace_sessions(self, objects: Iterable[Mapping[str, Any]]) -> None:
        """Replace every session with a fresh list of objects (after a LIST)."""
        self.replace_session_views(SessionView.from_object(obj) for obj in objects)

    def replace_session_views(self, views: Iterable[SessionView]) -> None:
        """Replace every session with a fresh list, read into views as it was listed."""
        self._sessions.clear()
        self._migrating.clear()
        self._pinned.clear()
        self._tokens.clear()
        for view in views:
            self._add_session(view)
        self.sessions_synced = True
        self._notify()

    def _add_session(self, view: SessionView) -> None:
        self._sessions[view.name] = view
        if view.phase == SessionPhase.MIGRATING.value and view.migrating_since is not None:
            self._migrating[view.name] = view
        if view.pins_worker and view.worker is not None:
            self._pinned[view.worker] += 1
            self._tokens[view.worker] += view.context_tokens

    def _drop_session(self, name: str) -> SessionView | None:
        previous = self._sessions.pop(name, None)
        if previous is None:
            return None
        self._migrating.pop(name, None)
        if previous.pins_worker and previous.worker is not None:
            self._pinned[previous.worker] -= 1
            self._tokens[previous.worker] -= previous.context_tokens
            if self._pinned[previous.worker] <= 0:
                del self._pinned[previous.worker]
                del self._tokens[previous.worker]
        return previous
