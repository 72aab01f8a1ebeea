"""The EPP's choice of endpoints for one request, from the in-memory bindings alone.

The same decisions as the router's (docs/router.md, "A turn, step by step"), from the
same shared parts: the session identity from the headers
(:func:`sessionfleet.fronts.identity.identify`), the binding table fed by the LIST and
WATCH of :mod:`sessionfleet.fronts.kubesync`, a bound session's worker
(:func:`sessionfleet.fronts.routing.bound_worker`), the placement of a new session
(:func:`sessionfleet.policy.placement.place`) and the new-session rate limit
(:class:`sessionfleet.fronts.admission.NewSessionLimiter`), per client: keyed on GAIE's
fairness id header when the gateway sends one (:func:`~sessionfleet.fronts.requester.fairness_key`),
else one key for every request.

What differs is that the EPP answers Envoy before the AgentSession of a new session
exists: the choice is remembered here (:attr:`EndpointPicker.provisional`) until the
create, made off the hot path, lands in the table, so that a second turn arriving
meanwhile goes to the same worker.

Two rules of the EPP's own (docs/epp.md): with an InferencePool (:class:`PoolFilter`)
only the workers it reaches are chosen, named at its target port; and the model to route
by is :meth:`EndpointPicker.target_model` (the rewrite header, a served model, an
adapter of the only base model, or none: any Ready worker).

Pure: no I/O; time is passed in.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import urlsplit

from sessionfleet.fronts.admission import NewSessionLimiter, SessionRates
from sessionfleet.fronts.bindings import BindingTable, SessionView, WorkerView
from sessionfleet.fronts.errors import RouterError
from sessionfleet.fronts.identity import (
    HeaderConfig,
    Identity,
    IdentityError,
    identify,
    session_object_name,
)
from sessionfleet.fronts.requester import fairness_key
from sessionfleet.fronts.routing import bound_worker
from sessionfleet.policy.placement import PlacementRequest, place


class PoolFilter(Protocol):
    """The InferencePool's view of the workers (:class:`sessionfleet.epp.pool.PoolView`)."""

    def address(self, worker: WorkerView) -> str | None:
        """Return ``ip:port`` under the pool, None when the pool does not reach ``worker``."""


MODEL_HEADER = "x-gateway-model-name"
"""Where GAIE's body-based router puts the model when the EPP sees no body."""
REWRITE_HEADER = "x-gateway-model-name-rewrite"
"""GAIE's model rewrite: the model to route by instead of the one the body names."""
MAX_TRACKED_CLIENTS = 16384
"""Fairness ids with a rate-limit bucket of their own at most; the least recently seen
are forgotten first (about 310 bytes each with the longest key, 128 characters: 5 MiB
in all, measured with tracemalloc)."""


def endpoint_address(url: str) -> str:
    """Return ``ip:port`` (the protocol's endpoint format) of a worker's endpoint URL."""
    parts = urlsplit(url if "//" in url else f"//{url}")
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{host}:{port}"


@dataclass(frozen=True, slots=True)
class PickerConfig:
    """How the EPP chooses (the ``epp`` command's flags)."""

    headers: HeaderConfig = field(default_factory=HeaderConfig)
    fallbacks: int = 2
    """Endpoints offered after the first for new sessions and stateless requests."""
    retry_after: int = 5
    session_rates: SessionRates = field(default_factory=SessionRates)


@dataclass(frozen=True, slots=True)
class NewSession:
    """A session first seen here: its AgentSession is to be created off the hot path."""

    identity: Identity
    model: str
    worker: str


@dataclass(frozen=True, slots=True)
class Route:
    """Send the request to ``workers[0]``; Envoy may retry down the rest in order."""

    workers: tuple[WorkerView, ...]
    identity: Identity | None = None
    session: str | None = None
    """The AgentSession's object name, for a turn counted to a session."""
    new: NewSession | None = None
    addresses: tuple[str, ...] = ()
    """The workers as the data plane reaches them (under an InferencePool: its target
    port); empty: their own endpoints."""
    model: str | None = None
    """The model routed by (``target_model_name``), None when the request named none."""

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The workers as ``ip:port``, in order."""
        if self.addresses:
            return self.addresses
        return tuple(endpoint_address(w.endpoint or "") for w in self.workers)


@dataclass(frozen=True, slots=True)
class Held:
    """The session cannot be served now, for the reason given; it may be soon."""

    session_id: str
    reason: str


Decision = Route | Held


class EndpointPicker:
    """Chooses endpoints from a :class:`BindingTable`; see the module."""

    def __init__(
        self,
        table: BindingTable,
        config: PickerConfig,
        now: float = 0.0,
        pool: PoolFilter | None = None,
    ) -> None:
        self.table = table
        self.config = config
        self.pool = pool
        """The InferencePool the EPP serves (``--pool-name``); None: every worker."""
        self.limiter = NewSessionLimiter(config.session_rates, now, max_clients=MAX_TRACKED_CLIENTS)
        self.provisional: dict[str, NewSession] = {}
        """New sessions placed here whose AgentSession is not in the table yet, by name."""
        self._turn = itertools.count()

    def created(self, name: str) -> None:
        """Forget a provisional choice: its create ended (the table holds the result)."""
        self.provisional.pop(name, None)

    def served_by(self, name: str, worker: str) -> None:
        """Move a provisional new session to the worker that served its first turn."""
        pending = self.provisional.get(name)
        if pending is not None and pending.worker != worker:
            self.provisional[name] = NewSession(pending.identity, pending.model, worker)

    def address(self, worker: WorkerView) -> str | None:
        """Return ``ip:port`` the data plane reaches ``worker`` at; None: not in the pool."""
        if self.pool is None:
            return endpoint_address(worker.endpoint or "")
        return self.pool.address(worker)

    def model_of(self, headers: Mapping[str, str]) -> str | None:
        """Return the model when the headers name it, or the fleet serves only one."""
        model = headers.get(MODEL_HEADER)
        if model:
            return model.strip()
        models = self._served_models()
        return models.pop() if len(models) == 1 else None

    def _served_models(self) -> set[str]:
        return {w.model for w in self.table.workers.values() if self.address(w) is not None}

    def target_model(self, requested: str | None, headers: Mapping[str, str]) -> str | None:
        """Return the model to route by (docs/epp.md, "Models"); None: any worker.

        ``x-gateway-model-name-rewrite`` wins; a model some worker's ``spec.model``
        names is itself; any other name (a LoRA adapter, an alias) is the base model when
        the pool's workers serve only one, else None: the request goes to any Ready
        worker, whose engine answers for the name.
        """
        rewrite = (headers.get(REWRITE_HEADER) or "").strip()
        model = rewrite or requested
        if model is None or self.table.has_model(model):
            return model
        models = self._served_models()
        return models.pop() if len(models) == 1 else None

    def pick(
        self,
        headers: Mapping[str, str],
        model: str | None,
        subset: frozenset[str] | None,
        now: float,
    ) -> Decision:
        """Decide for one request; raise :class:`RouterError` for an answer of the EPP's own.

        ``headers`` are looked up by lower-case name; ``model`` is None when neither
        the body nor the headers name it; ``subset`` is the data plane's subset hint
        (None without one): only those ``ip:port`` endpoints may be chosen.
        """
        if subset is not None and not subset:
            raise RouterError(503, "no_ready_worker", "the endpoint subset is empty", retry_after=1)
        try:
            identity = identify(headers, self.config.headers)
        except IdentityError as error:
            raise RouterError(400, "invalid_session_id", str(error)) from error
        model = self.target_model(model, headers)
        if identity is not None:
            decision = self._session(identity, model, subset, now, fairness_key(headers))
            if decision is not None:
                return decision
        return self._route(self._stateless(model, subset), model=model)

    def _route(self, workers: tuple[WorkerView, ...], **fields: object) -> Route:
        addresses = tuple(self.address(w) or "" for w in workers)
        return Route(workers, addresses=addresses, **fields)  # type: ignore[arg-type]

    def _allowed(self, worker: WorkerView, subset: frozenset[str] | None) -> bool:
        address = self.address(worker)
        return address is not None and (subset is None or address in subset)

    def _session(
        self,
        identity: Identity,
        model: str | None,
        subset: frozenset[str] | None,
        now: float,
        requester: str = "",
    ) -> Decision | None:
        """Decide for a session's turn; None: route it statelessly (another model).

        ``requester`` is who a new session counts against (:func:`fairness_key`).
        """
        name = session_object_name(identity.session_id, None)
        known = self.table.session_named(name)
        if known is not None:
            self.provisional.pop(name, None)
            if known.session_id != identity.session_id or known.owner is not None:
                raise RouterError(
                    409,
                    "session_name_collision",
                    f"AgentSession {known.name} belongs to another session or client",
                )
            if model is not None and known.model != model:
                return None
            return self._bound(known, identity, subset)
        pending = self.provisional.get(name)
        if pending is not None:
            if model is not None and pending.model != model:
                return None
            worker = self.table.workers.get(pending.worker)
            if worker is None or not worker.serving:
                return Held(identity.session_id, f"is placed on {pending.worker}, not serving")
            if not self._allowed(worker, subset):
                raise self._outside(identity.session_id, worker)
            return self._route((worker,), identity=identity, session=name, model=pending.model)
        if model is None:
            return None  # nothing to place a new session by: served, not recorded
        return self._new(identity, name, model, subset, now, requester)

    def _bound(
        self, session: SessionView, identity: Identity, subset: frozenset[str] | None
    ) -> Decision:
        decision = bound_worker(self.table, session)
        if isinstance(decision, str):
            return Held(session.session_id, decision)
        if not self._allowed(decision, subset):
            raise self._outside(session.session_id, decision)
        # No fallback: another worker would recompute the session's whole prefix and
        # serve it away from its binding.
        return self._route(
            (decision,), identity=identity, session=session.name, model=session.model
        )

    def _outside(self, session_id: str, worker: WorkerView) -> RouterError:
        where = "the endpoint subset" if self.pool is None else "the endpoint subset or the pool"
        return RouterError(
            503,
            "no_ready_worker",
            f"session {session_id} is on worker {worker.name}, outside {where}",
            retry_after=self.config.retry_after,
        )

    def _new(
        self,
        identity: Identity,
        name: str,
        model: str,
        subset: frozenset[str] | None,
        now: float,
        requester: str,
    ) -> Route:
        parent = (
            self.table.session_named(session_object_name(identity.parent_id, None))
            if identity.parent_id
            else None
        )
        excluded = frozenset(
            w.name for w in self.table.workers.values() if not self._allowed(w, subset)
        )
        request = PlacementRequest(
            model=model, parent_worker=parent.worker if parent else None, exclude=excluded
        )
        placement = place(request, self.table.loads())
        if placement.worker is None:
            if not self.table.has_model(model):
                raise RouterError(404, "model_not_found", f"no InferenceWorker serves {model!r}")
            if placement.reason.value == "NoCapacity":
                # Shed for saturation, as the protocol's flow-control case answers: the
                # workers are up but full; 503 is kept for "nothing can serve".
                raise RouterError(
                    429, "no_capacity", placement.message, retry_after=self.config.retry_after
                )
            raise RouterError(
                503, "no_ready_worker", placement.message, retry_after=self.config.retry_after
            )
        wait = self.limiter.admit(requester, now)
        if wait:
            raise RouterError(
                429,
                "too_many_new_sessions",
                "too many new sessions; established sessions are not limited",
                retry_after=wait,
            )
        chosen = [placement.worker]
        # Fallbacks: the next choices of the same placement function.
        while len(chosen) <= self.config.fallbacks:
            request = PlacementRequest(model=model, exclude=excluded | frozenset(chosen))
            following = place(request, self.table.loads()).worker
            if following is None:
                break
            chosen.append(following)
        new = NewSession(identity, model, placement.worker)
        self.provisional[name] = new
        workers = tuple(self.table.workers[w] for w in chosen)
        return self._route(workers, identity=identity, session=name, new=new, model=model)

    def _stateless(
        self, model: str | None, subset: frozenset[str] | None
    ) -> tuple[WorkerView, ...]:
        """Ready workers of ``model`` (None: of any model), least busy first."""
        candidates = [
            w
            for w in self.table.workers.values()
            if (model is None or w.model == model) and w.ready and self._allowed(w, subset)
        ]
        if not candidates:
            if model is not None and not self.table.has_model(model):
                raise RouterError(404, "model_not_found", f"no InferenceWorker serves {model!r}")
            where = " in the endpoint subset" if subset is not None else ""
            where += " in the pool" if self.pool is not None else ""
            serving = f"serving {model!r} " if model is not None else ""
            raise RouterError(
                503,
                "no_ready_worker",
                f"no InferenceWorker {serving}is Ready{where}",
                retry_after=self.config.retry_after,
            )
        # Fewest requests in flight from this EPP first; ties rotate.
        turn = next(self._turn)
        ordered = sorted(
            enumerate(candidates),
            key=lambda pair: (pair[1].in_flight, (pair[0] - turn) % len(candidates)),
        )
        return tuple(w for _, w in ordered[: 1 + self.config.fallbacks])
