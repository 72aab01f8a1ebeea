"""Times as the API server writes them: RFC 3339 in UTC with a ``Z``, pure functions.

Pydantic's JSON mode writes a ``datetime`` with a fraction only when it is not zero
(``…14:00:00Z`` or ``…14:00:00.5Z``). The builders write fixed shapes instead: whole
seconds for ``metav1.Time`` fields, six fraction digits for times that order events
(``metav1.MicroTime`` and the first turn of a session), so equal times compare equal as
strings and a reader parses one shape.
"""

from __future__ import annotations

from datetime import UTC, datetime

_SECONDS = "%Y-%m-%dT%H:%M:%SZ"
_MICROS = "%Y-%m-%dT%H:%M:%S.%fZ"


def utc(timestamp: float) -> datetime:
    """Return a Unix time as an aware UTC ``datetime``."""
    return datetime.fromtimestamp(timestamp, UTC)


def wire_time(moment: datetime, *, micros: bool = False) -> str:
    """Return ``moment`` as ``2026-11-29T14:00:00Z`` (``…14:00:00.123456Z`` with ``micros``).

    Without ``micros`` the fraction is dropped (not rounded), as the API server does.
    """
    return moment.astimezone(UTC).strftime(_MICROS if micros else _SECONDS)


def rfc3339(timestamp: float, *, micros: bool = False) -> str:
    """Return a Unix time as the API server writes times (see :func:`wire_time`)."""
    return wire_time(utc(timestamp), micros=micros)
