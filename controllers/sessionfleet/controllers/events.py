"""The operator's Kubernetes Events: recorded without waiting, written in the background.

:meth:`EventRecorder.record` is synchronous and cheap: the reconcile that decided
something calls it and goes on. Which notices become Events and which only count is
:class:`sessionfleet.policy.events.Coalescer`'s decision; :meth:`EventRecorder.run`
writes the new Events and the series updates of repeated ones, together at most
``rate`` a second (``burst`` at once). Events are for people: one that cannot be
written (the API server is away, this replica no longer leads, the queue is full) is
counted in ``sessionfleet_events_dropped_total`` and never retried at the cost of the
fleet.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from sessionfleet.api import GROUP, VERSION
from sessionfleet.controllers import metrics
from sessionfleet.controllers.records import WorkerRecord
from sessionfleet.kube import EVENTS, Conflict, Kube, KubeError, NotFound
from sessionfleet.policy.checkpoint import CheckpointState
from sessionfleet.policy.events import Coalescer, Notice
from sessionfleet.policy.rates import TokenBucket
from sessionfleet.policy.sessions import SessionState
from sessionfleet.resources.events import ObjectRef, event_body, event_name, series_patch

log = logging.getLogger(__name__)

MAX_QUEUED: Final = 1000
"""New Events waiting to be written at most; beyond, notices are dropped and counted."""


@dataclass(frozen=True, slots=True)
class _Pending:
    key: tuple[str, ...]
    namespace: str
    body: dict[str, Any]


class EventRecorder:
    """Coalesces notices into Events and writes them in the background."""

    def __init__(
        self,
        kube: Kube,
        instance: str,
        *,
        coalescer: Coalescer | None = None,
        rate: float = 10.0,
        burst: float = 50.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.kube = kube
        self.instance = instance
        self.coalescer = coalescer if coalescer is not None else Coalescer()
        self.clock = clock
        self._bucket = TokenBucket.full(rate, burst, time.monotonic())
        self._queue: deque[_Pending] = deque()
        self._wake = asyncio.Event()

    def record(
        self, regarding: ObjectRef, notice: Notice, related: ObjectRef | None = None
    ) -> None:
        """Note one decision about ``regarding``; never blocks, never raises."""
        key = (
            regarding.namespace,
            regarding.kind,
            regarding.name,
            regarding.uid,
            notice.type.value,
            notice.reason,
        )
        now = self.clock()
        if not self.coalescer.observe(key, now):
            return
        if len(self._queue) >= MAX_QUEUED:
            self.coalescer.forget(key)
            metrics.EVENTS_DROPPED.labels("queue_full").inc()
            return
        name = event_name(regarding, f"{int(now * 1e6):x}{secrets.token_hex(2)}")
        body = event_body(
            regarding, notice, name=name, instance=self.instance, now=now, related=related
        )
        self._queue.append(_Pending(key, regarding.namespace, body))
        self._wake.set()

    async def run(self) -> None:
        """Write queued Events and due series updates, forever."""
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=1.0)
            except TimeoutError:
                pass
            self._wake.clear()
            while self._queue:
                wait = self._bucket.wait(time.monotonic())
                if wait > 0:
                    await asyncio.sleep(wait)
                    continue
                self._bucket.take()
                await self._create(self._queue.popleft())
            # Series updates spend the same budget as new Events: whatever the number
            # of series, the recorder writes at most ``rate`` Events a second.
            budget = self._bucket.available(time.monotonic())
            for update in self.coalescer.due(self.clock(), limit=budget):
                self._bucket.take()
                namespace = update.key[0]
                try:
                    await self.kube.patch(
                        EVENTS,
                        update.name,
                        series_patch(update.count, update.last_seen),
                        namespace,
                    )
                    metrics.EVENTS_WRITTEN.labels("series").inc()
                except NotFound:
                    self.coalescer.forget(update.key)  # expired or deleted: start anew
                except KubeError as error:
                    self._dropped(error)

    async def _create(self, pending: _Pending) -> None:
        try:
            await self.kube.create(EVENTS, pending.body, pending.namespace)
        except Conflict:
            self.coalescer.forget(pending.key)
            return
        except KubeError as error:
            self.coalescer.forget(pending.key)
            self._dropped(error)
            return
        metrics.EVENTS_WRITTEN.labels("create").inc()
        self.coalescer.created(pending.key, pending.body["metadata"]["name"])

    def _dropped(self, error: KubeError) -> None:
        metrics.EVENTS_DROPPED.labels("api_error").inc()
        log.debug("event not written: %s", error)


def worker_ref(record: WorkerRecord) -> ObjectRef:
    """Return the InferenceWorker as an Event names it."""
    return ObjectRef(f"{GROUP}/{VERSION}", "InferenceWorker", *record.key, record.uid)


def session_ref(session: SessionState) -> ObjectRef:
    """Return the AgentSession as an Event names it."""
    return ObjectRef(f"{GROUP}/{VERSION}", "AgentSession", *session.key, session.uid)


def checkpoint_ref(checkpoint: CheckpointState) -> ObjectRef:
    """Return the WorkerCheckpoint as an Event names it."""
    return ObjectRef(f"{GROUP}/{VERSION}", "WorkerCheckpoint", *checkpoint.key, checkpoint.uid)


__all__ = ["EventRecorder", "checkpoint_ref", "session_ref", "worker_ref"]
