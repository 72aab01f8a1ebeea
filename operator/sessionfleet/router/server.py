"""Assembling and running one router: table, watches, flusher, proxy, HTTP server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from sessionfleet.fronts.admission import ApiKeys, NewSessionLimiter
from sessionfleet.fronts.bindings import BindingTable
from sessionfleet.fronts.errors import REASON_HEADER, RouterError
from sessionfleet.fronts.handshake import Acknowledger, LeaseKeeper
from sessionfleet.fronts.kubesync import (
    FLUSH_TICK,
    Flusher,
    SessionCreator,
    watch_sessions,
    watch_workers,
)
from sessionfleet.fronts.ledger import UsageLedger
from sessionfleet.fronts.metrics import RouterMetrics
from sessionfleet.kube import Kube
from sessionfleet.resources.leases import LeaseSlots
from sessionfleet.router.collector import tune_collector
from sessionfleet.router.heads import HeadGuard, bounded_handler, head_limit
from sessionfleet.router.paths import SERVED_POSTS, only_served_paths
from sessionfleet.router.proxy import Proxy, RouterConfig
from sessionfleet.router.upstream import Upstream
from sessionfleet.supervise import EXIT_TASK_FAILED, Supervisor

logger = logging.getLogger("sessionfleet.router")

SHUTDOWN_FLUSH_SECONDS: Final = 10.0


KEYS_RELOAD_SECONDS: Final = 10.0
"""How often the API key folder is looked at for a rotated Secret."""


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """Everything one router process needs beyond its API client."""

    namespace: str
    replica: str
    lease_slots: LeaseSlots = LeaseSlots("router")
    """The slot Leases this replica holds one of (the handshake's liveness)."""
    config: RouterConfig = RouterConfig()
    flush_interval: float = 10.0
    flush_writes_per_second: float = 50.0
    flush_tick: float = FLUSH_TICK
    create_timeout: float = 5.0
    connect_timeout: float = 5.0
    read_timeout: float = 600.0
    api_keys_dir: Path | None = None
    """A folder with one file per client holding its key; None: no authentication."""
    max_connections: int = 4096
    idle_timeout: float = 30.0
    """Seconds a connection may take to send a request's headers, or sit idle between
    requests, before it is closed."""

    def server_options(self) -> dict[str, Any]:
        """Return the HTTP server's settings (for :class:`aiohttp.web.AppRunner`)."""
        return {
            # Request bodies are never inflated (intake answers 415 for compressed
            # ones); this keeps aiohttp from doing it behind our back.
            "auto_decompress": False,
            # aiohttp's keep-alive timer also runs from the moment a connection opens
            # until its first request's headers are complete: the header timeout.
            "keepalive_timeout": self.idle_timeout,
            # After an answer given before the body was read (413, 415, 408), aiohttp
            # reads and drops the rest for this long, so the client sees the answer
            # rather than a reset; not 10 s, which a slow client could hold.
            "lingering_time": min(2.0, self.idle_timeout),
            "access_log": None,
        }


class Router:
    """One router: build with a Kube client, then ``async with router.running(): ...``."""

    def __init__(self, kube: Kube, settings: RouterSettings) -> None:
        self.kube = kube
        self.settings = settings
        self.table = BindingTable()
        self.ledger = UsageLedger(settings.flush_interval)
        self.metrics = RouterMetrics(self.table)
        self.heads = HeadGuard(settings.config.intake, self.metrics.registry)
        self.keys = ApiKeys(settings.api_keys_dir) if settings.api_keys_dir else None
        self.creator = SessionCreator(
            kube,
            settings.namespace,
            self.table,
            self.metrics,
            replica=settings.replica,
            timeout=settings.create_timeout,
            retry_after=settings.config.retry_after,
            limiter=NewSessionLimiter(settings.config.session_rates, time.monotonic()),
        )
        self.flusher = Flusher(
            kube,
            settings.namespace,
            self.table,
            self.ledger,
            self.metrics,
            replica=settings.replica,
            writes_per_second=settings.flush_writes_per_second,
        )
        self.supervisor = Supervisor(logger)
        self._proxy: Proxy | None = None

    def app(self) -> web.Application:
        """Return the aiohttp application (the upstream client is created on startup)."""
        intake = self.settings.config.intake
        app = web.Application(
            client_max_size=intake.max_body_bytes,
            middlewares=[only_served_paths, head_limit(intake)],
        )
        app.cleanup_ctx.append(self._lifecycle)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model:.+}", self._model)
        for path in sorted(SERVED_POSTS):
            app.router.add_post(path, self._handle)
        app.router.add_route("*", "/{path:.*}", self._not_found)
        return app

    @contextlib.asynccontextmanager
    async def _upstream(self) -> AsyncIterator[Upstream]:
        # Answers pass through byte for byte, compressed or not, as a proxy's should; no
        # field is added but Host and Content-Length.
        upstream = Upstream(
            connect_timeout=self.settings.connect_timeout,
            read_timeout=self.settings.read_timeout,
        )
        try:
            yield upstream
        finally:
            await upstream.aclose()

    async def _lifecycle(self, _: web.Application) -> AsyncIterator[None]:
        async with self._upstream() as upstream:
            self._proxy = Proxy(
                self.settings.config,
                self.table,
                self.ledger,
                self.metrics,
                self.creator,
                self.flusher,
                upstream,
                self.keys,
            )
            namespace = self.settings.namespace
            lease = LeaseKeeper(
                self.kube, namespace, self.settings.replica, self.settings.lease_slots
            )
            acknowledger = Acknowledger(
                self.kube,
                namespace,
                self.settings.replica,
                self.table,
                self._proxy.turns,
            )
            supervisor = self.supervisor
            supervisor.start("worker watch", watch_workers(self.kube, namespace, self.table))
            supervisor.start(
                "session watch", watch_sessions(self.kube, namespace, self.table, self.ledger)
            )
            supervisor.start("usage flusher", self.flusher.run(self.settings.flush_tick))
            supervisor.start("lease keeper", lease.run())
            supervisor.start("migration acknowledger", acknowledger.run())
            if self.keys is not None:
                supervisor.start("API key reloader", _reload_keys(self.keys))
            try:
                yield
            finally:
                await supervisor.stop()
                try:
                    async with asyncio.timeout(SHUTDOWN_FLUSH_SECONDS):
                        await self.flusher.flush_all()
                except TimeoutError:
                    logger.warning("usage of %d sessions was not written", len(self.ledger))
                await lease.release()

    @property
    def proxy(self) -> Proxy:
        """The request handlers; they exist while the application runs."""
        if self._proxy is None:
            raise RuntimeError("the router application is not running")
        return self._proxy

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        return await self.proxy.handle(request)

    async def _models(self, request: web.Request) -> web.StreamResponse:
        return await self.proxy.models(request)

    async def _model(self, request: web.Request) -> web.StreamResponse:
        return await self.proxy.model(request)

    async def _not_found(self, request: web.Request) -> web.StreamResponse:
        return await self.proxy.not_found(request)

    async def _healthz(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _readyz(self, _: web.Request) -> web.Response:
        if self.supervisor.failure is not None:
            return web.Response(status=503, text=str(self.supervisor.failure))
        if self.table.synced:
            return web.Response(text="ok")
        return web.Response(status=503, text="bindings not loaded yet")

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )


class QuietRefusals(logging.Filter):
    """Keep requests the HTTP parser refused out of the error log.

    aiohttp answers a request that is not HTTP (a bad request line, a header line over
    8 KiB, too many headers) with its own 400 and logs it at ERROR with a traceback;
    anyone who can reach the router could fill its log that way. Those records go to
    DEBUG; every other error aiohttp logs is kept as it is.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        """Demote a refusal of malformed HTTP to DEBUG; pass everything else."""
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError) and record.levelno >= logging.ERROR:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            record.exc_info = None
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


class _ConnectionLimit:
    """The listening socket's protocol factory: aiohttp's handler while under the limit.

    Beyond ``limit`` open connections a new one is answered 503 at once and closed, so
    that many idle or slow clients cannot hold every socket and buffer of the router.
    The handler charges the request heads it receives to ``heads`` (:mod:`.heads`).
    """

    def __init__(self, server: web.Server, limit: int, retry_after: int, heads: HeadGuard) -> None:
        self._server = server
        self._heads = heads
        self._limit = limit
        self._refusal = _refusal(retry_after)
        self.refused = 0

    def __call__(self) -> asyncio.BaseProtocol:
        if len(self._server.connections) >= self._limit:
            self.refused += 1
            return _Refuse(self._refusal)
        return bounded_handler(self._server, self._heads)


def _refusal(retry_after: int) -> bytes:
    body = RouterError(
        503, "too_many_connections", "the router has too many open connections; retry shortly"
    ).body()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "Content-Type: application/json\r\n"
        f"Retry-After: {retry_after}\r\n"
        f"{REASON_HEADER}: too_many_connections\r\n"
        "Connection: close\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class _Refuse(asyncio.Protocol):
    def __init__(self, answer: bytes) -> None:
        self._answer = answer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(self._answer)
        transport.close()


async def serve(kube: Kube, settings: RouterSettings, host: str, port: int) -> int:
    """Run a router until SIGTERM or SIGINT, or until a background task fails.

    Pending usage is written before exiting. Returns the exit status: 0 after a
    signal, 1 when a background task failed (Kubernetes then restarts the pod).
    """
    router = Router(kube, settings)
    logging.getLogger("aiohttp.server").addFilter(QuietRefusals())
    runner = web.AppRunner(router.app(), handle_signals=False, **settings.server_options())
    await runner.setup()
    assert runner.server is not None
    loop = asyncio.get_running_loop()
    limit = _ConnectionLimit(
        runner.server, settings.max_connections, settings.config.retry_after, router.heads
    )
    # Everything loaded so far lives as long as the process: out of the collector's way.
    frozen = tune_collector()
    logger.debug("froze %d start-up objects out of the garbage collector's walks", frozen)
    listener = await loop.create_server(limit, host, port, reuse_address=True, backlog=1024)
    logger.info(
        "router %s serving on http://%s:%d (namespace %s)",
        settings.replica,
        host,
        port,
        settings.namespace,
    )
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        failure = await router.supervisor.wait(stop)
    finally:
        listener.close()
        await runner.cleanup()
        await kube.aclose()
    if failure is not None:
        logger.error("exiting: %s", failure)
        return EXIT_TASK_FAILED
    return 0


async def _reload_keys(keys: ApiKeys) -> None:
    """Pick up a rotated Secret; a folder that became unreadable keeps the last keys."""
    while True:
        await asyncio.sleep(KEYS_RELOAD_SECONDS)
        try:
            await asyncio.to_thread(keys.reload)
        except (OSError, ValueError) as error:
            logger.warning("API keys not reloaded, keeping the last ones: %s", error)
