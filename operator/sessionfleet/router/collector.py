"""Garbage collection for a process that must not stall: the start-up heap frozen once.

CPython's cyclic collector walks every tracked object of the generations it collects.
A full (oldest-generation) collection of the router's heap, most of it the modules and
their objects loaded at start (aiohttp, httpx, pydantic, prometheus_client), held the
event loop for 35-42 ms under load on the bench machine: every turn in flight waited
that long, and at 500 turns/s that alone set the added p99 (bench/README.md, "Router:
the tail"). ``gc.freeze()`` moves every object alive at that moment to a permanent
generation that no collection walks; objects created later are collected as before.
Long-running Python servers do this once after start (the Python docs recommend it
for pre-fork servers, gc.freeze: https://docs.python.org/3/library/gc.html#gc.freeze).

What is frozen is never collected as cyclic garbage: only the start-up heap is frozen
(once, after a collection), so nothing that the router allocates per turn can leak
through it.
"""

from __future__ import annotations

import gc
from typing import Final

YOUNG_COLLECTION_THRESHOLD: Final = 7000
"""Allocations (less deallocations) of tracked objects between young collections.

CPython's default is 700: a proxy that allocates a few hundred short-lived containers
per turn then collects its young generation every turn or two, mostly for nothing (the
objects die by reference counting). Ten times that cut the router's CPU per small turn
by 7% in two runs of the bench against the freeze alone; a later run against the code
before both changes did not separate them (bench/README.md, "Router: the tail"). A
young collection stays well under a millisecond.
"""


def tune_collector() -> int:
    """Freeze the start-up heap and collect the young generation less often.

    Return how many objects were frozen.
    """
    frozen = freeze_startup_heap()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, middle, old)
    return frozen


def freeze_startup_heap() -> int:
    """Collect once, then move every object alive now out of the collector's reach.

    Return how many objects were frozen.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
