"""The mutable state of a simulation: workers and live sessions.

Plain classes with ``__slots__``: one object per worker and one per live session,
nothing per turn, so a run of millions of turns creates few objects.
"""

from __future__ import annotations

from collections import OrderedDict
from heapq import heappop
from zlib import crc32

from sessionfleet.api import InferenceWorkerStatus
from sessionfleet.fleetsim._cache import PrefixCache
from sessionfleet.workload import Session


class Worker:
    """One worker: its cache, its prefill queue, its in-flight turns and bound sessions."""

    __slots__ = (
        "accepting",
        "bound",
        "cache",
        "checkpoint",
        "draining",
        "epoch",
        "free_at",
        "index",
        "inflight",
        "inflight_tokens",
        "name",
        "pinned_tokens",
        "recovering",
        "status",
        "up",
    )

    def __init__(self, index: int, name: str, kv_tokens: int, block_size: int) -> None:
        self.index = index
        self.name = name
        self.cache = PrefixCache(kv_tokens, block_size)
        self.up = True
        """The pod runs and serves turns."""
        self.accepting = True
        """New sessions may be placed here (not draining, not down)."""
        self.recovering = False
        """The operator is starting a new epoch; bound sessions wait for it."""
        self.draining: object | None = None
        self.epoch = 1
        self.free_at = 0.0
        """When the prefill queue empties."""
        self.inflight: list[tuple[float, int]] = []
        """A heap of (end, tokens) of turns still decoding."""
        self.inflight_tokens = 0
        self.bound: dict[Live, None] = {}
        """Sessions bound here, in binding order (a dict keeps the order deterministic)."""
        self.pinned_tokens = 0
        """The current context of every bound session, summed."""
        self.checkpoint: tuple[float, OrderedDict[int, int]] | None = None
        self.status = InferenceWorkerStatus()
        """What the simulated operator last wrote of the worker (its InferenceWorker status)."""

    def expire(self, now: float) -> None:
        """Forget turns that finished decoding before ``now``."""
        inflight = self.inflight
        while inflight and inflight[0][0] <= now:
            self.inflight_tokens -= heappop(inflight)[1]

    def inflight_count(self, now: float) -> int:
        """Return how many turns are being served at ``now`` (prefilling or decoding)."""
        inflight = self.inflight
        if inflight and inflight[0][0] <= now:
            self.expire(now)
        return len(inflight)

    def backlog(self, now: float) -> float:
        """Seconds of prefill queued ahead of a turn arriving at ``now``."""
        return self.free_at - now if self.free_at > now else 0.0


class Live:
    """A session in progress: which turn is next, its context, its binding."""

    __slots__ = (
        "admitted",
        "arrived",
        "children",
        "expect",
        "group",
        "hash",
        "held_since",
        "hold_until",
        "key",
        "lost",
        "migrating_since",
        "next_child_turn",
        "next_compaction",
        "parent",
        "parent_tokens",
        "parked",
        "prompt",
        "ready_at",
        "retries",
        "route_generation",
        "session",
        "shared",
        "turn",
        "turns",
        "busy_until",
        "worker",
    )

    def __init__(self, session: Session, key: int, group: int, block_size: int) -> None:
        self.session = session
        self.key = key
        self.group = group
        self.shared = session.system_prompt_tokens // block_size * block_size
        self.hash = crc32(session.session_id.encode())
        self.turn = 0
        self.turns = session.turn_count
        self.prompt = 0
        self.expect = 0
        """Aligned tokens of this session's context already computed somewhere."""
        self.worker: Worker | None = None
        self.busy_until = 0.0
        self.hold_until = 0.0
        self.held_since = 0.0
        self.migrating_since: float | None = None
        """While the session is Migrating: when the operator marked it (the handshake)."""
        self.parked = False
        """A turn of this Migrating session waits, unscheduled, until the session moves."""
        self.ready_at = session.arrival
        """When the pending turn was sent: time to first token counts from here."""
        self.lost = False
        self.admitted = False
        """The session holds one of the gateway's admission slots (``admission_cap``)."""
        self.arrived = session.arrival
        """When the session's first turn was sent: its completion time counts from here."""
        self.retries = 0
        """Consecutive tries of the pending turn that found no worker."""
        self.route_generation = -1
        self.parent: Live | None = None
        self.parent_tokens = 0
        self.children: list[Session] = []
        self.next_child_turn = 0
        compactions = session.compactions
        self.next_compaction = compactions[0] if compactions else -1
