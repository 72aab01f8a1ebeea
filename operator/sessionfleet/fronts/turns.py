"""Turns in flight through one front (router or EPP), and the hold of a session's turn.

Both fronts use one :class:`Turns`, so they count and hold alike:

* :meth:`Turns.started` and :meth:`Turns.ended` bracket every forwarded turn: the
  worker's requests in flight from this replica (stateless routing picks the fewest)
  and, for a session's turn, the session's turns in flight here;
* :attr:`Turns.ended_event` is set when a session's **last** turn in flight here ends,
  that is when its count reaches zero. The migration handshake
  (:class:`~sessionfleet.fronts.handshake.Acknowledger`) listens to it: it acknowledges
  a Migrating session only at a turn boundary, with no turn of it in flight here, so a
  signal while another turn of the session still runs would only wake it for nothing;
* :meth:`Turns.hold` is how a turn waits while its session cannot be routed (Migrating,
  Restoring, its worker not serving): it re-decides at every change of the binding
  table until the decision releases it or the hold's timeout passes. What "released"
  means and what a timeout answers is the front's own (an HTTP 503 in the router, an
  ext_proc ``ImmediateResponse`` in the EPP), so the decision is a callback.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Mapping
from typing import TypeVar

from sessionfleet.fronts.bindings import BindingTable, WorkerView
from sessionfleet.fronts.metrics import RouterMetrics

Released = TypeVar("Released")


class Turns:
    """The turns in flight through one router or EPP replica, and their holds."""

    def __init__(self, table: BindingTable, metrics: RouterMetrics) -> None:
        self.table = table
        self.metrics = metrics
        self._sessions: Counter[str] = Counter()
        self.ended_event = asyncio.Event()
        """Set when a session's last turn in flight here ends; its listener clears it."""

    @property
    def sessions(self) -> Mapping[str, int]:
        """Turns in flight here per AgentSession name (only sessions with one or more)."""
        return self._sessions

    def started(self, worker: WorkerView, session: str | None) -> None:
        """Count a turn forwarded to ``worker`` (for ``session``; None: stateless)."""
        worker.in_flight += 1
        if session is not None:
            self._sessions[session] += 1

    def ended(self, worker: WorkerView, session: str | None) -> None:
        """Count a turn as over; signal when it was its session's last one here."""
        worker.in_flight -= 1
        if session is None:
            return
        self._sessions[session] -= 1
        if self._sessions[session] <= 0:
            del self._sessions[session]
            self.ended_event.set()

    async def hold(self, retry: Callable[[], Released | None], timeout: float) -> Released | None:
        """Wait for ``retry`` to release a held turn; None once ``timeout`` seconds passed.

        ``retry`` decides again after every change of the binding table: it returns what
        releases the turn, or None while it must still wait; it may raise to end the
        hold with the front's own answer. A timeout of 0 gives up at once.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        self.metrics.held.inc()
        try:
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    self.metrics.holds.labels("timeout").inc()
                    return None
                try:
                    await asyncio.wait_for(self.table.changed().wait(), remaining)
                except TimeoutError:
                    pass
                released = retry()
                if released is not None:
                    self.metrics.holds.labels("released").inc()
                    return released
        finally:
            self.metrics.held.dec()
