"""The router's conversation with the API server, all of it off the hot path.

* :func:`watch_workers` and :func:`watch_sessions` keep the :class:`BindingTable`
  current (LIST, then WATCH; a fresh LIST after a broken or expired watch);
* :class:`SessionCreator` records a new session: it places it with the shared
  placement function (the EPP has placed it already), creates the AgentSession with
  that choice as ``workerHint`` and, when another replica created it first (409),
  adopts the existing binding. The front is the session's one placer: the operator
  admits the hint rather than placing again
  (:func:`~sessionfleet.policy.placement.admit_or_place`). This is
  the only API call a turn can wait for, and only a session's first turn does — and,
  once per replica, the first turn of a session another replica created that no usage
  write shows served yet (the claim, :func:`must_claim`);
* :class:`Flusher` writes each session's pending usage at most once per interval, as a
  conditional merge patch of the status that records the write's id (see :mod:`.ledger`:
  a write whose answer was lost is settled from the status, never counted twice), and
  marks sessions finished when their client said so.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Final

from pydantic import ValidationError

from sessionfleet.api import AgentSessionSpec
from sessionfleet.fronts.admission import NewSessionLimiter, SessionRates
from sessionfleet.fronts.bindings import BindingTable, SessionView
from sessionfleet.fronts.errors import RouterError
from sessionfleet.fronts.identity import Identity, session_object_name
from sessionfleet.fronts.ledger import Totals, UsageLedger, status_patch, write_marks
from sessionfleet.fronts.metrics import RouterMetrics
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
from sessionfleet.resources.names import label_value
from sessionfleet.resources.sessions import agent_session, finished_patch, served_by_patch

logger = logging.getLogger("sessionfleet.router")

MAX_FLUSH_ATTEMPTS: Final = 4
MAX_DISCARD_ATTEMPTS: Final = 3
"""Conditional deletes of an abandoned session, each after a re-read on 409, before keeping it."""
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
    async for event in reflect(kube, SESSIONS, namespace, convert=SessionView.from_object):
        if event.type == "SYNC":
            table.replace_session_views(event.items)
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
    """Creates (or adopts) the AgentSession of a session's first turn.

    The object's name is derived from the session id (and, with client authentication,
    the client), and an object is used for an id only when its name, ``sessionId`` and
    owner label all match: an AgentSession someone else created never routes a
    client's turns. New sessions are rate limited (:class:`NewSessionLimiter`); a
    session whose first turn got no answer is deleted again (:meth:`discard`) unless
    another replica has served it, which that replica makes visible before serving
    (:func:`must_claim`).
    """

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
        limiter: NewSessionLimiter | None = None,
    ) -> None:
        self._kube = kube
        self._namespace = namespace
        self._table = table
        self._metrics = metrics
        self._replica = replica
        self._timeout = timeout
        self._retry_after = retry_after
        self._limiter = limiter or NewSessionLimiter(SessionRates(0, 0, 0, 0))
        self._creating: dict[str, asyncio.Future[SessionView]] = {}
        self._discarding: dict[str, asyncio.Event] = {}
        """Sessions this replica is deleting: a new turn of one waits for the outcome."""
        self._tasks: set[asyncio.Task[None]] = set()

    def _owned(self, view: SessionView, identity: Identity, owner: str | None) -> SessionView:
        """Return ``view`` if it is this client's session for this id; 409 otherwise."""
        if view.session_id != identity.session_id or view.owner != owner_label(owner):
            # Two ids with one name would need a 48-bit hash collision; more likely
            # someone created an object under the name. Never route by it.
            raise RouterError(
                409,
                "session_name_collision",
                f"AgentSession {view.name} belongs to another session or client",
            )
        return view

    async def ensure(
        self,
        identity: Identity,
        model: str,
        *,
        owner: str | None = None,
        requester: Callable[[], str] | None = None,
        placed: str | None = None,
    ) -> tuple[SessionView, bool]:
        """Return the session's view and whether this call created the session.

        ``owner`` is the authenticated client (None without authentication);
        ``requester`` returns who the new-session rate limit counts against (called for
        a new session only: a known session's turn skips the work). Concurrent first
        turns of one session in this replica share one create. ``placed`` is the worker
        the EPP already chose with :func:`place` and sent the turn to (it answers before
        the create, docs/epp.md): it is recorded as it is, since the session's KV cache
        is being built there; the operator admits it or says why not.
        """
        name = session_object_name(identity.session_id, owner)
        while (discarding := self._discarding.get(name)) is not None:
            await discarding.wait()
        known = self._table.session_named(name)
        if known is not None:
            view = self._owned(known, identity, owner)
            if not must_claim(view, self._replica):
                return view, False
            claimed = await self._claim(view)
            if claimed is not None:
                return claimed, False
            # Its creator deleted it (a failed first turn) since this replica saw it:
            # this turn starts the session anew.
            self._table.remove_session(name)
        pending = self._creating.get(name)
        if pending is not None:
            return await asyncio.shield(pending), False
        wait = self._limiter.admit(requester() if requester else "", time.monotonic())
        if wait:
            self._metrics.sessions_created.labels("limited").inc()
            raise RouterError(
                429,
                "too_many_new_sessions",
                "too many new sessions; established sessions are not limited",
                retry_after=wait,
            )
        future: asyncio.Future[SessionView] = asyncio.get_running_loop().create_future()
        self._creating[name] = future
        try:
            view, created = await self._create(name, identity, model, owner, placed)
        except BaseException as error:
            future.set_exception(error)
            future.exception()  # retrieved: no "never retrieved" warning without waiters
            raise
        else:
            future.set_result(view)
            return view, created
        finally:
            del self._creating[name]

    async def _create(
        self, name: str, identity: Identity, model: str, owner: str | None, placed: str | None
    ) -> tuple[SessionView, bool]:
        worker = placed if placed is not None else self._place(identity, model, owner)
        try:
            body = new_session(
                name,
                self._namespace,
                identity,
                model,
                worker_hint=worker,
                owner=owner,
                replica=self._replica,
            )
        except ValidationError as error:
            problems = "; ".join(str(e["msg"]) for e in error.errors())
            raise RouterError(
                400, "invalid_body", f"the session cannot be recorded: {problems}"
            ) from error
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
            raise self._unavailable("the new session could not be recorded", error) from error
        self._owned(SessionView.from_object(obj), identity, owner)
        self._metrics.sessions_created.labels("created" if created else "adopted").inc()
        view = self._table.apply_session(obj)
        if not created and must_claim(view, self._replica):
            claimed = await self._claim(view)
            if claimed is None:
                raise RouterError(
                    503,
                    "session_held",
                    f"session {identity.session_id} was deleted by the replica that created "
                    "it while this turn was routed",
                    retry_after=1,
                )
            view = claimed
        return view, created

    def _place(self, identity: Identity, model: str, owner: str | None) -> str:
        """Return the worker for a new session's first turn; 404 or 503 when none."""
        parent = (
            self._table.session_named(session_object_name(identity.parent_id, owner))
            if identity.parent_id
            else None
        )
        placement = place(
            PlacementRequest(model=model, parent_worker=parent.worker if parent else None),
            self._table.loads(),
        )
        if placement.worker is None:
            if not self._table.has_model(model):
                raise RouterError(404, "model_not_found", f"no InferenceWorker serves {model!r}")
            code = "no_capacity" if placement.reason.value == "NoCapacity" else "no_ready_worker"
            raise RouterError(503, code, placement.message, retry_after=self._retry_after)
        return placement.worker

    async def _claim(self, view: SessionView) -> SessionView | None:
        """Record that this replica serves ``view`` before it does; None if it is gone.

        The creator deletes a session whose first turn failed only if its delete's
        resourceVersion precondition holds: this write lands first (and the delete gets
        409, or sees the claim) or after the delete (404: the session is gone).
        """
        try:
            async with asyncio.timeout(self._timeout):
                obj = await self._kube.patch(
                    SESSIONS, view.name, served_by_patch(self._replica, view.uid), self._namespace
                )
        except (NotFound, Conflict, Invalid):
            return None  # deleted, or another incarnation of the name (its uid differs)
        except (TimeoutError, KubeError) as error:
            logger.warning("cannot claim session %s: %s", view.name, error)
            raise self._unavailable("the session could not be claimed", error) from error
        self._metrics.sessions_created.labels("claimed").inc()
        return self._table.apply_session(obj)

    def _unavailable(self, what: str, error: BaseException) -> RouterError:
        return RouterError(
            503,
            "api_unavailable",
            f"{what} in the Kubernetes API: {error}",
            retry_after=self._retry_after,
        )

    def discard(self, session: SessionView, *, busy: Mapping[str, int]) -> None:
        """Delete, in the background, a session this router created whose first turn failed.

        Kept when any turn of it is in flight here (``busy``), or another replica shows
        having served it (:func:`may_discard`): then it is a session, not an abandoned
        attempt. The delete is conditional on the uid and resourceVersion it was decided
        on, so a claim or usage write that landed since makes it fail (409); it is then
        decided again on a fresh read.
        """
        current = self._table.session_named(session.name)
        if current is None or current.uid != session.uid or busy.get(session.name):
            return
        if current.name in self._discarding:
            return
        done = self._discarding[current.name] = asyncio.Event()
        task = asyncio.get_running_loop().create_task(self._delete(current, done))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _delete(self, session: SessionView, done: asyncio.Event) -> None:
        try:
            outcome = await self._delete_unserved(session)
        finally:
            del self._discarding[session.name]
            done.set()
        self._metrics.sessions_created.labels(outcome).inc()
        if outcome == "discarded":
            self._table.remove_session(session.name)

    async def _delete_unserved(self, session: SessionView) -> str:
        """Delete ``session`` if nobody else served it; return ``discarded`` or ``kept``."""
        view = session
        for _ in range(MAX_DISCARD_ATTEMPTS):
            if not may_discard(view):
                return "kept"
            try:
                await self._kube.delete(
                    SESSIONS,
                    view.name,
                    self._namespace,
                    uid=view.uid,
                    resource_version=view.resource_version,
                )
                return "discarded"
            except NotFound:
                return "discarded"
            except Conflict:
                # Written since ``view`` (the operator's bind, another replica's claim or
                # usage), or another incarnation: decide again on what it is now.
                try:
                    view = SessionView.from_object(
                        await self._kube.get(SESSIONS, view.name, self._namespace)
                    )
                except NotFound:
                    return "discarded"
                except KubeError as error:
                    logger.warning("cannot re-read abandoned session %s: %s", view.name, error)
                    return "kept"
                if view.uid != session.uid:
                    return "kept"
            except KubeError as error:
                logger.warning("cannot delete abandoned session %s: %s", view.name, error)
                return "kept"
        return "kept"


def must_claim(view: SessionView, replica: str) -> bool:
    """Whether ``replica`` must claim a session before it serves a turn of it.

    A session's creator deletes it after a failed first turn unless something shows
    that another replica served it (:func:`may_discard`). A usage write shows it, but
    only after the turn: a replica serving a turn of a session another replica created,
    while nothing shows yet, writes its claim first. Sessions not created by a router
    replica (``created_by`` None: kubectl, say) are never deleted by one.
    """
    created_by = view.created_by
    return (
        created_by is not None
        and created_by != replica
        and not view.usage.turns
        and not view.usage_writes
        and view.served_by is None
    )


def may_discard(view: SessionView) -> bool:
    """Whether a session whose first turn failed here may be deleted, as ``view`` shows it.

    Not once any turn of it was counted, any usage written, or another replica claimed it.
    """
    return not view.usage.turns and not view.usage_writes and view.served_by is None


def owner_label(owner: str | None) -> str | None:
    """Return the owner label value of an authenticated client (None without one)."""
    return label_value(owner) if owner is not None else None


def new_session(
    name: str,
    namespace: str,
    identity: Identity,
    model: str,
    *,
    worker_hint: str,
    owner: str | None,
    replica: str,
) -> dict[str, Any]:
    """Return the AgentSession the router creates for a session's first turn."""
    spec = AgentSessionSpec(
        session_id=identity.session_id,
        parent_session_id=identity.parent_id,
        model=model,
        client=identity.client,
        worker_hint=worker_hint,
    )
    return agent_session(name, namespace, spec, created_by=replica, owner_label=owner_label(owner))


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
        replica: str,
        writes_per_second: float = 50.0,
        concurrency: int = 4,
    ) -> None:
        self._kube = kube
        self._replica = replica
        """The key of this replica's write ids in ``status.usageWrites``: unique per replica."""
        self._namespace = namespace
        self._table = table
        self._ledger = ledger
        self._metrics = metrics
        self._writes_per_second = writes_per_second
        self._slots = asyncio.Semaphore(concurrency)
        self._finishing: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._writing: dict[str, asyncio.Lock] = {}
        self._writers: Counter[str] = Counter()

    async def run(self, tick: float = FLUSH_TICK) -> None:
        """Start the writes that are due, spread evenly over each ``tick`` seconds, forever.

        Started together, a tick's writes would put their work (here, in the API server
        and in etcd: ~4 ms of CPU each) on the machine at once, and every turn in
        flight would wait behind the burst; spread out, a turn meets at most one write.
        """
        while True:
            due = self._due(tick)
            if not due:
                await asyncio.sleep(tick)
                continue
            gap = tick / len(due)
            for name in due:
                self._spawn(self._flush_one(name, time.time()))
                await asyncio.sleep(gap)

    def start_due(self, tick: float = FLUSH_TICK) -> int:
        """Start writing the sessions that are due, within this tick's budget; return how many."""
        now = time.time()
        due = self._due(tick)
        for name in due:
            self._spawn(self._flush_one(name, now))
        return len(due)

    def _due(self, tick: float) -> list[str]:
        """Return the sessions due for a write, at most one tick's budget of them."""
        now = time.time()
        budget = max(1, math.ceil(self._writes_per_second * tick))
        due = self._ledger.due(now, limit=budget)
        self._ledger.prune(now)
        return due

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
                await self._kube.patch(SESSIONS, name, finished_patch(), self._namespace)
        except NotFound:
            pass
        except KubeError as error:
            logger.warning("cannot mark session %s finished: %s", name, error)
        finally:
            self._finishing.discard(name)

    async def _flush_one(self, name: str, now: float) -> None:
        # One write of a session at a time: each write must carry every unconfirmed delta
        # before it (UsageLedger.confirm), which a concurrent write would not see.
        lock = self._writing.setdefault(name, asyncio.Lock())
        self._writers[name] += 1
        try:
            async with lock:
                await self._flush_locked(name, now)
        finally:
            self._writers[name] -= 1
            if not self._writers[name]:
                del self._writers[name], self._writing[name]

    async def _flush_locked(self, name: str, now: float) -> None:
        fresh = self._ledger.take(name, now)
        if fresh is None:
            return
        known = self._table.session_named(name)
        write_id = self._ledger.next_write_id(
            now, known.usage_writes.get(self._replica) if known is not None else None
        )
        async with self._slots:
            try:
                await self._write(name, fresh, write_id)
            except NotFound:
                self._metrics.flushes.labels("gone").inc()
                self._ledger.forget(name)
            except (ApiUnavailable, KubeError) as error:
                self._metrics.flushes.labels("failed").inc()
                logger.warning("usage of session %s not written (%s); will retry", name, error)
                # The API server may have applied it and the answer been lost: the next
                # write reads this write's id in the status and decides (UsageLedger.confirm).
                self._ledger.unanswered(name, write_id, fresh)

    async def _write(self, name: str, fresh: Totals, write_id: int) -> None:
        view = self._table.session_named(name)
        for _ in range(MAX_FLUSH_ATTEMPTS):
            if view is None:
                view = self._table.apply_session(
                    await self._kube.get(SESSIONS, name, self._namespace)
                )
            # Earlier writes without an answer that this status does not show applied.
            delta = fresh.add(self._ledger.confirm(name, view.usage_writes.get(self._replica)))
            if delta == Totals():
                return
            marks = write_marks(view.usage_writes, self._replica, write_id)
            patch = status_patch(view.usage, delta, view.resource_version, marks)
            try:
                obj = await self._kube.patch(SESSIONS, name, patch, self._namespace, status=True)
            except Conflict:
                # Someone else wrote the object since we observed it: re-read, recompute.
                self._metrics.flushes.labels("conflict").inc()
                view = None
                continue
            self._ledger.confirm(name, write_id)
            self._table.apply_session(obj)
            self._metrics.flushes.labels("written").inc()
            return
        raise KubeError(409, f"gave up after {MAX_FLUSH_ATTEMPTS} conflicting writes")
