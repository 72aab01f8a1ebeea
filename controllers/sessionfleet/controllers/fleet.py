"""The operator's in-memory picture of the fleet, shared by every handler.

Fleet holds what every controller shares (configuration, API clients, leadership,
the loop's wake-ups, the work queue, the Event hook) and one part per concern, each
written by the controller module that owns it (its docstrings name the writer):

- :class:`~.indexes.Indexes`: kopf's indexes of workers, pods, nodes and the other
  kinds counted in hundreds, and the reads over them;
- :class:`~.sessionbook.SessionBook`: AgentSessions, counted in tens of thousands, from
  the operator's own watch (:mod:`.sessionwatch`), with the binding ledger and the
  loads placement reads;
- :class:`~.checkpointwork.CheckpointWork`, :class:`~.spawner.Spawner`,
  :class:`~.workerwrites.WorkerWrites` and :class:`~.engines.EngineReports`.

:class:`Freshness` covers the gap between any controller's write and the watch event
that reports it back: it remembers the resourceVersion each of our writes produced, so
a reconcile that reads an older copy of the object waits instead of writing again (this
is what keeps a session at three operator writes in its life).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from sessionfleet.controllers.checkpointwork import CheckpointWork
from sessionfleet.controllers.config import OperatorConfig
from sessionfleet.controllers.engines import EngineReports, EngineStats
from sessionfleet.controllers.faults import Faults
from sessionfleet.controllers.indexes import Indexes
from sessionfleet.controllers.leadership import Leadership, Solo
from sessionfleet.controllers.records import Key, resource_version
from sessionfleet.controllers.sessionbook import SessionBook
from sessionfleet.controllers.spawner import Spawner
from sessionfleet.controllers.work import WorkQueue, counter_interval
from sessionfleet.controllers.workerwrites import WorkerWrites
from sessionfleet.kube import Kube
from sessionfleet.policy.events import Notice
from sessionfleet.policy.placement import WorkerLoad
from sessionfleet.resources.events import ObjectRef

log = logging.getLogger(__name__)


class Recorder(Protocol):
    """What the fleet needs of the Event recorder (:mod:`.events`)."""

    def record(self, regarding: ObjectRef, notice: Notice) -> None:
        """Note one decision; never blocks, never raises."""


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
class LoopMarks:
    """When the fleet loop last did what it does; written by :mod:`.loop` only."""

    gauges_at: float = float("-inf")
    """When the fleet loop last exported the session and worker gauges (monotonic)."""
    pass_at: float | None = None
    """When the fleet loop last finished a pass (monotonic), for the liveness probe."""


@dataclass
class Fleet:
    """What the handlers share, and the parts each controller owns."""

    config: OperatorConfig
    kube: Kube
    http: httpx.AsyncClient
    indexes: Indexes = field(default_factory=Indexes)
    sessions: SessionBook = field(default_factory=SessionBook)
    engines: EngineReports = field(default_factory=EngineReports)
    checkpointing: CheckpointWork = field(default_factory=CheckpointWork)
    worker_writes: WorkerWrites = field(default_factory=WorkerWrites)
    loop_marks: LoopMarks = field(default_factory=LoopMarks)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    indexed: asyncio.Event = field(default_factory=asyncio.Event)
    spawner: Spawner = field(init=False)
    """Slow work beside the loop; it sets :attr:`wakeup` as each ends."""
    freshness: Freshness = field(default_factory=Freshness)
    """Marked by every controller that writes an object, read before its next write."""
    faults: Faults = field(default_factory=Faults)
    """Objects whose last reconcile failed (controllers/sessionfleet/controllers/faults.py)."""
    work: WorkQueue = field(default_factory=WorkQueue)
    """What the next pass of the fleet loop reconciles (marked by every controller)."""
    events: Recorder | None = None
    """Where decisions become Kubernetes Events (none: not recorded, as in unit tests)."""
    leadership: Leadership = field(default_factory=Solo)
    """Whether this replica may write; ``kube`` refuses writes while it may not."""

    def __post_init__(self) -> None:
        self.spawner = Spawner(self.wakeup)

    def notify(self, regarding: ObjectRef, notice: Notice) -> None:
        """Record a decision as an Event about ``regarding`` (coalesced, in the background)."""
        if self.events is not None:
            self.events.record(regarding, notice)

    def update_indexed(self) -> None:
        """Set :attr:`indexed` once kopf's indexes and every session watch have listed."""
        if self.indexes.kopf_indexed and len(self.sessions.cache.listed) >= self.sessions.sources:
            self.indexed.set()

    def counter_interval(self) -> float:
        """How long a worker's counters wait between writes, with this many workers."""
        return counter_interval(
            self.config.status_coalesce_seconds,
            self.indexes.worker_count(),
            self.config.counter_writes_per_second,
        )

    def loads(self, namespace: str) -> list[WorkerLoad]:
        """Return placement's view of the namespace's workers (:meth:`SessionBook.loads`)."""
        return self.sessions.loads(namespace, self.indexes, self.engines.stats)


__all__ = ["EngineStats", "Fleet", "Freshness", "LoopMarks", "Recorder"]
