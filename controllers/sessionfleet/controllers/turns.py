"""Turns for the operator's session writes: a few at once, the most urgent first.

The operator writes sessions from three places: a new session's event (its bind), the
fleet loop's pass (finishes, deletions, restores) and a worker's drain (migrations).
When they are asked for faster than the API server answers, they wait here. With a
first-come queue (an ``asyncio.Semaphore``) a burst of binds queued thousands deep in
front of everything else: at 20,000 live sessions and 100 finishes a second, no drain
and no recovery ended within a minute (``make bench-scale``, bench/README.md). Here a
waiting write is served by urgency (:class:`sessionfleet.policy.sessions.Urgency`),
first come first served within one.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import Counter
from collections.abc import AsyncIterator, Hashable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from sessionfleet.policy.sessions import Urgency


@dataclass(eq=False)
class _Waiter:
    """One write waiting for its turn."""

    urgency: Urgency
    key: Hashable | None
    granted: asyncio.Future[None]


class WriteTurns:
    """At most ``limit`` writes at once; the others wait, most urgent first."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"at least one write at a time, not {limit}")
        self.limit = limit
        self._free = limit
        self._queue: list[tuple[Urgency, int, _Waiter]] = []
        self._order = itertools.count()
        self._by_key: dict[Hashable, _Waiter] = {}
        self.waiting: Counter[Urgency] = Counter()
        """Writes waiting for a turn now, by urgency (exported as a gauge)."""

    @property
    def writing(self) -> int:
        """How many writes hold a turn now."""
        return self.limit - self._free

    @asynccontextmanager
    async def turn(self, urgency: Urgency, key: Hashable | None = None) -> AsyncIterator[None]:
        """Hold one turn for the block; wait for it behind every more urgent write.

        ``key`` names what is written (a session), so that :meth:`promote` can find it.
        """
        await self._take(urgency, key)
        try:
            yield
        finally:
            self._give_back()

    def promote(self, key: Hashable, urgency: Urgency) -> bool:
        """Move the write waiting for ``key`` up to ``urgency``; return whether one was.

        A session's finish may wait behind thousands of binds when its worker starts to
        drain, and the drain cannot end until it is written: the drain promotes it.
        """
        waiter = self._by_key.get(key)
        if waiter is None or waiter.urgency <= urgency:
            return False
        self._leave(waiter.urgency)
        waiter.urgency = urgency
        self.waiting[urgency] += 1
        # Its old entry stays queued; the waiter is granted through this one first, and
        # the old one is skipped when it surfaces.
        heapq.heappush(self._queue, (urgency, next(self._order), waiter))
        return True

    async def _take(self, urgency: Urgency, key: Hashable | None) -> None:
        if self._free > 0 and not self.waiting:
            self._free -= 1
            return
        waiter = _Waiter(urgency, key, asyncio.get_running_loop().create_future())
        heapq.heappush(self._queue, (urgency, next(self._order), waiter))
        self.waiting[urgency] += 1
        if key is not None:
            self._by_key[key] = waiter
        try:
            await waiter.granted
        except asyncio.CancelledError:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self._give_back()  # handed a turn as it was cancelled: pass it on
            else:
                self._forget(waiter)  # its entries stay queued, skipped when they surface
                self._leave(waiter.urgency)
            raise

    def _forget(self, waiter: _Waiter) -> None:
        if waiter.key is not None and self._by_key.get(waiter.key) is waiter:
            del self._by_key[waiter.key]

    def _leave(self, urgency: Urgency) -> None:
        self.waiting[urgency] -= 1
        if self.waiting[urgency] <= 0:
            del self.waiting[urgency]

    def _give_back(self) -> None:
        """Hand the turn to the most urgent waiter still waiting, or free it."""
        while self._queue:
            _, _, waiter = heapq.heappop(self._queue)
            if waiter.granted.done():  # cancelled while it waited, or promoted and granted
                continue
            self._forget(waiter)
            self._leave(waiter.urgency)
            waiter.granted.set_result(None)
            return
        self._free += 1
