"""What the next pass of the fleet loop reconciles: what events touched, and what is due.

A pass used to plan every worker and every session, so its cost grew with the fleet
even when one session changed. Now each event marks the objects it affects (see
:mod:`.handlers`), and a pass takes:

- the workers and sessions marked since the last pass;
- the workers whose plan depends on the clock (draining, recovering, starting, on a
  NotReady node, taking periodic checkpoints: :func:`sessionfleet.policy.worker.settled`
  is False), on every pass;
- the sessions waiting for a worker with room, on every pass (placement may change with
  any worker's load);
- what a deadline made due: a session's idle timeout or TTL, a worker's coalesced
  status write, a retry after a failed reconcile.

A full pass (every worker, every session) still runs on its own slower timer as the
safety net, and as the first pass of a new leader.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

from sessionfleet.controllers.records import Key

WORKERS: Final = "inferenceworkers"
SESSIONS: Final = "agentsessions"


def counter_interval(floor: float, workers: int, writes_per_second: float) -> float:
    """Return how long a worker's counters wait between writes (seconds).

    ``floor`` seconds, or longer where ``workers`` would otherwise write more than
    ``writes_per_second``.

    Counters (pinned and active sessions, KV usage, hit rate) move with every bind,
    finish and scrape, so under churn each worker's are due once per interval: with
    500 workers and 5 seconds, 100 status writes a second, each also an event for
    every watcher of workers (this operator's kopf, the routers, the endpoint picker).
    The interval grows with the fleet instead, so those writes stay within a budget
    whatever its size; phase, epoch and conditions never wait.
    """
    if writes_per_second <= 0:
        return floor
    return max(floor, workers / writes_per_second)


@dataclass
class Deadlines:
    """When each key is due next: one deadline per key, taken in time order.

    A key rescheduled leaves its old heap entry behind; the entry is skipped when it
    surfaces, and the heap is rebuilt once stale entries outnumber live ones, so it
    stays within about twice the number of keys however often they move.
    """

    _at: dict[Key, float] = field(default_factory=dict)
    _heap: list[tuple[float, Key]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self._at)

    def schedule(self, key: Key, when: float | None) -> None:
        """Make ``key`` due at ``when`` (seconds, any clock the caller keeps to); None: never."""
        if when is None:
            self._at.pop(key, None)
            return
        if self._at.get(key) == when:
            return
        self._at[key] = when
        heapq.heappush(self._heap, (when, key))
        if len(self._heap) > 2 * len(self._at) + 64:
            self._heap = [(at, k) for k, at in self._at.items()]
            heapq.heapify(self._heap)

    def earlier(self, key: Key, when: float) -> None:
        """Make ``key`` due at ``when`` unless it is due sooner already."""
        current = self._at.get(key)
        if current is None or when < current:
            self.schedule(key, when)

    def due(self, now: float) -> list[Key]:
        """Remove and return the keys due at ``now``, earliest first."""
        keys = []
        while self._heap and self._heap[0][0] <= now:
            when, key = heapq.heappop(self._heap)
            if self._at.get(key) == when:
                del self._at[key]
                keys.append(key)
        return keys


@dataclass(frozen=True, slots=True)
class Batch:
    """The objects one pass reconciles; ``full``: every one of them."""

    full: bool
    workers: frozenset[Key] = frozenset()
    sessions: frozenset[Key] = frozenset()
    policies: bool = True
    """Whether the DrainPolicies' statuses may have changed (see :attr:`WorkQueue.policies`)."""


@dataclass
class WorkQueue:
    """Marks left by events and deadlines, taken by the fleet loop one pass at a time.

    Times: ``wall`` deadlines are seconds since the epoch (sessions' idle timeouts and
    TTLs come from timestamps in their status); ``mono`` ones are ``time.monotonic()``
    (retries and coalesced writes, which no other clock should move).
    """

    full_every: float = 60.0
    workers: set[Key] = field(default_factory=set)
    sessions: set[Key] = field(default_factory=set)
    unsettled: set[Key] = field(default_factory=set)
    """Workers looked at on every pass: their plan depends on the clock."""
    waiting: set[Key] = field(default_factory=set)
    """Sessions that found no worker with room: tried again on every pass."""
    session_deadlines: Deadlines = field(default_factory=Deadlines)
    """Sessions' idle timeouts and TTLs (wall clock)."""
    later: dict[str, Deadlines] = field(
        default_factory=lambda: {WORKERS: Deadlines(), SESSIONS: Deadlines()}
    )
    """Retries and coalesced writes (monotonic clock), by resource (its plural)."""
    briefs: dict[Key, object] = field(default_factory=dict)
    """What each worker's sessions last read of it (:func:`.sessions.worker_brief`):
    its sessions are marked only when that changes."""
    views: dict[Key, object] = field(default_factory=dict)
    """What the DrainPolicies' statuses last read of each worker (its labels, policy
    reference, whether it drains): they are computed again only when that changes."""
    policies: bool = True
    """Whether a DrainPolicy or what the policies read of a worker changed since the
    last pass that wrote their statuses."""
    full_due: float = 0.0
    """When the next full pass is due (monotonic); 0: the very next pass."""

    def worker(self, key: Key) -> None:
        """Mark a worker: an event touched it."""
        self.workers.add(key)

    def session(self, key: Key) -> None:
        """Mark a session: an event touched it."""
        self.sessions.add(key)

    def each_session(self, keys: Iterable[Key]) -> None:
        """Mark sessions: an event touched what they read (their worker)."""
        self.sessions.update(keys)

    def retry(self, kind: str, key: Key, at: float) -> None:
        """Look at an object again at ``at`` (monotonic), or sooner if it is due sooner."""
        self.later[kind].earlier(key, at)

    def settle(self, key: Key, settled: bool) -> None:
        """Record whether a worker's plan can change with no event (see the module doc)."""
        if settled:
            self.unsettled.discard(key)
        else:
            self.unsettled.add(key)

    def forget_session(self, key: Key) -> None:
        """Drop a deleted session's marks and deadlines."""
        self.sessions.discard(key)
        self.waiting.discard(key)
        self.session_deadlines.schedule(key, None)
        self.later[SESSIONS].schedule(key, None)

    def forget_worker(self, key: Key) -> None:
        """Drop a deleted worker's standing marks (a last pass still sees its deletion)."""
        self.unsettled.discard(key)
        self.later[WORKERS].schedule(key, None)
        self.views.pop(key, None)
        self.policies = True

    def worker_counted(self, key: Key, pinned_before: int, pinned_now: int, at: float) -> None:
        """Mark a worker whose counts a session event moved, or let its counters wait.

        Only a worker whose pinned count crosses zero must be looked at now (its hold
        goes up or comes down); for any other its status counters are all that
        changed, written at most once per :func:`counter_interval`: it is due at ``at``.
        Marking every bound worker on every session event cost a reconcile of most
        workers on every pass at 150 binds a second (make bench-scale).
        """
        if (pinned_before == 0) != (pinned_now == 0):
            self.workers.add(key)
        else:
            self.later[WORKERS].earlier(key, at)

    def take(self, wall: float, mono: float) -> Batch:
        """Return what this pass reconciles and clear the marks it consumes."""
        if mono >= self.full_due:
            self.full_due = mono + self.full_every
            self.workers.clear()
            self.sessions.clear()
            self.policies = False
            self.session_deadlines.due(wall)
            for deadlines in self.later.values():
                deadlines.due(mono)
            return Batch(full=True)
        workers = self.workers | self.unsettled
        workers.update(self.later[WORKERS].due(mono))
        sessions = self.sessions | self.waiting
        sessions.update(self.session_deadlines.due(wall))
        sessions.update(self.later[SESSIONS].due(mono))
        policies, self.policies = self.policies, False
        self.workers = set()
        self.sessions = set()
        return Batch(
            full=False,
            workers=frozenset(workers),
            sessions=frozenset(sessions),
            policies=policies,
        )
