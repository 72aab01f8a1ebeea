"""How values are written in the plugin's tables and lines, as kubectl writes them.

Times (ages, countdowns, RFC 3339), token counts, percentages and the table layout:
pure functions over values, with the time a parameter.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Final

from sessionfleet.api import (
    format_duration,
)

NONE: Final = "-"
"""What a table cell shows for a value that is not there."""


def parse_time(value: object) -> datetime | None:
    """Return an RFC 3339 time from the API server as an aware ``datetime``, else ``None``."""
    if not isinstance(value, str) or not value:
        return None
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def age(delta: timedelta) -> str:
    """Return an age the way kubectl writes one (``45s``, ``3m20s``, ``2h5m``, ``4d``).

    The rules of k8s.io/apimachinery's ``duration.HumanDuration``: the longer ago, the
    coarser; a time up to a second in the future (clock skew) is ``0s``.
    """
    seconds = math.floor(delta.total_seconds())
    if seconds < -1:
        return "<invalid>"
    if seconds < 0:
        return "0s"
    if seconds < 120:
        return f"{seconds}s"
    minutes = seconds // 60
    if minutes < 10:
        rest = seconds % 60
        return f"{minutes}m{rest}s" if rest else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = minutes // 60
    if hours < 8:
        rest = minutes % 60
        return f"{hours}h{rest}m" if rest else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        rest = hours % 24
        return f"{hours // 24}d{rest}h" if rest else f"{hours // 24}d"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        days = (hours // 24) % 365
        return f"{hours // 24 // 365}y{days}d" if days else f"{hours // 24 // 365}y"
    return f"{hours // 24 // 365}y"


def age_of(moment: datetime | None, now: datetime) -> str:
    """Return how long ago ``moment`` was (:func:`age`), or ``<unknown>``."""
    return age(now - moment) if moment is not None else "<unknown>"


def countdown(at: datetime, now: datetime) -> str:
    """Return the time until ``at``, to the second: ``in 9m41s``, ``now``, or ``12s ago``.

    A countdown rounds up (0.2 s left is ``in 1s``): it never says a moment has come
    before it has.
    """
    seconds = (at - now).total_seconds()
    if seconds > 0:
        return f"in {format_duration(timedelta(seconds=math.ceil(seconds)))}"
    if seconds == 0:
        return "now"
    return f"{format_duration(timedelta(seconds=math.floor(-seconds)))} ago"


def wire_time(moment: datetime) -> str:
    """Return ``moment`` as the API server writes times: ``2026-11-29T14:00:00Z``."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def tokens(count: int | None) -> str:
    """Return a token count for a table: ``812``, ``12.3K``, ``1.2M``."""
    if count is None:
        return NONE
    if count < 1000:
        return str(count)
    if count < 1_000_000:
        return f"{count / 1000:.1f}K"
    return f"{count / 1_000_000:.1f}M"


def percent(value: float | None, digits: int = 1) -> str:
    """Return a percentage for a table, or :data:`NONE`."""
    return NONE if value is None else f"{value:.{digits}f}%"


def maybe_time(moment: datetime | None) -> str | None:
    """Return :func:`wire_time` of ``moment``, or ``None`` when there is none."""
    return wire_time(moment) if moment is not None else None


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Return rows as kubectl prints them: upper-case headers, columns three spaces apart."""
    lines = [[str(h).upper() for h in headers], *([str(c) for c in row] for row in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(headers))]
    return "\n".join(
        "   ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def nothing_found(what: str, namespace: str | None) -> str:
    """Return kubectl's line for an empty list."""
    where = f" in {namespace} namespace" if namespace else ""
    return f"No {what} found{where}."


def indent(text: str, by: str = "  ") -> list[str]:
    """Return the lines of ``text`` indented by ``by`` (empty lines stay empty)."""
    return [by + line if line else line for line in text.splitlines()]
