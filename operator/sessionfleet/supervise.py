"""Supervision of a process's background tasks: one that dies takes the process down.

A long-running process (the node agent, the router, the operator) serves requests while
loops run beside it: sampling, probing, watching. When such a loop dies of an
exception the process keeps answering but stops doing its work, and nothing notices.
A :class:`Supervisor` starts the loops as named tasks and records the first one that
ends unexpectedly; the process then reports itself not ready (``/readyz`` answers 503
naming the task, from :attr:`Supervisor.failure`) and leaves its serve loop
(:meth:`Supervisor.wait`) to exit non-zero, so that Kubernetes restarts it::

    async with Supervisor() as supervisor:
        supervisor.start("sampling", sample_forever())
        failure = await supervisor.wait(stop)   # stop: set by SIGTERM
    return 1 if failure else 0

Pure asyncio, no I/O of its own beyond logging the failure once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from dataclasses import dataclass
from types import TracebackType
from typing import Any

log = logging.getLogger(__name__)

EXIT_TASK_FAILED = 1
"""The exit status of a process whose background task died."""


@dataclass(frozen=True, slots=True)
class Failure:
    """The first background task that ended unexpectedly, and how."""

    task: str
    reason: str

    def __str__(self) -> str:
        return f"background task {self.task} {self.reason}"


def _reason(task: asyncio.Task[object], forever: bool) -> str | None:
    """Why a finished task counts as failed, or ``None`` when its end was expected."""
    if task.cancelled():
        return "was cancelled"
    error = task.exception()  # retrieved here, so asyncio does not warn about it later
    if error is not None:
        return f"died: {type(error).__name__}: {error}"
    return "returned, but should run until the process stops" if forever else None


class Supervisor:
    """Runs named background tasks and records the first that ends unexpectedly.

    A task started with ``forever=True`` (the default: a loop) fails when it raises,
    returns or is cancelled by anyone but the supervisor; one started with
    ``forever=False`` fails only when it raises or is cancelled. Failures after the
    first are logged but do not replace it. :meth:`stop` (or leaving the ``async
    with`` block) cancels every task and waits for them, which is not a failure.
    """

    def __init__(self, logger: logging.Logger = log) -> None:
        self.log = logger
        self.failed = asyncio.Event()
        """Set when the first failure is recorded; :meth:`wait` waits on it."""
        self._failure: Failure | None = None
        self._tasks: dict[asyncio.Task[object], tuple[str, bool]] = {}
        self._stopping = False

    @property
    def failure(self) -> Failure | None:
        """The first failure, or ``None`` while every task runs as it should."""
        return self._failure

    @property
    def healthy(self) -> bool:
        """Whether no task has failed."""
        return self._failure is None

    @property
    def names(self) -> list[str]:
        """The names of the tasks still running, in start order."""
        return [name for name, _ in self._tasks.values()]

    def start(
        self, name: str, coroutine: Coroutine[Any, Any, object], *, forever: bool = True
    ) -> asyncio.Task[object]:
        """Run ``coroutine`` as the task ``name``; its unexpected end is a failure."""
        if self._stopping:
            coroutine.close()  # never awaited: close it so Python does not warn
            raise RuntimeError(f"cannot start {name}: the supervisor is stopping")
        task: asyncio.Task[object] = asyncio.create_task(coroutine, name=name)
        self._tasks[task] = (name, forever)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[object]) -> None:
        # Forgotten once done, so that many one-shot tasks do not pile up.
        name, forever = self._tasks.pop(task)
        reason = _reason(task, forever)
        if reason is None or self._stopping:
            return
        error = None if task.cancelled() else task.exception()
        failure = Failure(name, reason)
        self.log.error("%s", failure, exc_info=error)
        if self._failure is None:
            self._failure = failure
            self.failed.set()

    async def wait(self, stop: asyncio.Event | None = None) -> Failure | None:
        """Wait until ``stop`` is set or a task fails; return the failure, if any."""
        waiters = [asyncio.ensure_future(self.failed.wait())]
        if stop is not None:
            waiters.append(asyncio.ensure_future(stop.wait()))
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)
        return self._failure

    async def stop(self) -> None:
        """Cancel every task and wait for them; nothing that ends now is a failure."""
        self._stopping = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def __aenter__(self) -> Supervisor:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.stop()


__all__ = ["EXIT_TASK_FAILED", "Failure", "Supervisor"]
