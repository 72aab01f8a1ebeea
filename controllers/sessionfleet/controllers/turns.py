"""Turns for the operator's session writes: a few at once, the most urgent first.

The operator writes sessions from three places: a new session's event (its bind), the
fleet loop's pass (finishes, deletions, restores) and a worker's drain (migrations).
When they are asked for faster than the API server answers, they wait here. With a
first-come queue (an ``asyncio.Semaphore``) a burst of binds queued thousands deep in
front of everything else: at 20,000 live sessions and 100 finishes a second, no drain
and no recovery ended within a minute, and 89 of 6,000 finished sessions were deleted
(``make bench-scale``, bench/README.md). Here a waiting write is served by urgency
(:class:`sessionfleet.policy.sessions.Urgency`), first come first served within one.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from sessionfleet.policy.sessions import Urgency


class WriteTurns:
    """At most ``limit`` writes at once; the others wait, most urgent first."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"at least one write at a time, not {limit}")
        self.limit = limit
        self._free = limit
        self._queue: list[tuple[Urgency, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self.waiting: Counter[Urgency] = Counter()
        """Writes waiting for a turn now, by urgency (exported as a gauge)."""

    @property
    def writing(self) -> int:
        """How many writes hold a turn now."""
        return self.limit - self._free

    @asynccontextmanager
    async def turn(self, urgency: Urgency) -> AsyncIterator[None]:
        """Hold one turn for the block; wait for it behind every more urgent write."""
        await self._take(urgency)
        try:
            yield
        finally:
            self._give_back()

    async def _take(self, urgency: Urgency) -> None:
        if self._free > 0 and not self.waiting:
            self._free -= 1
            return
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._queue, (urgency, next(self._order), granted))
        self.waiting[urgency] += 1
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self._give_back()  # handed a turn as it was cancelled: pass it on
            else:
                self._leave(urgency)  # its entry stays queued, skipped when it surfaces
            raise

    def _leave(self, urgency: Urgency) -> None:
        self.waiting[urgency] -= 1
        if self.waiting[urgency] <= 0:
            del self.waiting[urgency]

    def _give_back(self) -> None:
        """Hand the turn to the most urgent waiter still waiting, or free it."""
        while self._queue:
            urgency, _, granted = heapq.heappop(self._queue)
            if granted.done():  # cancelled while it waited
                continue
            self._leave(urgency)
            granted.set_result(None)
            return
        self._free += 1
