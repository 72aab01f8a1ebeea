"""events.k8s.io/v1 Events: pure builders.

Like the other core kinds (:mod:`.pods`, :mod:`.leases`), an Event has no pydantic
model here: nothing validates or generates a schema from it. Its keys are written out
in this one place; the operator's recorder only calls these functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, TypedDict

from sessionfleet.policy.events import Notice
from sessionfleet.resources.times import rfc3339

EVENT_API_VERSION: Final = "events.k8s.io/v1"
REPORTING_CONTROLLER: Final = "sessionfleet.dev/operator"
MAX_NAME_LENGTH: Final = 253


class EventMetadata(TypedDict):
    """An Event's ``metadata`` as the operator writes it."""

    name: str
    namespace: str


class EventBody(TypedDict):
    """An ``events.k8s.io/v1`` Event as the operator creates it (``related`` aside).

    A TypedDict, so that a misspelt key is a type error rather than a field the API
    server drops (an Event without ``reportingController`` is refused, one without
    ``regarding`` describes nothing).
    """

    apiVersion: str
    kind: str
    metadata: EventMetadata
    eventTime: str
    reportingController: str
    reportingInstance: str
    action: str
    reason: str
    regarding: dict[str, str]
    note: str
    type: str


class RelatedEventBody(EventBody, total=False):
    """An Event that may also name a second object it concerns."""

    related: dict[str, str]


class EventSeries(TypedDict):
    """An Event's ``series``: how often it recurred and when last."""

    count: int
    lastObservedTime: str


class SeriesPatch(TypedDict):
    """The merge patch that records an Event's repeats."""

    series: EventSeries


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """The object an Event is about (``regarding``) or names besides (``related``)."""

    api_version: str
    kind: str
    namespace: str
    name: str
    uid: str = ""

    def wire(self) -> dict[str, str]:
        """Return the ObjectReference as the API takes it (``kubectl describe`` matches uid)."""
        reference = {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "namespace": self.namespace,
            "name": self.name,
        }
        if self.uid:
            reference["uid"] = self.uid
        return reference


def event_name(regarding: ObjectRef, suffix: str) -> str:
    """``<object>.<suffix>``, within the length of a name (as client-go names them)."""
    room = MAX_NAME_LENGTH - len(suffix) - 1
    return f"{regarding.name[:room]}.{suffix}"


def event_body(
    regarding: ObjectRef,
    notice: Notice,
    *,
    name: str,
    instance: str,
    now: float,
    related: ObjectRef | None = None,
) -> dict[str, Any]:
    """Return the Event the operator creates for ``notice`` about ``regarding``.

    Built as an :class:`EventBody`, so its keys are checked, and handed over as a plain
    dict for the recorder to keep and send.
    """
    body: RelatedEventBody = {
        "apiVersion": EVENT_API_VERSION,
        "kind": "Event",
        "metadata": {"name": name, "namespace": regarding.namespace},
        "eventTime": rfc3339(now, micros=True),
        "reportingController": REPORTING_CONTROLLER,
        "reportingInstance": instance[:128],
        "action": notice.action,
        "reason": notice.reason,
        "regarding": regarding.wire(),
        "note": notice.bounded_note,
        "type": notice.type.value,
    }
    if related is not None:
        body["related"] = related.wire()
    return dict(body)


def series_patch(count: int, last_seen: float) -> SeriesPatch:
    """Return the merge patch that records repeats of an Event as its ``series``.

    Only the series: the API server refuses a change of an Event's note (immutable).
    """
    return {"series": {"count": count, "lastObservedTime": rfc3339(last_seen, micros=True)}}


__all__ = [
    "EVENT_API_VERSION",
    "EventBody",
    "EventSeries",
    "RelatedEventBody",
    "SeriesPatch",
    "REPORTING_CONTROLLER",
    "ObjectRef",
    "event_body",
    "event_name",
    "series_patch",
]
