"""Garbage collection for a process that must not stall: the router's heap, frozen once.

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


def freeze_startup_heap() -> int:
    """Collect once, then move every object alive now out of the collector's reach.

    Return how many objects were frozen.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
