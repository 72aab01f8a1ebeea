"""Kubernetes Events: what a person would want in ``kubectl describe``, and how often.

Pure. :func:`worker_notices` reads a worker's status before and after a write and says
which decisions it records (a drain started, held, at its deadline, completed; an
epoch replaced; recovery backing off or capped; metrics unreadable; a policy conflict
or a missing policy). The controllers add the notices they know first-hand (a session
bound, rebound or migrated; a checkpoint taken, failed or restored).

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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final

from sessionfleet.api import ConditionStatus, ConditionType, Reason, WorkerPhase

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


def _conditions(status: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {str(c.get("type")): c for c in status.get("conditions") or () if c.get("type")}


def _became(
    old: dict[str, Mapping[str, Any]],
    new: dict[str, Mapping[str, Any]],
    kind: ConditionType,
    status: ConditionStatus,
    reasons: Iterable[Reason] | None = None,
) -> Mapping[str, Any] | None:
    """Return the new condition of ``kind`` if it just took ``status`` (and a reason)."""
    now = new.get(kind.value)
    if now is None or now.get("status") != status.value:
        return None
    wanted = {r.value for r in reasons} if reasons is not None else None
    if wanted is not None and now.get("reason") not in wanted:
        return None
    before = old.get(kind.value)
    if before is not None and (before.get("status"), before.get("reason")) == (
        now.get("status"),
        now.get("reason"),
    ):
        return None
    return now


_POLICY_REASONS: Final = {
    Reason.POLICY_CONFLICT.value: "PolicyConflict",
    Reason.POLICY_NOT_FOUND.value: "PolicyNotFound",
    Reason.POLICY_INVALID.value: "PolicyInvalid",
}


def worker_notices(
    old: Mapping[str, Any],
    new: Mapping[str, Any],
    pinned_sessions: int,
    recovery: Reason | None = None,
) -> list[Notice]:
    """Return the decisions a worker's status write records, as Events.

    ``new`` is ``old`` with the patch applied.

    ``recovery`` is why the plan started a new epoch, when it did.
    """
    notices: list[Notice] = []
    before, after = _conditions(old), _conditions(new)
    old_phase, new_phase = old.get("phase"), new.get("phase")

    if new_phase == WorkerPhase.DRAINING.value and old_phase != new_phase:
        why = (after.get(ConditionType.DRAINING.value) or {}).get("message", "")
        notices.append(Notice(EventType.NORMAL, "DrainStarted", "Drain", why or "drain started"))
    # A hold stands whenever sessions are pinned; a drain is held when it starts with
    # sessions pinned, or when they get pinned while it runs.
    held = after.get(ConditionType.DRAIN_HELD.value) or {}
    was_held = (before.get(ConditionType.DRAIN_HELD.value) or {}).get("status")
    draining = new_phase == WorkerPhase.DRAINING.value
    if (
        draining
        and held.get("status") == ConditionStatus.TRUE.value
        and (old_phase != new_phase or was_held != ConditionStatus.TRUE.value)
    ):
        notices.append(
            Notice(
                EventType.NORMAL,
                "DrainHeld",
                "Drain",
                f"{pinned_sessions} session(s) pinned: {held.get('message') or 'eviction blocked'}",
            )
        )
    deadline = _became(
        before, after, ConditionType.DRAINING, ConditionStatus.TRUE, [Reason.DEADLINE_REACHED]
    )
    if deadline is not None:
        notices.append(
            Notice(
                EventType.NORMAL,
                "DrainDeadlineReached",
                "Drain",
                str(deadline.get("message") or "the drain deadline passed"),
            )
        )
    if new_phase == WorkerPhase.DRAINED.value and old_phase != new_phase:
        notices.append(
            Notice(EventType.NORMAL, "DrainCompleted", "Drain", "no session is pinned any more")
        )

    old_epoch, new_epoch = old.get("epoch"), new.get("epoch")
    if isinstance(new_epoch, int) and isinstance(old_epoch, int) and new_epoch > old_epoch:
        why = recovery.value if recovery is not None else "NewEpoch"
        notices.append(
            Notice(
                EventType.NORMAL,
                "EpochReplaced",
                "Recover",
                f"epoch {new_epoch} replaces epoch {old_epoch}: {why}",
            )
        )

    for status, reason, event in (
        (ConditionStatus.TRUE, Reason.RECOVERY_BACK_OFF, "RecoveryBackingOff"),
        (ConditionStatus.FALSE, Reason.RECOVERY_CAPPED, "RecoveriesCapped"),
        (ConditionStatus.FALSE, Reason.DISRUPTION_THRESHOLD, "RecoveriesCapped"),
    ):
        found = _became(before, after, ConditionType.RECOVERING, status, [reason])
        if found is not None:
            notices.append(
                Notice(EventType.WARNING, event, "Recover", str(found.get("message") or reason))
            )
    metrics = _became(before, after, ConditionType.ENGINE_METRICS, ConditionStatus.FALSE)
    if metrics is not None:
        notices.append(
            Notice(
                EventType.WARNING,
                "MetricsUnreadable",
                "Scrape",
                str(metrics.get("message") or "the engine's metrics could not be used"),
            )
        )
    conflict = _became(before, after, ConditionType.CONFLICT, ConditionStatus.TRUE)
    if conflict is not None:
        event = _POLICY_REASONS.get(str(conflict.get("reason")), "PolicyConflict")
        notices.append(
            Notice(EventType.WARNING, event, "ResolvePolicy", str(conflict.get("message") or ""))
        )
    return notices


def merged(status: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """Return a status with a merge patch applied (top-level keys; ``None`` deletes)."""
    result = dict(status)
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = value
    return result


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
    "merged",
    "worker_notices",
]
