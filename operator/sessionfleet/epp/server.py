"""The EPP's gRPC server: ``ExternalProcessor.Process`` streams and the health service.

The servicer is thin: each stream is one :class:`~sessionfleet.epp.protocol.Exchange`,
fed the stream's messages and answered with what it returns. Around it:

* a held session's request (Migrating, Restoring, its worker not serving) waits for a
  change of the bindings at most ``hold_timeout`` seconds, then is answered 503
  ``session_held`` with ``Retry-After`` (docs/epp.md, "Held sessions"; the default is
  not to wait, since Envoy's ``message_timeout`` is 200 ms unless configured); turns
  are held and counted by :class:`~sessionfleet.fronts.turns.Turns`, which the router
  uses too, so both fronts signal the migration handshake alike;
* the AgentSession of a new session is created in the background with the EPP's choice
  as ``workerHint`` (:class:`sessionfleet.fronts.kubesync.SessionCreator`): the answer
  to Envoy never waits for the API server;
* a turn's usage goes into the same :class:`~sessionfleet.fronts.ledger.UsageLedger`
  the router uses, written by the router's :class:`~sessionfleet.fronts.kubesync.Flusher`;
* the gRPC health service answers ``liveness`` always, and ``readiness`` and
  ``envoy.service.ext_proc.v3.ExternalProcessor`` once the bindings are loaded, as the
  EPP protocol names them.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Final

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from sessionfleet.epp.gaie_metrics import GaieMetrics
from sessionfleet.epp.picker import EndpointPicker, PickerConfig, Route
from sessionfleet.epp.pool import (
    MismatchCollector,
    PoolView,
    report_mismatches,
    watch_pods,
    watch_pool,
)
from sessionfleet.epp.protocol import Exchange, ExchangeSettings, TurnOutcome
from sessionfleet.fronts.bindings import BindingTable, WorkerView
from sessionfleet.fronts.body import BodyBudget, BodyError, model_of
from sessionfleet.fronts.errors import RouterError
from sessionfleet.fronts.handshake import Acknowledger, LeaseKeeper
from sessionfleet.fronts.identity import session_object_name
from sessionfleet.fronts.kubesync import Flusher, SessionCreator, watch_sessions, watch_workers
from sessionfleet.fronts.ledger import UsageLedger, turn_totals
from sessionfleet.fronts.metrics import RouterMetrics
from sessionfleet.fronts.turns import Turns
from sessionfleet.kube import Kube
from sessionfleet.resources.leases import LeaseSlots
from sessionfleet.supervise import EXIT_TASK_FAILED, Supervisor

logger = logging.getLogger("sessionfleet.epp")

SERVICE_NAME: Final = "envoy.service.ext_proc.v3.ExternalProcessor"
LIVENESS: Final = "liveness"
READINESS: Final = "readiness"
SHUTDOWN_FLUSH_SECONDS: Final = 10.0


@dataclass(frozen=True, slots=True)
class EppSettings:
    """Everything one EPP process needs beyond its API client."""

    namespace: str = "default"
    replica: str = "epp"
    lease_slots: LeaseSlots = LeaseSlots("epp")
    """The slot Leases this replica holds one of (the handshake's liveness)."""
    picker: PickerConfig = field(default_factory=PickerConfig)
    exchange: ExchangeSettings = field(default_factory=ExchangeSettings)
    hold_timeout: float = 0.0
    """Seconds a held session's request waits for a change; 0: answer 503 at once."""
    flush_interval: float = 10.0
    create_timeout: float = 5.0
    pool_name: str | None = None
    """The InferencePool served (``--pool-name``): only its workers, at its target port."""
    unobserved_turn_seconds: float = 120.0
    """How long a turn counts after a gateway half-closed before the response (NGINX
    Gateway Fabric), unless the session's next turn comes first."""
    mode_probe_seconds: float = 0.1
    """How long a stream with no announced mode may go without a body after its headers
    before the EPP takes the gateway for a synchronous one (0: never probe)."""
    max_inflight_body_bytes: int = 192 << 20
    """Bytes of request bodies all streams hold at once; 503 beyond."""


class Processor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """``ExternalProcessor.Process``: one :class:`Exchange` per stream."""

    def __init__(
        self,
        table: BindingTable,
        settings: EppSettings,
        ledger: UsageLedger,
        metrics: RouterMetrics,
        *,
        creator: SessionCreator | None = None,
        flusher: Flusher | None = None,
        pool: PoolView | None = None,
        gaie: GaieMetrics | None = None,
    ) -> None:
        self.table = table
        self.settings = settings
        self.picker = EndpointPicker(table, settings.picker, time.monotonic(), pool)
        self.ledger = ledger
        self.metrics = metrics
        self.creator = creator
        self.flusher = flusher
        self.turns = Turns(table, metrics)
        """Turns in flight here and their holds; the migration handshake reads them."""
        self.gaie = gaie
        self.budget = BodyBudget(settings.max_inflight_body_bytes)
        """Request bodies held until their decision, by every stream together."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._unobserved: dict[str, tuple[asyncio.TimerHandle, WorkerView]] = {}
        """Sessions whose last turn the gateway stopped showing, until it surely ended."""
        self._synchronous_seen = False

    async def Process(  # the gRPC method's name
        self, requests: AsyncIterator[Any], context: Any
    ) -> AsyncIterator[Any]:
        """Answer one request's messages, in order, as Envoy sends them."""
        exchange = Exchange(self.picker, self.settings.exchange, time.time(), self.budget)
        turn = _Turn()
        messages = _Messages(requests)
        self.metrics.in_flight += 1
        try:
            while True:
                probe = (self.settings.mode_probe_seconds or None) if exchange.probing else None
                message = await messages.next(probe)
                if message is _ENDED:
                    break
                if message is _SILENT:
                    # Headers and then nothing: a gateway waiting for their answer.
                    self._took_synchronous()
                    answers = exchange.assume_synchronous(time.monotonic())
                else:
                    body = exchange.body_to_parse(message)
                    if body is not None:
                        exchange.parsed_model = await _parse_model(body)
                    answers = exchange.receive(message, time.monotonic())
                if exchange.held is not None:
                    self._arrived(session_object_name(exchange.held.session_id, None))
                    answers = await self._hold(exchange)
                if exchange.route is not None and turn.route is None:
                    self._begin(turn, exchange.route, exchange)
                if turn.route is not None and exchange.responded:
                    self._create(turn, exchange.served)
                for answer in answers:
                    yield answer
                if turn.route is not None and exchange.outcome is not None:
                    # The turn ends at the response's end, whenever the stream does.
                    self._end(turn)
                if exchange.closed:
                    return
            turn.half_closed = True
        finally:
            messages.cancel()
            exchange.close()
            self.metrics.in_flight -= 1
            self._finish(turn, exchange)

    def _took_synchronous(self) -> None:
        """Say once that a gateway announced no mode and waited for the headers answer."""
        if not self._synchronous_seen:
            self._synchronous_seen = True
            logger.warning(
                "a gateway announced no body mode (no protocol_config) and sent no body "
                "within %g s of the headers: deciding at the headers for such streams, as "
                "in STREAMED mode; set --request-body-mode to the gateway's mode (BUFFERED "
                "or STREAMED) to skip the wait",
                self.settings.mode_probe_seconds,
            )

    def _begin(self, turn: _Turn, route: Route, exchange: Exchange) -> None:
        turn.route = route
        if route.session is not None:
            self._arrived(route.session)
        self.turns.started(route.workers[0], route.session)
        if self.gaie is not None:
            self.gaie.started(exchange.requested_model, route.model)

    def _arrived(self, session: str) -> None:
        """End the session's unobserved turn, if any: its next request shows it ended.

        An agent's turns come one after another, so a request of the session (routed or
        held) means the turn a gateway stopped showing us is over (see _finish).
        """
        lingering = self._unobserved.pop(session, None)
        if lingering is not None:
            handle, worker = lingering
            handle.cancel()
            self.turns.ended(worker, session)

    def _end(self, turn: _Turn) -> None:
        if turn.route is not None and not turn.ended:
            turn.ended = True
            self.turns.ended(turn.route.workers[0], turn.route.session)

    def _finish(self, turn: _Turn, exchange: Exchange) -> None:
        route = turn.route
        if route is not None and not turn.ended:
            if turn.half_closed and not exchange.responded:
                # The gateway half-closed after the request (NGINX Gateway Fabric's shim
                # does): the response goes on at the engine where this stream cannot
                # see it. The turn stays counted until the session's next turn, or
                # unobserved_turn_seconds, so a migration does not start under it.
                self._create(turn, None)
                self._linger(turn)
            else:
                self._end(turn)
        if route is not None and route.new is not None and not turn.created:
            # No answer reached the client: nothing to record (the router discards too).
            self.picker.created(route.session or "")
        self._account(exchange, route, unobserved=turn.half_closed and not exchange.responded)

    def _linger(self, turn: _Turn) -> None:
        route = turn.route
        assert route is not None
        turn.ended = True
        if route.session is None:
            self.turns.ended(route.workers[0], None)
            return
        session, worker = route.session, route.workers[0]

        def end() -> None:
            if self._unobserved.pop(session, None) is not None:
                self.turns.ended(worker, session)

        self._arrived(session)
        handle = asyncio.get_running_loop().call_later(self.settings.unobserved_turn_seconds, end)
        self._unobserved[session] = (handle, worker)

    async def _hold(self, exchange: Exchange) -> list[Any]:
        def retry() -> list[Any] | None:
            answers = exchange.retry(time.monotonic())
            return None if exchange.waiting else answers

        answers = await self.turns.hold(retry, self.settings.hold_timeout)
        if answers is None:
            return exchange.give_up(self.settings.hold_timeout)
        return answers

    def _create(self, turn: _Turn, served: str | None) -> None:
        """Record a new session where it was served, in the background (off the hot path).

        A data plane that fell back to another endpoint of the list says so in the
        served endpoint: the session is bound there, where its prefix now is.
        """
        route = turn.route
        if route is None or route.new is None or route.session is None or turn.created:
            return
        turn.created = True
        new, name = route.new, route.session
        worker = new.worker
        first = (served or "").split(",")[0].strip()
        if first and first != route.endpoints[0]:
            by_address = dict(zip(route.endpoints, route.workers, strict=True))
            fallback = by_address.get(first)
            if fallback is None:
                logger.warning(
                    "new session %s served by %s, not an endpoint it was sent to",
                    new.identity.session_id,
                    first,
                )
            else:
                worker = fallback.name
                self.picker.served_by(name, worker)
                logger.info(
                    "new session %s served by fallback %s: bound there",
                    new.identity.session_id,
                    worker,
                )
        creator = self.creator
        if creator is None:
            return

        async def create() -> None:
            try:
                await creator.ensure(new.identity, new.model, placed=worker)
            except RouterError as error:
                logger.warning("session %s not recorded: %s", new.identity.session_id, error)
            finally:
                self.picker.created(name)

        task = asyncio.get_running_loop().create_task(create())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _account(self, exchange: Exchange, route: Route | None, *, unobserved: bool) -> None:
        outcome: TurnOutcome = exchange.ended()
        if route is None:
            refused = exchange.refused
            status = refused.status if refused else 499
            self.metrics.request("other", status, None)
            if self.gaie is not None and refused is not None:
                self.gaie.refused(exchange.requested_model, None, status)
            return
        worker = route.workers[0]
        kind = "session" if route.session is not None else "stateless"
        # 0: the gateway did not pass the response through this stream.
        self.metrics.request(kind, 0 if unobserved else outcome.status or 499, None)
        if self.gaie is not None:
            self.gaie.finished(
                exchange.requested_model,
                route.model,
                status=outcome.status,
                seconds=time.time() - exchange.started,
                request_bytes=exchange.request_bytes,
                response_bytes=exchange.response_bytes,
                usage=outcome.usage,
                completed=outcome.completed,
            )
        if not (outcome.completed and outcome.status == 200):
            return
        served = outcome.served
        if served is not None and served.split(",")[0].strip() in route.endpoints[1:]:
            worker = route.workers[route.endpoints.index(served.split(",")[0].strip())]
        self.metrics.usage(worker.name, outcome.usage)
        if route.session is None or route.identity is None:
            return
        totals = turn_totals(outcome.usage, started=exchange.started, now=time.time())
        self.ledger.record(route.session, totals)
        if route.identity.final and self.flusher is not None:
            self.flusher.finish(route.session)


@dataclass(slots=True)
class _Turn:
    """Where one stream's turn stands."""

    route: Route | None = None
    created: bool = False
    """Whether the new session's AgentSession create was started."""
    ended: bool = False
    """Whether the turn stopped counting (the response's end, or handed to a timer)."""
    half_closed: bool = False
    """Whether the gateway ended the stream itself (not a reset or an EPP answer)."""


_ENDED: Final = object()
"""The gateway ended the stream."""
_SILENT: Final = object()
"""No message came within the wait."""


class _Messages:
    """A stream's request messages, read with an optional wait that cancels nothing.

    A read cut short by a timeout would leave gRPC's stream in an unknown state, so the
    pending read is kept and awaited by the next call instead.
    """

    def __init__(self, requests: AsyncIterator[Any]) -> None:
        self._requests = aiter(requests)
        self._pending: asyncio.Future[Any] | None = None

    async def next(self, wait: float | None) -> Any:
        """Return the next message, ``_ENDED``, or ``_SILENT`` after ``wait`` seconds."""
        if wait is None and self._pending is None:
            return await anext(self._requests, _ENDED)
        if self._pending is None:
            self._pending = asyncio.ensure_future(anext(self._requests, _ENDED))
        done, _ = await asyncio.wait({self._pending}, timeout=wait)
        if not done:
            return _SILENT
        pending, self._pending = self._pending, None
        return pending.result()

    def cancel(self) -> None:
        """Stop a read still pending (the stream is over)."""
        if self._pending is not None:
            self._pending.cancel()


async def _parse_model(body: bytes) -> str | BodyError:
    """Return the body's model, or why there is none, with a large walk off the loop."""
    try:
        return await model_of(body)
    except BodyError as error:
        return error


class Health:
    """The gRPC health service with the EPP protocol's service names."""

    def __init__(
        self,
        table: BindingTable,
        supervisor: Supervisor | None = None,
        pool: PoolView | None = None,
    ) -> None:
        self.servicer = health.aio.HealthServicer()
        self._table = table
        self._supervisor = supervisor
        self._pool = pool

    async def update(self) -> None:
        """Set every service's status from the table and the background tasks."""
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        healthy = self._supervisor is None or self._supervisor.healthy
        synced = self._table.synced and (self._pool is None or self._pool.synced)
        ready = serving if synced and healthy else not_serving
        await self.servicer.set(LIVENESS, serving)
        await self.servicer.set(READINESS, ready)
        await self.servicer.set(SERVICE_NAME, ready)
        await self.servicer.set("", ready)

    async def run(self, interval: float = 1.0) -> None:
        """Keep the statuses current, forever."""
        while True:
            await self.update()
            await asyncio.sleep(interval)


def grpc_server(
    processor: Processor,
    health_service: Health,
    address: str,
    *,
    credentials: Any | None = None,
) -> tuple[Any, int]:
    """Return a grpc.aio server with both services added, and the port it is bound to.

    With ``credentials`` the port serves TLS, else plaintext. One message may be up to
    twice the body limit (:func:`receive_limit`): a body over the limit is then answered
    413 by the EPP, not refused by gRPC with a stream error.
    """
    limit = receive_limit(processor.settings.exchange.max_body_bytes)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit)])
    pb_grpc.add_ExternalProcessorServicer_to_server(processor, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_service.servicer, server)
    if credentials is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, credentials)
    return server, port


def receive_limit(max_body_bytes: int) -> int:
    """Return the largest gRPC message the EPP accepts: twice the body limit, and 1 MiB.

    A BUFFERED body arrives as one message; grpc.aio's own default (4 MiB) refused
    4-8 MiB bodies with a stream error. Past this, gRPC refuses the message (the
    gateway then fails the request as its failure mode says).
    """
    return 2 * max_body_bytes + (1 << 20)


def health_server(health_service: Health, address: str) -> tuple[Any, int]:
    """Return a plaintext grpc.aio server of the health service alone, and its port.

    Kubernetes' gRPC probes cannot speak TLS, so the probes use this port (upstream's
    EPP has its own health port too); the ext_proc port keeps the health service for
    gateways that check it over their TLS connection.
    """
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health_service.servicer, server)
    return server, server.add_insecure_port(address)


@dataclass(frozen=True, slots=True)
class Listeners:
    """Where the EPP listens, and how."""

    host: str = "0.0.0.0"
    port: int = 9002
    """ext_proc and the health service, TLS unless ``secure`` is off."""
    health_port: int = 9003
    """The health service alone, plaintext (Kubernetes' gRPC probes); 0: none."""
    metrics_port: int = 9090
    """Prometheus metrics; 0: none."""
    secure: bool = True
    cert_path: str | None = None
    """A directory with ``tls.crt`` and ``tls.key``; None: self-signed at start."""


async def serve(kube: Kube, settings: EppSettings, listeners: Listeners) -> int:
    """Run an EPP until SIGTERM or SIGINT, or until a background task fails."""
    from prometheus_client import start_http_server

    from sessionfleet.epp.tls import credentials

    if listeners.secure:
        tls, how = credentials(listeners.cert_path)
    else:
        tls, how = None, "plaintext (--no-secure-serving)"
    host, port, metrics_port = listeners.host, listeners.port, listeners.metrics_port

    table = BindingTable()
    ledger = UsageLedger(settings.flush_interval)
    metrics = RouterMetrics(table)
    creator = SessionCreator(
        kube,
        settings.namespace,
        table,
        metrics,
        replica=settings.replica,
        timeout=settings.create_timeout,
        retry_after=settings.picker.retry_after,
    )
    flusher = Flusher(kube, settings.namespace, table, ledger, metrics, replica=settings.replica)
    pool = PoolView(settings.pool_name) if settings.pool_name else None
    in_pool = (lambda w: pool.address(w) is not None) if pool is not None else (lambda w: True)
    gaie = GaieMetrics(metrics.registry, table, settings.pool_name or "", in_pool)
    processor = Processor(
        table, settings, ledger, metrics, creator=creator, flusher=flusher, pool=pool, gaie=gaie
    )
    supervisor = Supervisor(logger)
    health_service = Health(table, supervisor, pool)
    await health_service.update()
    server, bound = grpc_server(processor, health_service, f"{host}:{port}", credentials=tls)
    servers = [server]
    if listeners.health_port:
        servers.append(health_server(health_service, f"{host}:{listeners.health_port}")[0])
    if metrics_port:
        start_http_server(metrics_port, registry=metrics.registry)
    supervisor.start("worker watch", watch_workers(kube, settings.namespace, table))
    supervisor.start("session watch", watch_sessions(kube, settings.namespace, table, ledger))
    supervisor.start("usage flusher", flusher.run())
    if pool is not None:
        supervisor.start("pool watch", watch_pool(kube, settings.namespace, pool))
        supervisor.start("pod watch", watch_pods(kube, settings.namespace, pool))
        supervisor.start("pool mismatch report", report_mismatches(pool, table))
        metrics.registry.register(MismatchCollector(pool, lambda: table.workers.values()))
    supervisor.start("health", health_service.run())
    # The turn-boundary handshake, as a router replica takes part in it: a live Lease
    # makes the operator wait for this replica's acknowledgement before it moves a
    # session, and the acknowledgement is written once no turn of it is in flight here.
    lease = LeaseKeeper(kube, settings.namespace, settings.replica, settings.lease_slots)
    acknowledger = Acknowledger(
        kube,
        settings.namespace,
        settings.replica,
        table,
        processor.turns,
    )
    supervisor.start("lease keeper", lease.run())
    supervisor.start("migration acknowledger", acknowledger.run())
    for each in servers:
        await each.start()
    logger.info("EPP %s serving ext_proc on %s:%d, %s", settings.replica, host, bound, how)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        failure = await supervisor.wait(stop)
    finally:
        await asyncio.gather(*(each.stop(grace=5) for each in servers))
        await supervisor.stop()
        try:
            async with asyncio.timeout(SHUTDOWN_FLUSH_SECONDS):
                await flusher.flush_all()
        except TimeoutError:
            logger.warning("usage of %d sessions was not written", len(ledger))
        await lease.release()
        await kube.aclose()
    if failure is not None:
        logger.error("exiting: %s", failure)
        return EXIT_TASK_FAILED
    return 0
