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

from sessionfleet.epp.picker import EndpointPicker, NewSession, PickerConfig, Route
from sessionfleet.epp.protocol import Exchange, ExchangeSettings, TurnOutcome
from sessionfleet.fronts.bindings import BindingTable
from sessionfleet.fronts.errors import RouterError
from sessionfleet.fronts.handshake import Acknowledger, LeaseKeeper
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
    ) -> None:
        self.table = table
        self.settings = settings
        self.picker = EndpointPicker(table, settings.picker, time.monotonic())
        self.ledger = ledger
        self.metrics = metrics
        self.creator = creator
        self.flusher = flusher
        self.turns = Turns(table, metrics)
        """Turns in flight here and their holds; the migration handshake reads them."""
        self._tasks: set[asyncio.Task[None]] = set()

    async def Process(  # the gRPC method's name
        self, requests: AsyncIterator[Any], context: Any
    ) -> AsyncIterator[Any]:
        """Answer one request's messages, in order, as Envoy sends them."""
        exchange = Exchange(self.picker, self.settings.exchange, time.time())
        counted: Route | None = None
        self.metrics.in_flight.inc()
        try:
            async for message in requests:
                answers = exchange.receive(message, time.monotonic())
                if exchange.waiting:
                    answers = await self._hold(exchange)
                if exchange.route is not None and counted is None:
                    counted = exchange.route
                    self.turns.started(counted.workers[0], counted.session)
                    if counted.new is not None and counted.session is not None:
                        self._create(counted.session, counted.new)
                for answer in answers:
                    yield answer
                if exchange.closed:
                    return
        finally:
            self.metrics.in_flight.dec()
            if counted is not None:
                self.turns.ended(counted.workers[0], counted.session)
            self._account(exchange, counted)

    async def _hold(self, exchange: Exchange) -> list[Any]:
        def retry() -> list[Any] | None:
            answers = exchange.retry(time.monotonic())
            return None if exchange.waiting else answers

        answers = await self.turns.hold(retry, self.settings.hold_timeout)
        if answers is None:
            return exchange.give_up(self.settings.hold_timeout)
        return answers

    def _create(self, name: str, new: NewSession) -> None:
        """Record a new session in the background (off the hot path)."""
        creator = self.creator
        if creator is None:
            return

        async def create() -> None:
            try:
                await creator.ensure(new.identity, new.model, placed=new.worker)
            except RouterError as error:
                logger.warning("session %s not recorded: %s", new.identity.session_id, error)
            finally:
                self.picker.created(name)

        task = asyncio.get_running_loop().create_task(create())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _account(self, exchange: Exchange, route: Route | None) -> None:
        outcome: TurnOutcome = exchange.ended()
        if route is None:
            refused = exchange.refused
            self.metrics.request("other", refused.status if refused else 499, None)
            return
        worker = route.workers[0]
        kind = "session" if route.session is not None else "stateless"
        self.metrics.request(kind, outcome.status or 499, None)
        served = outcome.served
        if served is not None and served.split(",")[0].strip() != route.endpoints[0]:
            logger.info("request for %s served by %s instead", route.endpoints[0], served)
        if not (outcome.completed and outcome.status == 200):
            return
        self.metrics.usage(worker.name, outcome.usage)
        if route.session is None or route.identity is None:
            return
        totals = turn_totals(outcome.usage, started=exchange.started, now=time.time())
        self.ledger.record(route.session, totals)
        if route.identity.final and self.flusher is not None:
            self.flusher.finish(route.session)


class Health:
    """The gRPC health service with the EPP protocol's service names."""

    def __init__(self, table: BindingTable, supervisor: Supervisor | None = None) -> None:
        self.servicer = health.aio.HealthServicer()
        self._table = table
        self._supervisor = supervisor

    async def update(self) -> None:
        """Set every service's status from the table and the background tasks."""
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        healthy = self._supervisor is None or self._supervisor.healthy
        ready = serving if self._table.synced and healthy else not_serving
        await self.servicer.set(LIVENESS, serving)
        await self.servicer.set(READINESS, ready)
        await self.servicer.set(SERVICE_NAME, ready)
        await self.servicer.set("", ready)

    async def run(self, interval: float = 1.0) -> None:
        """Keep the statuses current, forever."""
        while True:
            await self.update()
            await asyncio.sleep(interval)


def grpc_server(processor: Processor, health_service: Health, address: str) -> tuple[Any, int]:
    """Return a grpc.aio server with both services added, and the port it is bound to."""
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(processor, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_service.servicer, server)
    port = server.add_insecure_port(address)
    return server, port


async def serve(kube: Kube, settings: EppSettings, host: str, port: int, metrics_port: int) -> int:
    """Run an EPP until SIGTERM or SIGINT, or until a background task fails."""
    from prometheus_client import start_http_server

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
    processor = Processor(table, settings, ledger, metrics, creator=creator, flusher=flusher)
    supervisor = Supervisor(logger)
    health_service = Health(table, supervisor)
    await health_service.update()
    server, bound = grpc_server(processor, health_service, f"{host}:{port}")
    if metrics_port:
        start_http_server(metrics_port, registry=metrics.registry)
    supervisor.start("worker watch", watch_workers(kube, settings.namespace, table))
    supervisor.start("session watch", watch_sessions(kube, settings.namespace, table, ledger))
    supervisor.start("usage flusher", flusher.run())
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
    await server.start()
    logger.info("EPP %s serving ext_proc on %s:%d", settings.replica, host, bound)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        failure = await supervisor.wait(stop)
    finally:
        await server.stop(grace=5)
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
