"""The operator's in-memory picture of the fleet, shared by every handler.

Kopf indexes hold what its watches observed of workers, pods, nodes and the other
kinds counted in hundreds; AgentSessions, counted in tens of thousands, come from the
operator's own watch (:mod:`.sessionwatch`, :mod:`.sessioncache`). Two small overlays
cover the gap between a write and the watch event that reports it back:

- :class:`Freshness` remembers the resourceVersion each of our writes produced, so a
  reconcile that reads an older copy of the object waits instead of writing again
  (this is what keeps a session at three operator writes in its life);
- :class:`BindingLedger` counts sessions bound but not yet seen bound, so a burst of
  new sessions is spread over workers instead of piling onto the one that looked
  least loaded a moment ago.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Coroutine, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from sessionfleet.api import CheckpointDriver, DrainPolicySpec
from sessionfleet.checkpoint import Driver
from sessionfleet.controllers import metrics
from sessionfleet.controllers.config import OperatorConfig
from sessionfleet.controllers.faults import Faults
from sessionfleet.controllers.loads import PlacementViews, WorkerLoads, placement_identity
from sessionfleet.controllers.records import Key, PolicyRecord, WorkerRecord, resource_version
from sessionfleet.controllers.sessioncache import SessionCache
from sessionfleet.controllers.turns import WriteTurns
from sessionfleet.controllers.work import WorkQueue, counter_interval
from sessionfleet.kube import Kube
from sessionfleet.leader import Leadership, Solo
from sessionfleet.policy.checkpoint import CheckpointState
from sessionfleet.policy.events import Notice
from sessionfleet.policy.handshake import RouterLease
from sessionfleet.policy.observed import NodeState, PodState
from sessionfleet.policy.placement import WorkerLoad
from sessionfleet.policy.recovery import NodeRecoveryGate
from sessionfleet.policy.sessions import SessionState
from sessionfleet.resources.events import ObjectRef

log = logging.getLogger(__name__)

UNPARSED = "the spec could not be parsed"
"""The problem reported for a DrainPolicy whose parse gave no message."""


class Recorder(Protocol):
    """What the fleet needs of the Event recorder (:mod:`.events`)."""

    def record(self, regarding: ObjectRef, notice: Notice) -> None:
        """Note one decision; never blocks, never raises."""


class Store(Protocol):
    """The read-only view kopf gives of one index: key to the values stored under it."""

    def get(self, key: Any, default: Any = None) -> Any:
        """Return the values under ``key``, or ``default``."""

    def __iter__(self) -> Iterator[Any]: ...
    def __len__(self) -> int: ...
    def __getitem__(self, key: Any) -> Iterable[Any]: ...


@dataclass
class Freshness:
    """The resourceVersions our own writes produced, per object."""

    written: dict[Key, int] = field(default_factory=dict)

    def mark(self, key: Key, body: Mapping[str, Any]) -> None:
        """Remember the version a write returned."""
        self.written[key] = resource_version(body)

    def is_stale(self, key: Key, observed_version: int) -> bool:
        """Whether ``observed_version`` predates our last write; forget it once caught up."""
        written = self.written.get(key)
        if written is None:
            return False
        if observed_version >= written:
            del self.written[key]
            return False
        return True


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


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine figures scraped from a worker's ``/metrics``."""

    kv_usage: float | None = None
    prefix_hits: float | None = None
    prefix_queries: float | None = None
    running: int | None = None
    waiting: int | None = None
    ignored: tuple[str, ...] = ()
    """Metrics the engine reported as NaN or infinite, which were left out."""


@dataclass
class Fleet:
    """Everything the handlers share: clients, indexes, overlays and wake-ups."""

    config: OperatorConfig
    kube: Kube
    http: httpx.AsyncClient
    workers: Store | None = None
    worker_pods: Store | None = None
    pdbs: Store | None = None
    engine_policies: Store | None = None
    sessions: SessionCache = field(default_factory=SessionCache)
    """Every AgentSession, from the operator's own watch (:mod:`.sessionwatch`)."""
    session_sources: int = 1
    """How many AgentSession watches list before the fleet counts as indexed."""
    kopf_indexed: bool = False
    """Whether kopf has filled its indexes (it calls event handlers only then)."""
    checkpoints: Store | None = None
    router_leases: Store | None = None
    nodes: Store | None = None
    policies: Store | None = None
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    indexed: asyncio.Event = field(default_factory=asyncio.Event)
    freshness: Freshness = field(default_factory=Freshness)
    faults: Faults = field(default_factory=Faults)
    """Objects whose last reconcile failed (controllers/sessionfleet/controllers/faults.py)."""
    node_gate: NodeRecoveryGate = field(default_factory=lambda: NodeRecoveryGate(0))
    """This pass's budget for moving workers off NotReady nodes (set by the loop)."""
    node_moves: dict[Key, float] = field(default_factory=dict)
    """Workers this process moved off a NotReady node (monotonic time of the write),
    until the index shows them Recovering: the node gate counts them meanwhile."""
    ledger: BindingLedger = field(default_factory=BindingLedger)
    worker_loads: WorkerLoads = field(default_factory=WorkerLoads)
    """Pinned sessions and tokens per worker, as the session events showed them."""
    placement: PlacementViews = field(default_factory=PlacementViews)
    """Placement's view of each namespace's workers, kept between placements."""
    work: WorkQueue = field(default_factory=WorkQueue)
    """What the next pass of the fleet loop reconciles."""
    stats: dict[Key, EngineStats] = field(default_factory=dict)
    kv_store_health: dict[str, str | None] = field(default_factory=dict)
    """By ``namespace/name``: None while the worker's KV store is writable, else why not
    (controllers/kvstores.py); absent until the store first answered."""
    hold_writes: dict[tuple[str, Key], float] = field(default_factory=dict)
    """Hold changes written but not yet seen in the indexes: (what, object) to when
    (monotonic), so a pass does not write them again while the watch catches up."""
    busy_sessions: set[Key] = field(default_factory=set)
    deleted_sessions: dict[Key, int] = field(default_factory=dict)
    """Sessions we deleted, with their resourceVersion, until the index drops them."""
    status_written_at: dict[Key, float] = field(default_factory=dict)
    """When each worker's status was last written (monotonic), to coalesce counters."""
    drivers: dict[CheckpointDriver, Driver] = field(default_factory=dict)
    running_checkpoints: set[Key] = field(default_factory=set)
    created_checkpoints: set[Key] = field(default_factory=set)
    """WorkerCheckpoints this process created: its own work in flight. Which ones any
    replica created, the objects show themselves (:mod:`.provenance`)."""
    checkpoint_key: bytes | None = None
    """The key that signs and verifies the operator's checkpoints, once read."""
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    """Work started with :meth:`spawn` and still running."""
    spawn_failures: int = 0
    """How many spawned tasks raised (also the metric ``..._spawned_failures_total``)."""
    spawning_stopped: bool = False
    """Set by :meth:`cancel_spawned`: no work starts any more (leadership is ending)."""
    writes: WriteTurns = field(default_factory=lambda: WriteTurns(16))
    """Turns for session writes, the most urgent first (:mod:`.turns`)."""
    events: Recorder | None = None
    """Where decisions become Kubernetes Events (none: not recorded, as in unit tests)."""
    leadership: Leadership = field(default_factory=Solo)
    """Whether this replica may write; ``kube`` refuses writes while it may not."""
    gauges_at: float = float("-inf")
    """When the fleet loop last exported the session and worker gauges (monotonic)."""
    loop_pass_at: float | None = None
    """When the fleet loop last finished a pass (monotonic), for the liveness probe."""

    def spawn(self, name: str, work: Coroutine[Any, Any, None]) -> None:
        """Run slow work (a checkpoint, a migration through one) beside the loop.

        The loop is woken when it ends; an exception is logged with its traceback and
        counted, and the work's own objects say what failed in their status. Once
        :meth:`cancel_spawned` has run (the replica stops leading), nothing starts.
        """
        if self.spawning_stopped:
            work.close()  # never awaited: close it so Python does not warn
            log.info("%s not started: this replica is giving up the lead", name)
            return
        task = asyncio.create_task(work, name=name)
        self.tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self.wakeup.set()
        if not task.cancelled() and (error := task.exception()) is not None:
            self.spawn_failures += 1
            metrics.SPAWNED_FAILURES.inc()
            log.error("%s failed", task.get_name(), exc_info=error)

    async def cancel_spawned(self) -> None:
        """Cancel every spawned task and wait until each has ended; start none after.

        Called before the Lease is released (or when it was lost): a checkpoint or a
        migration half way through must not go on acting on workers, through the API or
        an engine, once a standby may lead.
        """
        self.spawning_stopped = True
        running = list(self.tasks)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        if running:
            log.info("cancelled %d spawned tasks before giving up the lead", len(running))

    def notify(self, regarding: ObjectRef, notice: Notice) -> None:
        """Record a decision as an Event about ``regarding`` (coalesced, in the background)."""
        if self.events is not None:
            self.events.record(regarding, notice)

    def update_indexed(self) -> None:
        """Set :attr:`indexed` once kopf's indexes and every session watch have listed."""
        if self.kopf_indexed and len(self.sessions.listed) >= self.session_sources:
            self.indexed.set()

    def forget_deleted(self) -> None:
        """Drop the deleted sessions the index no longer shows (or shows created anew)."""
        for key, version in list(self.deleted_sessions.items()):
            seen = self.session(*key)
            if seen is None or seen.resource_version > version:
                del self.deleted_sessions[key]

    # --- reads --------------------------------------------------------------------

    def worker(self, namespace: str, name: str) -> WorkerRecord | None:
        """Return the worker's record, if the index has it."""
        record: WorkerRecord | None = _one(self.workers, (namespace, name))
        return record

    def counter_interval(self) -> float:
        """How long a worker's counters wait between writes, with this many workers."""
        return counter_interval(
            self.config.status_coalesce_seconds,
            len(self.workers) if self.workers is not None else 0,
            self.config.counter_writes_per_second,
        )

    def all_workers(self) -> list[WorkerRecord]:
        """Return every worker record."""
        if self.workers is None:
            return []
        return [record for key in list(self.workers) for record in self.workers[key]]

    def has_pdb(self, key: Key) -> bool:
        """Whether the worker's hold PodDisruptionBudget exists (as the index shows it)."""
        return bool(self.pdbs.get(key)) if self.pdbs is not None else False

    def pdb_uid(self, key: Key) -> str | None:
        """Return the uid of the worker's hold PodDisruptionBudget, as the index shows it."""
        found = self.pdbs.get(key) if self.pdbs is not None else None
        for _, uid in found or ():
            return str(uid) or None
        return None

    def engine_policy_hash(self, key: Key) -> str | None:
        """Return the spec hash of the worker's engine NetworkPolicy, as the index shows it."""
        if self.engine_policies is None:
            return None
        hashes = list(self.engine_policies.get(key, ()))
        return hashes[0] if hashes else None

    def pods_of(self, key: Key) -> list[PodState]:
        """Return the worker's pods, every epoch."""
        return list(self.worker_pods.get(key, ())) if self.worker_pods is not None else []

    def node(self, name: str | None) -> NodeState | None:
        """Return the node's state, if known."""
        state: NodeState | None = _one(self.nodes, name) if name else None
        return state

    def all_nodes(self) -> list[NodeState]:
        """Return every node the index holds."""
        if self.nodes is None:
            return []
        return [state for key in list(self.nodes) for state in self.nodes[key]]

    def policies_in(self, namespace: str) -> list[PolicyRecord]:
        """Return the DrainPolicies of a namespace."""
        return list(self.policies.get(namespace, ())) if self.policies is not None else []

    def policy_specs(self, namespace: str) -> tuple[dict[str, DrainPolicySpec], dict[str, str]]:
        """Return a namespace's DrainPolicies as ``resolve_policy`` reads them.

        The specs that parsed, by name, and the others' parse problems, by name: a
        worker that references an invalid policy is told so, not that it does not exist.
        """
        records = self.policies_in(namespace)
        parsed = {p.name: p.spec for p in records if p.spec is not None}
        invalid = {p.name: p.invalid or UNPARSED for p in records if p.spec is None}
        return parsed, invalid

    def all_policies(self) -> list[PolicyRecord]:
        """Return every DrainPolicy record, of every namespace."""
        if self.policies is None:
            return []
        return [record for key in list(self.policies) for record in self.policies[key]]

    def checkpoints_of(self, key: Key) -> list[CheckpointState]:
        """Return the worker's WorkerCheckpoints."""
        return list(self.checkpoints.get(key, ())) if self.checkpoints is not None else []

    def routers(self) -> list[RouterLease]:
        """Return the router replicas' Leases, live or not."""
        return list(self.router_leases.get("routers", ())) if self.router_leases else []

    def sessions_of(self, key: Key) -> list[SessionState]:
        """Return the sessions whose status binds them to the worker."""
        return self.sessions.of_worker(key)

    def all_sessions(self) -> list[SessionState]:
        """Return every session."""
        return self.sessions.all()

    def session(self, namespace: str, name: str) -> SessionState | None:
        """Return one session's state."""
        return self.sessions.get((namespace, name))

    def worker_of_session_id(self, namespace: str, session_id: str) -> str | None:
        """Return the worker a session id is bound to (for a child's parent)."""
        parent = self.sessions.pinned_with_id(namespace, session_id)
        return parent.worker if parent is not None else None

    def loads(self, namespace: str) -> list[WorkerLoad]:
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
            lambda: [load for r in self.all_workers() if (load := self._load(r, namespace))],
            lambda key: self._load(self.worker(*key), namespace),
        )

    def _load(self, record: WorkerRecord | None, namespace: str) -> WorkerLoad | None:
        if record is None or record.namespace != namespace:
            return None
        identity = placement_identity(record)
        if identity is None:
            return None
        model, ready, max_sessions, kv_tokens = identity
        key = record.key
        engine = self.stats.get(key)
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


def _one(store: Store | None, key: Any) -> Any:
    if store is None:
        return None
    values = store.get(key)
    if not values:
        return None
    return next(iter(values), None)
