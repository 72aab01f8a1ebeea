"""events.k8s.io/v1 Events: pure builders.

Like the other core kinds (:mod:`.pods`, :mod:`.leases`), an Event has no pydantic
model here: nothing validates or generates a schema from it. Its keys are written out
in this one place; the operator's recorder only calls these functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from sessionfleet.policy.events import Notice
from sessionfleet.resources.times import rfc3339

EVENT_API_VERSION: Final = "events.k8s.io/v1"
REPORTING_CONTROLLER: Final = "sessionfleet.dev/operator"
MAX_NAME_LENGTH: Final = 253


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
    """Return the Event the operator creates for ``notice`` about ``regarding``."""
    body: dict[str, Any] = {
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
    return body


def series_patch(count: int, last_seen: float) -> dict[str, Any]:
    """Return the merge patch that records repeats of an Event as its ``series``.

    Only the series: the API server refuses a change of an Event's note (immutable).
    """
    return {"series": {"count": count, "lastObservedTime": rfc3339(last_seen, micros=True)}}


__all__ = [
    "EVENT_API_VERSION",
    "REPORTING_CONTROLLER",
    "ObjectRef",
    "event_body",
    "event_name",
    "series_patch",
]
