"""Kubernetes Events: what a person would want in ``kubectl describe``, and how often.

Pure. A :class:`Notice` is one Event to record. The plan that takes a decision carries
its notices (:attr:`sessionfleet.policy.worker.WorkerPlan.notices`: a drain started,
held, at its deadline, completed; an epoch replaced; recovery backing off or capped; a
policy conflict or a missing policy), decided against the status observed, so each
comes once. The controllers add the notices they know first-hand (a session bound,
rebound or migrated; a checkpoint taken, failed or restored; metrics unreadable).

:class:`Coalescer` keeps the API server from paying for bursts: the first notice of a
kind about an object creates an Event, and repeats within :attr:`Coalescer.window`
only count, written back as the Event's ``series`` (count and last time) at most
every :attr:`Coalescer.flush_every` seconds, as client-go's event recorder does with
isomorphic events. Session binds are aggregated further by the caller: they are
recorded on the worker ("SessionsBound"), so a burst of 1,000 binds onto 4 workers is
4 Events and a series update per worker every ``flush_every``.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

MAX_NOTE_CHARS: Final = 1024
"""The API server's limit on an Event's note."""


class EventType(StrEnum):
    """An Event's type."""

    NORMAL = "Normal"
    WARNING = "Warning"


@dataclass(frozen=True, slots=True)
class Notice:
    """One Event to record about an object: type, reason, action and a note for people."""

    type: EventType
    reason: str
    action: str
    note: str

    @property
    def bounded_note(self) -> str:
        """The note cut to the API server's limit."""
        if len(self.note) <= MAX_NOTE_CHARS:
            return self.note
        return self.note[: MAX_NOTE_CHARS - 1] + "…"


@dataclass
class _Entry:
    name: str | None
    """The Event written for this key (None until its create succeeded)."""
    first_seen: float
    last_seen: float
    count: int
    written_count: int
    written_at: float


@dataclass(frozen=True, slots=True)
class SeriesUpdate:
    """Repeats of an Event to write back as its ``series``."""

    key: tuple[str, ...]
    name: str
    count: int
    last_seen: float


@dataclass
class Coalescer:
    """Which notices become new Events, and which only count towards an existing one."""

    window: float = 600.0
    """Repeats within this many seconds of the last one join the same Event."""
    flush_every: float = 30.0
    """The least time between two series updates of one Event."""
    max_keys: int = 10_000
    """Events remembered at most; the least recently seen are forgotten first."""
    _entries: OrderedDict[tuple[str, ...], _Entry] = field(default_factory=OrderedDict)

    def observe(self, key: tuple[str, ...], now: float) -> bool:
        """Count one notice; return whether to create a new Event for it."""
        entry = self._entries.get(key)
        if entry is not None and now - entry.last_seen <= self.window:
            entry.count += 1
            entry.last_seen = now
            self._entries.move_to_end(key)
            return False
        self._entries[key] = _Entry(None, now, now, 1, 1, now)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_keys:
            self._entries.popitem(last=False)
        return True

    def created(self, key: tuple[str, ...], name: str) -> None:
        """Remember the name of the Event created for ``key``."""
        entry = self._entries.get(key)
        if entry is not None:
            entry.name = name

    def forget(self, key: tuple[str, ...]) -> None:
        """Drop a key whose Event could not be written (the next notice creates one)."""
        self._entries.pop(key, None)

    def due(self, now: float, limit: int | None = None) -> list[SeriesUpdate]:
        """Return the series updates to write now; each is then counted as written.

        At most ``limit`` of them (None: all), those written longest ago first: the
        writer's budget is shared fairly, and the others stay due for the next call.
        With a series on each of 500 workers, every one due each ``flush_every``
        would otherwise be 17 writes a second.
        """
        ready: list[tuple[float, tuple[str, ...]]] = []
        for key, entry in list(self._entries.items()):
            if now - entry.last_seen > self.window:
                del self._entries[key]
                continue
            if entry.name is None or entry.count == entry.written_count:
                continue
            if now - entry.written_at < self.flush_every:
                continue
            ready.append((entry.written_at, key))
        if limit is not None and len(ready) > limit:
            ready = heapq.nsmallest(max(limit, 0), ready)
        updates = []
        for _, key in ready:
            entry = self._entries[key]
            updates.append(SeriesUpdate(key, entry.name or "", entry.count, entry.last_seen))
            entry.written_count = entry.count
            entry.written_at = now
        return updates

    def __len__(self) -> int:
        return len(self._entries)


__all__ = [
    "MAX_NOTE_CHARS",
    "Coalescer",
    "EventType",
    "Notice",
    "SeriesUpdate",
]
