"""The router's conversation with the API server, all of it off the hot path.

* :func:`watch_workers` and :func:`watch_sessions` keep the :class:`BindingTable`
  current (LIST, then WATCH; a fresh LIST after a broken or expired watch);
* :class:`SessionCreator` records a new session: it places it with the shared
  placement function, creates the AgentSession with that choice as ``workerHint`` and,
  when another replica created it first (409), adopts the existing binding. This is
  the only API call a turn can wait for, and only a session's first turn does;
* :class:`Flusher` writes each session's pending usage at most once per interval, as a
  conditional merge patch of the status (see :mod:`.ledger`), and marks sessions
  finished when their client said so.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Coroutine
from typing import Any, Final

from sessionfleet.api import API_VERSION
from sessionfleet.kube import (
    SESSIONS,
    WORKERS,
    ApiUnavailable,
    Conflict,
    Invalid,
    Kube,
    KubeError,
    NotFound,
    reflect,
)
from sessionfleet.policy.placement import PlacementRequest, place
from sessionfleet.router.bindings import BindingTable, SessionView
from sessionfleet.router.errors import RouterError
from sessionfleet.router.identity import Identity, session_object_name
from sessionfleet.router.ledger import Totals, UsageLedger, status_patch
from sessionfleet.router.metrics import RouterMetrics

logger = logging.getLogger("sessionfleet.router")

CREATED_BY_ANNOTATION: Final = "sessionfleet.dev/created-by"
"""Names the router replica that created an AgentSession (for people reading it)."""
MAX_FLUSH_ATTEMPTS: Final = 4
FLUSH_TICK: Final = 0.25
"""Seconds between two looks at which sessions are due for a usage write."""


async def watch_workers(kube: Kube, namespace: str, table: BindingTable) -> None:
    """Mirror the namespace's InferenceWorkers into ``table``, forever."""
    async for event in reflect(kube, WORKERS, namespace):
        if event.type == "SYNC":
            table.replace_workers(event.items)
            logger.info("loaded %d workers", len(event.items))
        elif event.obj is None:
            continue
        elif event.type == "DELETED":
            table.remove_worker(event.obj["metadata"]["name"])
        else:
            table.apply_worker(event.obj)


async def watch_sessions(
    kube: Kube, namespace: str, table: BindingTable, ledger: UsageLedger
) -> None:
    """Mirror the namespace's AgentSessions into ``table``, forever."""
    async for event in reflect(kube, SESSIONS, namespace):
        if event.type == "SYNC":
            table.replace_sessions(event.items)
            logger.info("loaded %d sessions", len(event.items))
        elif event.obj is None:
            continue
        elif event.type == "DELETED":
            name = event.obj["metadata"]["name"]
            table.remove_session(name)
            ledger.forget(name)
        else:
            table.apply_session(event.obj)


class SessionCreator:
    """Creates (or adopts) the AgentSession of a session's first turn."""

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        table: BindingTable,
        metrics: RouterMetrics,
        *,
        replica: str,
        timeout: float,
        retry_after: int,
    ) -> None:
        self._kube = kube
        self._namespace = namespace
        self._table = table
        self._metrics = metrics
        self._replica = replica
        self._timeout = timeout
        self._retry_after = retry_after
        self._creating: dict[str, asyncio.Future[SessionView]] = {}

    async def ensure(self, identity: Identity, model: str) -> tuple[SessionView, bool]:
        """Return the session's view and whether this call created the session.

        Concurrent first turns of one session in this replica share one create.
        """
        known = self._table.session(identity.session_id)
        if known is not None:
            return known, False
        pending = self._creating.get(identity.session_id)
        if pending is not None:
            return await asyncio.shield(pending), False
        future: asyncio.Future[SessionView] = asyncio.get_running_loop().create_future()
        self._creating[identity.session_id] = future
        try:
            view, created = await self._create(identity, model)
        except BaseException as error:
            future.set_exception(error)
            future.exception()  # retrieved: no "never retrieved" warning without waiters
            raise
        else:
            future.set_result(view)
            return view, created
        finally:
            del self._creating[identity.session_id]

    async def _create(self, identity: Identity, model: str) -> tuple[SessionView, bool]:
        parent = self._table.session(identity.parent_id) if identity.parent_id else None
        placement = place(
            PlacementRequest(model=model, parent_worker=parent.worker if parent else None),
            self._table.loads(),
        )
        if placement.worker is None:
            if not self._table.has_model(model):
                raise RouterError(404, "model_not_found", f"no InferenceWorker serves {model!r}")
            code = "no_capacity" if placement.reason.value == "NoCapacity" else "no_ready_worker"
            raise RouterError(503, code, placement.message, retry_after=self._retry_after)
        name = session_object_name(identity.session_id)
        spec: dict[str, Any] = {
            "sessionId": identity.session_id,
            "model": model,
            "client": identity.client.value,
            "workerHint": placement.worker,
        }
        if identity.parent_id:
            spec["parentSessionId"] = identity.parent_id
        body = {
            "apiVersion": API_VERSION,
            "kind": "AgentSession",
            "metadata": {
                "name": name,
                "namespace": self._namespace,
                "annotations": {CREATED_BY_ANNOTATION: self._replica},
            },
            "spec": spec,
        }
        try:
            async with asyncio.timeout(self._timeout):
                try:
                    obj = await self._kube.create(SESSIONS, body, self._namespace)
                    created = True
                except Conflict:
                    # Another router replica created it first: its choice stands.
                    obj = await self._kube.get(SESSIONS, name, self._namespace)
                    created = False
        except Invalid as error:
            raise RouterError(
                400, "invalid_session_id", f"the API server refused the session: {error.message}"
            ) from error
        except (TimeoutError, KubeError) as error:
            logger.warning("cannot record session %s: %s", identity.session_id, error)
            raise RouterError(
                503,
                "api_unavailable",
                f"the new session could not be recorded in the Kubernetes API: {error}",
                retry_after=self._retry_after,
            ) from error
        if (obj.get("spec") or {}).get("sessionId") != identity.session_id:
            # Two ids with one name would need a 48-bit hash collision; refuse rather
            # than route one session's turns by another's binding.
            raise RouterError(
                409,
                "session_name_collision",
                f"AgentSession {name} belongs to another session id",
            )
        self._metrics.sessions_created.labels("created" if created else "adopted").inc()
        return self._table.apply_session(obj), created


class Flusher:
    """Writes pending usage to session statuses, and finished marks to their specs.

    Writes are spread out: at most ``writes_per_second`` start per second and at most
    ``concurrency`` are in flight. Sessions that became due together (created in one
    burst, say) are written over the following ticks instead of all at once, which
    would put a burst of API work on the event loop that serves the turns and show as
    latency spikes in the router's p99.
    """

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        table: BindingTable,
        ledger: UsageLedger,
        metrics: RouterMetrics,
        *,
        writes_per_second: float = 50.0,
        concurrency: int = 4,
    ) -> None:
        self._kube = kube
        self._namespace = namespace
        self._table = table
        self._ledger = ledger
        self._metrics = metrics
        self._writes_per_second = writes_per_second
        self._slots = asyncio.Semaphore(concurrency)
        self._finishing: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self, tick: float = FLUSH_TICK) -> None:
        """Start the writes that are due every ``tick`` seconds, forever."""
        while True:
            await asyncio.sleep(tick)
            self.start_due(tick)

    def start_due(self, tick: float = FLUSH_TICK) -> int:
        """Start writing the sessions that are due, within this tick's budget; return how many."""
        now = time.time()
        budget = max(1, math.ceil(self._writes_per_second * tick))
        due = self._ledger.due(now, limit=budget)
        for name in due:
            self._spawn(self._flush_one(name, now))
        self._ledger.prune(now)
        return len(due)

    async def flush_all(self) -> None:
        """Write everything pending, whatever the interval (on shutdown)."""
        now = time.time()
        await asyncio.gather(*(self._flush_one(name, now) for name in self._ledger.sessions()))
        await self.idle()

    async def idle(self) -> None:
        """Wait until every write started so far has ended."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def finish(self, name: str) -> None:
        """Mark a session finished (its client sent the final marker), in the background."""
        if name in self._finishing:
            return
        self._finishing.add(name)
        self._spawn(self._finish(name))

    async def _finish(self, name: str) -> None:
        try:
            await self._flush_one(name, time.time())
            async with self._slots:
                await self._kube.patch(
                    SESSIONS, name, {"spec": {"finished": True}}, self._namespace
                )
        except NotFound:
            pass
        except KubeError as error:
            logger.warning("cannot mark session %s finished: %s", name, error)
        finally:
            self._finishing.discard(name)

    async def _flush_one(self, name: str, now: float) -> None:
        delta = self._ledger.take(name, now)
        if delta is None:
            return
        async with self._slots:
            try:
                await self._write(name, delta)
            except NotFound:
                self._metrics.flushes.labels("gone").inc()
                self._ledger.forget(name)
            except (ApiUnavailable, KubeError) as error:
                self._metrics.flushes.labels("failed").inc()
                logger.warning("usage of session %s not written (%s); will retry", name, error)
                self._ledger.give_back(name, delta)

    async def _write(self, name: str, delta: Totals) -> None:
        view = self._table.session_named(name)
        for _ in range(MAX_FLUSH_ATTEMPTS):
            if view is None:
                view = self._table.apply_session(
                    await self._kube.get(SESSIONS, name, self._namespace)
                )
            patch = status_patch(view.usage, delta, view.resource_version)
            try:
                obj = await self._kube.patch(SESSIONS, name, patch, self._namespace, status=True)
            except Conflict:
                # Someone else wrote the object since we observed it: re-read, recompute.
                self._metrics.flushes.labels("conflict").inc()
                view = None
                continue
            self._table.apply_session(obj)
            self._metrics.flushes.labels("written").inc()
            return
        raise KubeError(409, f"gave up after {MAX_FLUSH_ATTEMPTS} conflicting writes")
