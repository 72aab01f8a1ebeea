"""Slow work (a checkpoint, a migration through one) run beside the fleet loop.

Started with :meth:`Spawner.spawn` by the controllers that need it; cancelled all at
once by :mod:`.handlers` before the replica gives up the lead.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from sessionfleet.controllers import metrics

log = logging.getLogger(__name__)


@dataclass
class Spawner:
    """The work started beside the loop; its fields are written by its own methods only."""

    wakeup: asyncio.Event
    """The fleet loop's wake-up, set whenever a task ends."""
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    """Work started with :meth:`spawn` and still running."""
    failures: int = 0
    """How many spawned tasks raised (also the metric ``..._spawned_failures_total``)."""
    stopped: bool = False
    """Set by :meth:`cancel_all`: no work starts any more (leadership is ending)."""

    def spawn(self, name: str, work: Coroutine[Any, Any, None]) -> None:
        """Run slow work (a checkpoint, a migration through one) beside the loop.

        The loop is woken when it ends; an exception is logged with its traceback and
        counted, and the work's own objects say what failed in their status. Once
        :meth:`cancel_all` has run (the replica stops leading), nothing starts.
        """
        if self.stopped:
            work.close()  # never awaited: close it so Python does not warn
            log.info("%s not started: this replica is giving up the lead", name)
            return
        task = asyncio.create_task(work, name=name)
        self.tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self.wakeup.set()
        if not task.cancelled() and (error := task.exception()) is not None:
            self.failures += 1
            metrics.SPAWNED_FAILURES.inc()
            log.error("%s failed", task.get_name(), exc_info=error)

    async def cancel_all(self) -> None:
        """Cancel every spawned task and wait until each has ended; start none after.

        Called before the Lease is released (or when it was lost): a checkpoint or a
        migration half way through must not go on acting on workers, through the API or
        an engine, once a standby may lead.
        """
        self.stopped = True
        running = list(self.tasks)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        if running:
            log.info("cancelled %d spawned tasks before giving up the lead", len(running))
