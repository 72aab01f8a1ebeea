"""What the engines last reported of themselves, per worker.

The fleet loop scrapes each Ready worker's engine ``/metrics`` (:mod:`.loop`) and the
KV-store retention pass asks each engine whether its store is writable
(:mod:`.kvstores`); the worker status (:mod:`.workers`) and placement
(:mod:`.sessionbook`) read the figures here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sessionfleet.controllers.records import Key


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine figures scraped from a worker's ``/metrics``."""

    kv_usage: float | None = None
    prefix_hits: float | None = None
    prefix_queries: float | None = None
    running: int | None = None
    waiting: int | None = None
    ignored: tuple[str, ...] = ()
    """Metrics the engine reported as NaN or infinite, which were left out."""


@dataclass
class EngineReports:
    """The engines' own figures, each field written by one module."""

    stats: dict[Key, EngineStats] = field(default_factory=dict)
    """By worker: the last scrape's figures, written by :mod:`.loop` only."""
    kv_store_health: dict[str, str | None] = field(default_factory=dict)
    """By ``namespace/name``: None while the worker's KV store is writable, else why not;
    absent until the store first answered. Written by :mod:`.kvstores` only."""
