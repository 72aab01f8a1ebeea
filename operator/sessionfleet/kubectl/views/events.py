"""The Events and conditions of an object, from either event API, as ``kubectl describe`` shows."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from sessionfleet.api import (
    Condition,
)
from sessionfleet.kubectl.views.format import NONE, age_of, parse_time, table
from sessionfleet.kubectl.views.snapshot import Body


@dataclass(frozen=True)
class EventView:
    """One Event about an object, from events.k8s.io/v1 or core/v1 alike."""

    type: str
    reason: str
    message: str
    source: str
    count: int
    last_seen: datetime | None


def _event_view(body: Body) -> tuple[Body, EventView]:
    """Return the object an event is about and the event, from either API's shape."""
    if "regarding" in body or "note" in body:  # events.k8s.io/v1
        series = body.get("series") or {}
        count = series.get("count") or body.get("deprecatedCount") or 1
        last = (
            parse_time(series.get("lastObservedTime"))
            or parse_time(body.get("eventTime"))
            or parse_time(body.get("deprecatedLastTimestamp"))
        )
        return body.get("regarding") or {}, EventView(
            type=str(body.get("type") or ""),
            reason=str(body.get("reason") or ""),
            message=str(body.get("note") or ""),
            source=str(body.get("reportingController") or ""),
            count=int(count),
            last_seen=last,
        )
    source = body.get("source") or {}
    last = (
        parse_time(body.get("lastTimestamp"))
        or parse_time(body.get("eventTime"))
        or parse_time(body.get("firstTimestamp"))
    )
    return body.get("involvedObject") or {}, EventView(
        type=str(body.get("type") or ""),
        reason=str(body.get("reason") or ""),
        message=str(body.get("message") or ""),
        source=str(body.get("reportingComponent") or source.get("component") or ""),
        count=int(body.get("count") or 1),
        last_seen=last,
    )


def events_about(kind: str, name: str, uid: str, *listings: Iterable[Body]) -> list[EventView]:
    """Return the events about one object, oldest first, from any number of listings.

    Both event APIs serve the same objects, so an event listed twice (same UID) counts
    once. An event that names an object's UID must name this one's: an object deleted
    and created again under its name has other events.
    """
    seen: set[str] = set()
    out = []
    for listing in listings:
        for body in listing:
            event_uid = str((body.get("metadata") or {}).get("uid") or "")
            if event_uid and event_uid in seen:
                continue
            regarding, view = _event_view(body)
            if regarding.get("kind") != kind or regarding.get("name") != name:
                continue
            if uid and regarding.get("uid") and regarding.get("uid") != uid:
                continue
            if event_uid:
                seen.add(event_uid)
            out.append(view)
    _epoch = datetime.min.replace(tzinfo=UTC)
    return sorted(out, key=lambda e: e.last_seen or _epoch)


def events_table(events: Sequence[EventView], now: datetime) -> str:
    """Return events as ``kubectl describe`` lists them, or ``no events``."""
    if not events:
        return "no events"
    rows = [
        [
            e.type or NONE,
            e.reason or NONE,
            age_of(e.last_seen, now) + (f" (x{e.count})" if e.count > 1 else ""),
            e.source or NONE,
            e.message,
        ]
        for e in events
    ]
    return table(("type", "reason", "age", "from", "message"), rows)


def conditions_table(conditions: Sequence[Condition], now: datetime) -> str:
    """Return conditions as rows, or ``no conditions``."""
    if not conditions:
        return "no conditions"
    rows = [
        [c.type.value, c.status.value, c.reason, age_of(c.last_transition_time, now), c.message]
        for c in conditions
    ]
    return table(("type", "status", "reason", "age", "message"), rows)
