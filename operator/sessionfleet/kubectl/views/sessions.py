"""``kubectl sessionfleet sessions``: one row or record per session, and phase totals.

A session's context is the operator's own estimate
(:func:`~sessionfleet.policy.holds.context_tokens`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, Final

from sessionfleet.api import (
    AgentSession,
    SessionPhase,
)
from sessionfleet.kubectl.views.format import (
    NONE,
    age_of,
    nothing_found,
    percent,
    table,
    tokens,
    wire_time,
)
from sessionfleet.kubectl.views.snapshot import Body, created_at, identity
from sessionfleet.policy import holds

NEW: Final = "New"
"""The phase shown for a session the operator has not handled yet (no status phase)."""
SESSION_PHASES: Final = (NEW, *(phase.value for phase in SessionPhase))
"""Session phases in the order they are counted and shown."""


def session_phase(session: AgentSession) -> str:
    """Return the session's phase, :data:`NEW` while the operator has not handled it."""
    return session.status.phase.value if session.status.phase is not None else NEW


def context_tokens(session: AgentSession) -> int:
    """Return the operator's estimate of the session's prefix: its mean prompt per turn.

    The same figure placement weighs against a worker's KV capacity
    (``SessionState.context_tokens``); 0 before the first turn is counted.
    """
    return holds.context_tokens(session.status.prompt_tokens, session.status.turns)


def phase_totals(sessions: Iterable[AgentSession]) -> dict[str, int]:
    """Return the number of sessions in each phase, in :data:`SESSION_PHASES` order."""
    counts = Counter(session_phase(s) for s in sessions)
    return {phase: counts[phase] for phase in SESSION_PHASES if counts[phase]}


def describe_totals(totals: Mapping[str, int]) -> str:
    """Return ``5 (Bound 4, Pending 1)``, or ``0``."""
    total = sum(totals.values())
    if not total:
        return "0"
    return f"{total} (" + ", ".join(f"{phase} {n}" for phase, n in totals.items()) + ")"


SESSION_HEADERS: Final = ("id", "phase", "worker", "turns", "context", "hit%", "age")


def session_record(session: AgentSession, now: datetime) -> dict[str, Any]:
    """Return one session as ``--output json`` shows it."""
    status = session.status
    created = created_at(session.metadata)
    return {
        "namespace": session.metadata.namespace,
        "name": session.metadata.name,
        "id": session.spec.session_id,
        "model": session.spec.model,
        "phase": session_phase(session),
        "worker": status.worker,
        "turns": status.turns or 0,
        "contextTokens": context_tokens(session),
        "hitRatePercent": status.hit_rate_percent,
        "createdAt": wire_time(created) if created is not None else None,
        "ageSeconds": int((now - created).total_seconds()) if created is not None else None,
    }


def session_rows(
    sessions: Iterable[AgentSession], now: datetime, *, with_namespace: bool = False
) -> tuple[tuple[str, ...], list[list[str]]]:
    """Return the headers and rows of ``kubectl sessionfleet sessions``, sorted by id."""
    headers = (("namespace",) if with_namespace else ()) + SESSION_HEADERS
    rows = []
    for session in sorted(
        sessions, key=lambda s: (s.metadata.namespace, s.spec.session_id, s.metadata.name)
    ):
        status = session.status
        row = [
            session.spec.session_id,
            session_phase(session),
            status.worker or NONE,
            str(status.turns or 0),
            tokens(context_tokens(session)),
            percent(status.hit_rate_percent),
            age_of(created_at(session.metadata), now),
        ]
        rows.append(([session.metadata.namespace] if with_namespace else []) + row)
    return headers, rows


def sessions_text(sessions: Sequence[AgentSession], now: datetime, namespace: str | None) -> str:
    """Return the whole output of ``kubectl sessionfleet sessions``."""
    if not sessions:
        return nothing_found("sessions", namespace)
    return table(*session_rows(sessions, now, with_namespace=namespace is None))


def matching_sessions(bodies: Iterable[Body], key: str) -> list[Body]:
    """Return the sessions whose object name or ``spec.sessionId`` is ``key``.

    The name wins: a session named ``key`` is the only answer even if another session's
    id is ``key`` too.
    """
    listed = list(bodies)
    by_name = [b for b in listed if identity(b)[1] == key]
    if by_name:
        return by_name
    return [b for b in listed if (b.get("spec") or {}).get("sessionId") == key]
