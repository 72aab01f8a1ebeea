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

Pure: no I/O, and time is passed in (tests use virtual time).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sessionfleet.engines.vllm import Usage


@dataclass(slots=True)
class Totals:
    """Usage counters of a session: observed in its status, or pending in a delta."""

    turns: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    recomputed_tokens: int = 0
    last_activity: float = 0.0
    """Unix time of the last completed turn; 0 when unknown."""

    def add(self, other: Totals) -> Totals:
        """Return the sum of two sets of counters (the later activity wins)."""
        return Totals(
            self.turns + other.turns,
            self.prompt_tokens + other.prompt_tokens,
            self.cached_tokens + other.cached_tokens,
            self.completion_tokens + other.completion_tokens,
            self.recomputed_tokens + other.recomputed_tokens,
            max(self.last_activity, other.last_activity),
        )

    @classmethod
    def from_status(cls, status: dict[str, Any]) -> Totals:
        """Read the router-owned counters of an AgentSession status."""

        def count(key: str) -> int:
            value = status.get(key)
            return value if isinstance(value, int) and value >= 0 else 0

        last = status.get("lastActivity")
        activity = 0.0
        if isinstance(last, str):
            try:
                activity = datetime.fromisoformat(last.replace("Z", "+00:00")).timestamp()
            except ValueError:
                activity = 0.0
        return cls(
            count("turns"),
            count("promptTokens"),
            count("cachedTokens"),
            count("completionTokens"),
            count("recomputedTokens"),
            activity,
        )


def turn_totals(usage: Usage | None, *, first_turn: bool, now: float) -> Totals:
    """Return the counters one turn adds.

    Recomputed tokens are prompt tokens not served from cache after the session's
    first turn (the first turn's prefix is new by nature): work a miss made the engine
    redo. A turn without usage (an engine started without usage reporting) still
    counts as a turn.
    """
    if usage is None:
        return Totals(turns=1, last_activity=now)
    cached = usage.cached_tokens or 0
    return Totals(
        turns=1,
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=cached,
        completion_tokens=usage.completion_tokens,
        recomputed_tokens=0 if first_turn else usage.prompt_tokens - cached,
        last_activity=now,
    )


def rfc3339(timestamp: float) -> str:
    """Return a Unix time as the API server writes times: ``2026-11-29T14:00:00Z``."""
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def status_patch(observed: Totals, delta: Totals, resource_version: str) -> dict[str, Any]:
    """Return the merge patch that adds ``delta`` to the ``observed`` status.

    The ``resourceVersion`` makes it conditional: the API server answers 409 when the
    object changed since it was observed, and the caller re-reads and retries.
    """
    total = observed.add(delta)
    hit_rate = 100.0 * total.cached_tokens / total.prompt_tokens if total.prompt_tokens else 0.0
    status: dict[str, Any] = {
        "turns": total.turns,
        "promptTokens": total.prompt_tokens,
        "cachedTokens": total.cached_tokens,
        "completionTokens": total.completion_tokens,
        "recomputedTokens": total.recomputed_tokens,
        "hitRatePercent": round(min(hit_rate, 100.0), 2),
    }
    if total.last_activity:
        status["lastActivity"] = rfc3339(total.last_activity)
    return {"metadata": {"resourceVersion": resource_version}, "status": status}


class UsageLedger:
    """Pending usage per session and when each session was last flushed."""

    def __init__(self, interval: float) -> None:
        if interval <= 0:
            raise ValueError("the flush interval must be positive")
        self.interval = interval
        self._pending: dict[str, Totals] = {}
        self._flushed_at: dict[str, float] = {}
        self._urgent: set[str] = set()

    def __len__(self) -> int:
        return len(self._pending)

    def sessions(self) -> list[str]:
        """Sessions with a delta not yet written."""
        return list(self._pending)

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
        for session in self._pending:
            if (
                session in self._urgent
                or now - self._flushed_at.get(session, float("-inf")) >= self.interval
            ):
                due.append(session)
                if limit is not None and len(due) >= limit:
                    break
        return due

    def take(self, session: str, now: float) -> Totals | None:
        """Remove and return a session's delta to write it; counts as a flush at ``now``."""
        self._urgent.discard(session)
        delta = self._pending.pop(session, None)
        if delta is not None:
            self._flushed_at[session] = now
        return delta

    def give_back(self, session: str, delta: Totals) -> None:
        """Return a delta whose write failed; it is merged with turns recorded since."""
        self.record(session, delta)

    def forget(self, session: str) -> None:
        """Drop everything about a session (its object was deleted)."""
        self._pending.pop(session, None)
        self._flushed_at.pop(session, None)
        self._urgent.discard(session)

    def prune(self, now: float) -> None:
        """Forget flush times older than an interval: they no longer hold a session back."""
        stale = [s for s, t in self._flushed_at.items() if now - t >= self.interval]
        for session in stale:
            if session not in self._pending:
                del self._flushed_at[session]
