"""Status as an API: patches of what changed.

The statuses and conditions themselves are built from the API models by
:mod:`sessionfleet.resources.status`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


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
