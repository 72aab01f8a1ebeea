"""The router's usage status patch of an AgentSession, built from the API model: pure.

The router's ledger (:mod:`sessionfleet.fronts.ledger`) decides the figures: the sums
of what was observed and what is pending, the hit rate and which turn was first. This
module only shapes them into the conditional merge patch the router writes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sessionfleet.api import AgentSessionStatus
from sessionfleet.api._common import ObjectMeta
from sessionfleet.resources.times import utc, wire_time


@dataclass(frozen=True, slots=True)
class UsageFigures:
    """The router-owned counters of a session's status, as the ledger computed them."""

    turns: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    recomputed_tokens: int
    hit_rate_percent: float
    last_activity: float | None = None
    """Unix time the last turn completed; None when unknown (the field is left out)."""
    first_turn_at: float | None = None
    """Unix time the first counted turn started; None when no real first turn is known."""
    first_turn_uncached_tokens: int = 0
    """Prompt tokens of that turn not served from cache; written with ``first_turn_at``."""


def usage_status(figures: UsageFigures) -> AgentSessionStatus:
    """Return the status model holding exactly the usage fields the router writes."""
    first_turn = figures.first_turn_at is not None
    return AgentSessionStatus(
        turns=figures.turns,
        prompt_tokens=figures.prompt_tokens,
        cached_tokens=figures.cached_tokens,
        completion_tokens=figures.completion_tokens,
        recomputed_tokens=figures.recomputed_tokens,
        hit_rate_percent=figures.hit_rate_percent,
        last_activity=None if figures.last_activity is None else utc(figures.last_activity),
        first_turn_at=None if figures.first_turn_at is None else utc(figures.first_turn_at),
        first_turn_uncached_tokens=figures.first_turn_uncached_tokens if first_turn else None,
    )


def status_wire(status: AgentSessionStatus) -> dict[str, Any]:
    """Return the fields set on ``status`` (None meaning unset) as the API server stores them.

    Times have fixed shapes (:mod:`.times`): ``lastActivity`` in whole seconds,
    ``firstTurnAt`` with microseconds, since replicas order first turns by it.
    """
    wire = status.model_dump(by_alias=True, mode="json", exclude_unset=True, exclude_none=True)
    if status.last_activity is not None:
        wire[_alias("last_activity")] = wire_time(status.last_activity)
    if status.first_turn_at is not None:
        wire[_alias("first_turn_at")] = wire_time(status.first_turn_at, micros=True)
    return wire


def precondition(resource_version: str) -> dict[str, Any]:
    """Return the metadata that makes a patch conditional on ``resource_version``.

    The API server answers 409 Conflict when the object changed since.
    """
    meta = ObjectMeta(resource_version=resource_version)
    return meta.model_dump(by_alias=True, mode="json", exclude_unset=True)


def usage_status_patch(
    figures: UsageFigures,
    resource_version: str,
    marks: Mapping[str, int | None] | None = None,
) -> dict[str, Any]:
    """Return the merge patch of a session's status subresource that writes ``figures``.

    Conditional on ``resource_version``: a replica that raced another gets a 409 and
    recomputes from the object it re-reads. ``marks`` go to ``usageWrites`` as a merge
    (a None removes a replica's entry): the id of this write under the writer's name.
    """
    status = status_wire(usage_status(figures))
    if marks:
        status[_alias("usage_writes")] = dict(marks)
    return {"metadata": precondition(resource_version), "status": status}


def _alias(field: str) -> str:
    alias = AgentSessionStatus.model_fields[field].alias
    assert alias is not None
    return alias
