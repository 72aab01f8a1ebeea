"""Status as an API: conditions with stable transition times, and patches of what changed."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from sessionfleet.policy.worker import ConditionPlan


def iso(moment: datetime | None) -> str | None:
    """RFC 3339 in UTC with a Z, as the API server writes timestamps."""
    if moment is None:
        return None
    return moment.isoformat().replace("+00:00", "Z")


def merge_conditions(
    existing: Iterable[Mapping[str, Any]],
    planned: Iterable[ConditionPlan],
    now: datetime,
    generation: int | None = None,
) -> list[dict[str, Any]]:
    """Return the planned conditions, keeping lastTransitionTime where status is unchanged."""
    before = {c.get("type"): c for c in existing}
    out = []
    for cond in planned:
        old = before.get(cond.type.value, {})
        same = old.get("status") == cond.status.value
        entry: dict[str, Any] = {
            "type": cond.type.value,
            "status": cond.status.value,
            "reason": cond.reason.value,
            "message": cond.message,
            "lastTransitionTime": old.get("lastTransitionTime") if same else iso(now),
        }
        if generation is not None:
            entry["observedGeneration"] = generation
        out.append(entry)
    return out


def _comparable(conditions: Iterable[Mapping[str, Any]]) -> list[tuple[Any, ...]]:
    return sorted(
        (c.get("type"), c.get("status"), c.get("reason"), c.get("message", "")) for c in conditions
    )


def status_patch(current: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any]:
    """Return a merge patch with only the fields that differ (``None`` deletes a field).

    Conditions compare by type, status, reason and message: a transition time alone
    never causes a write.
    """
    patch: dict[str, Any] = {}
    for key, value in desired.items():
        old = current.get(key)
        if key == "conditions":
            if _comparable(old or []) != _comparable(value or []):
                patch[key] = value
        elif value is None:
            if old is not None:
                patch[key] = None
        elif old != value:
            patch[key] = value
    return patch
