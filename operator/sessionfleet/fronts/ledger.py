"""Usage per session, aggregated in memory and flushed as coalesced status patches.

Writing a session's status once per turn would put one API write behind every model
call of every agent. Instead each router replica adds a turn's usage to a pending delta
per session (:meth:`UsageLedger.record`) and a flush loop writes a session's delta at
most once per interval (:meth:`UsageLedger.due`), however many turns it had.

Several router replicas serve the same sessions, so a flush writes totals computed
from the status it last observed plus its own delta, with that status's
``resourceVersion`` as a precondition (:func:`status_patch`): a replica that raced
another gets a 409, re-reads the object and recomputes, and no replica's turns are lost
or counted twice.

A write whose answer never came (a timeout, a broken connection, a 5xx) may still
have been applied. So each write also records, in ``status.usageWrites`` under the
replica's name, its *write id* (:meth:`UsageLedger.next_write_id`: increasing, the
Unix time in milliseconds), and the delta of a write without an answer is kept as
*unconfirmed* under that id instead of being merged back into the pending turns. The
next write reads the replica's id in the status it is based on: the unconfirmed
deltas up to that id were applied and are dropped (:meth:`UsageLedger.confirm`), the
others are written again. Deciding from a stale copy is safe: the write then carries
a stale ``resourceVersion`` and gets a 409, and the retry decides from a fresh read.
Only the failure path reads again; a write that was answered costs one PATCH.

Pure: no I/O, and time is passed in (tests use virtual time).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from sessionfleet.engines.vllm import Usage
from sessionfleet.resources.times import rfc3339
from sessionfleet.resources.usage import UsageFigures, usage_status_patch

__all__ = [
    "Totals",
    "UsageLedger",
    "rfc3339",
    "status_patch",
    "write_marks",
    "turn_totals",
    "usage_figures",
]

_EARLIEST: Final = 1e-6
"""A first-turn time before any real turn (0 means none)."""
WRITE_MARK_TTL: Final = 3600.0
"""Seconds after which another replica's write id is dropped from ``status.usageWrites``.

A replica reads its own id back at its next flush, seconds after a write without an
answer; an id an hour old belongs to a replica long gone, and dropping it keeps the map
from growing with every router pod that ever served the session."""


@dataclass(slots=True)
class Totals:
    """Usage counters of a session: observed in its status, or pending in a delta.

    Recomputed tokens are the prompt tokens not served from cache, except those of
    the session's first turn (its prefix is new by nature). Which turn is first is
    not known where a turn is answered: another replica may hold an earlier one not
    yet written, or this replica's table may not yet show a write that landed. So the
    totals carry the earliest turn they include (its start time and its uncached
    tokens) and :meth:`add` keeps the earlier of two; recomputed tokens are derived
    from that. Adding is then commutative and associative, and the status is exact
    whatever order deltas are written in.
    """

    turns: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    last_activity: float = 0.0
    """Unix time of the last completed turn; 0 when unknown."""
    first_turn_at: float = 0.0
    """Unix time the earliest counted turn started; 0 when none is counted."""
    first_turn_uncached: int = 0
    """Prompt tokens of that turn not served from cache."""

    @property
    def recomputed_tokens(self) -> int:
        """Prompt tokens not served from cache after the first turn."""
        return max(0, self.prompt_tokens - self.cached_tokens - self.first_turn_uncached)

    def _first(self, other: Totals) -> Totals:
        if not other.first_turn_at:
            return self
        if not self.first_turn_at:
            return other
        mine = (self.first_turn_at, -self.first_turn_uncached)
        theirs = (other.first_turn_at, -other.first_turn_uncached)
        return self if mine <= theirs else other

    def add(self, other: Totals) -> Totals:
        """Return the sum of two sets of counters (the earlier first turn, the later activity)."""
        first = self._first(other)
        return Totals(
            self.turns + other.turns,
            self.prompt_tokens + other.prompt_tokens,
            self.cached_tokens + other.cached_tokens,
            self.completion_tokens + other.completion_tokens,
            max(self.last_activity, other.last_activity),
            first.first_turn_at,
            first.first_turn_uncached,
        )

    @classmethod
    def from_status(cls, status: dict[str, Any]) -> Totals:
        """Read the router-owned counters of an AgentSession status."""

        def count(key: str) -> int:
            value = status.get(key)
            return value if isinstance(value, int) and value >= 0 else 0

        totals = cls(
            count("turns"),
            count("promptTokens"),
            count("cachedTokens"),
            count("completionTokens"),
            _timestamp(status.get("lastActivity")),
            _timestamp(status.get("firstTurnAt")),
            count("firstTurnUncachedTokens"),
        )
        if totals.turns and not totals.first_turn_at:
            # Written before the first turn was recorded: every turn it counts came
            # before anything this router adds, and its recomputed figure stands.
            totals.first_turn_at = _EARLIEST
            totals.first_turn_uncached = max(
                0, totals.prompt_tokens - totals.cached_tokens - count("recomputedTokens")
            )
        return totals


def _timestamp(value: Any) -> float:
    if not isinstance(value, str):
        return 0.0
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def turn_totals(usage: Usage | None, *, started: float, now: float) -> Totals:
    """Return the counters one turn adds: it started at ``started`` and ended ``now``.

    A turn without usage (an engine started without usage reporting) still counts as
    a turn.
    """
    if usage is None:
        return Totals(turns=1, last_activity=now, first_turn_at=started)
    cached = min(usage.cached_tokens or 0, usage.prompt_tokens)
    return Totals(
        turns=1,
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=cached,
        completion_tokens=usage.completion_tokens,
        last_activity=now,
        first_turn_at=started,
        first_turn_uncached=usage.prompt_tokens - cached,
    )


def usage_figures(total: Totals) -> UsageFigures:
    """Return the status figures of ``total``: its counters, hit rate and first turn.

    The hit rate is rounded to two decimals and capped at 100 (an observed status may
    count more cached than prompt tokens). The last activity is left out while unknown,
    and the first turn while only a placeholder (:data:`_EARLIEST`) stands for it.
    """
    hit_rate = 100.0 * total.cached_tokens / total.prompt_tokens if total.prompt_tokens else 0.0
    first_turn_known = total.first_turn_at > _EARLIEST
    return UsageFigures(
        turns=total.turns,
        prompt_tokens=total.prompt_tokens,
        cached_tokens=total.cached_tokens,
        completion_tokens=total.completion_tokens,
        recomputed_tokens=total.recomputed_tokens,
        hit_rate_percent=round(min(hit_rate, 100.0), 2),
        last_activity=total.last_activity or None,
        first_turn_at=total.first_turn_at if first_turn_known else None,
        first_turn_uncached_tokens=total.first_turn_uncached,
    )


def status_patch(
    observed: Totals,
    delta: Totals,
    resource_version: str,
    marks: Mapping[str, int | None] | None = None,
) -> dict[str, Any]:
    """Return the merge patch that adds ``delta`` to the ``observed`` status.

    The ``resourceVersion`` makes it conditional: the API server answers 409 when the
    object changed since it was observed, and the caller re-reads and retries. ``marks``
    (:func:`write_marks`) record which write this is. The ledger decides the figures;
    :func:`sessionfleet.resources.usage.usage_status_patch` shapes the body from the
    AgentSession status model.
    """
    return usage_status_patch(usage_figures(observed.add(delta)), resource_version, marks)


def write_marks(observed: Mapping[str, int], replica: str, write_id: int) -> dict[str, int | None]:
    """Return the ``usageWrites`` merge of a write: its id, and null for stale ids of others.

    An id is also the Unix time in milliseconds it was taken at, so ids older than
    :data:`WRITE_MARK_TTL` are known to be stale from the id alone.
    """
    horizon = write_id - WRITE_MARK_TTL * 1000
    marks: dict[str, int | None] = {
        name: None for name, other in observed.items() if name != replica and other < horizon
    }
    marks[replica] = write_id
    return marks


class UsageLedger:
    """Pending usage per session and when each session was last flushed."""

    def __init__(self, interval: float) -> None:
        if interval <= 0:
            raise ValueError("the flush interval must be positive")
        self.interval = interval
        self._pending: dict[str, Totals] = {}
        self._flushed_at: dict[str, float] = {}
        self._urgent: set[str] = set()
        self._unconfirmed: dict[str, dict[int, Totals]] = {}
        """Deltas of writes that got no answer, by the id of the write that first carried them."""
        self._last_write_id = 0

    def __len__(self) -> int:
        return len(self._pending.keys() | self._unconfirmed.keys())

    def sessions(self) -> list[str]:
        """Sessions with a delta not yet written, or written without an answer."""
        return list(dict.fromkeys([*self._pending, *self._unconfirmed]))

    def pending(self, session: str) -> Totals | None:
        """Return the delta not yet written for ``session``, if any."""
        return self._pending.get(session)

    def record(self, session: str, turn: Totals, *, urgent: bool = False) -> None:
        """Add one turn's counters; ``urgent`` (the session's final turn) skips the interval."""
        current = self._pending.get(session)
        self._pending[session] = turn if current is None else current.add(turn)
        if urgent:
            self._urgent.add(session)

    def due(self, now: float, limit: int | None = None) -> list[str]:
        """Return sessions with a delta whose last flush is at least one interval old.

        At most ``limit`` of them, those that became pending first.
        """
        due: list[str] = []
        for session in self.sessions():
            if (
                session in self._urgent
                or now - self._flushed_at.get(session, float("-inf")) >= self.interval
            ):
                due.append(session)
                if limit is not None and len(due) >= limit:
                    break
        return due

    def take(self, session: str, now: float) -> Totals | None:
        """Remove and return a session's delta to write it; counts as a flush at ``now``.

        None when there is nothing to write; an empty delta when only unconfirmed
        writes are left to settle (:meth:`confirm`).
        """
        self._urgent.discard(session)
        delta = self._pending.pop(session, None)
        if delta is None and session in self._unconfirmed:
            delta = Totals()
        if delta is not None:
            self._flushed_at[session] = now
        return delta

    def next_write_id(self, now: float, after: int | None = None) -> int:
        """Return a new write id: the Unix time in milliseconds, above every earlier id.

        ``after`` is this replica's id in the status as last seen: a process restarted
        under the same name (a container restart keeps the pod's name) with a clock set
        back must still write ids above its predecessor's.
        """
        self._last_write_id = max(self._last_write_id + 1, int(now * 1000), (after or 0) + 1)
        return self._last_write_id

    def unanswered(self, session: str, write_id: int, delta: Totals) -> None:
        """Keep the delta of a write that got no answer: it may have been applied.

        It is settled by :meth:`confirm` at the session's next write, which is due after
        the interval as any other.
        """
        if delta != Totals():
            self._unconfirmed.setdefault(session, {})[write_id] = delta

    def confirm(self, session: str, applied: int | None) -> Totals:
        """Settle unconfirmed writes against ``applied``, the replica's id in a status.

        The writes up to ``applied`` were applied (each write carried every unconfirmed
        delta before it, and a replica's writes are applied in order, each conditional
        on the status the one before left): they are dropped. Return the sum of the
        others, to be written again.
        """
        writes = self._unconfirmed.get(session)
        if not writes:
            return Totals()
        if applied is not None:
            for write_id in [w for w in writes if w <= applied]:
                del writes[write_id]
        if not writes:
            del self._unconfirmed[session]
        rest = Totals()
        for delta in writes.values():
            rest = rest.add(delta)
        return rest

    def forget(self, session: str) -> None:
        """Drop everything about a session (its object was deleted)."""
        self._pending.pop(session, None)
        self._unconfirmed.pop(session, None)
        self._flushed_at.pop(session, None)
        self._urgent.discard(session)

    def prune(self, now: float) -> None:
        """Forget flush times older than an interval: they no longer hold a session back."""
        stale = [s for s, t in self._flushed_at.items() if now - t >= self.interval]
        for session in stale:
            if session not in self._pending and session not in self._unconfirmed:
                del self._flushed_at[session]
