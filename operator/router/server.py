"""Assembling and running one router: table, watches, flusher, proxy, HTTP server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Final

import aiohttp
from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from sessionfleet.kube import Kube
from sessionfleet.router.bindings import BindingTable
from sessionfleet.router.handshake import Acknowledger, LeaseKeeper
from sessionfleet.router.kubesync import (
    FLUSH_TICK,
    Flusher,
    SessionCreator,
    watch_sessions,
    watch_workers,
)
from sessionfleet.router.ledger import UsageLedger
from sessionfleet.router.metrics import RouterMetrics
from sessionfleet.router.proxy import Proxy, RouterConfig

logger = logging.getLogger("sessionfleet.router")

SHUTDOWN_FLUSH_SECONDS: Final = 10.0


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """Everything one router process needs beyond its API client."""

    namespace: str
    replica: str
    config: RouterConfig = RouterConfig()
    flush_interval: float = 10.0
    flush_writes_per_second: float = 50.0
    flush_tick: float = FLUSH_TICK
    create_timeout: float = 5.0
    connect_timeout: float = 5.0
    read_timeout: float = 600.0


class Router:
    """One router: build with a Kube client, then ``async with router.running(): ...``."""

    def __init__(self, kube: Kube, settings: RouterSettings) -> None:
        self.kube = kube
        self.settings = settings
        self.table = BindingTable()
        self.ledger = UsageLedger(settings.flush_interval)
        self.metrics = RouterMetrics(self.table)
        self.creator = SessionCreator(
            kube,
            settings.namespace,
            self.table,
            self.metrics,
            replica=settings.replica,
            timeout=settings.create_timeout,
            retry_after=settings.config.retry_after,
        )
        self.flusher = Flusher(
            kube,
            settings.namespace,
            self.table,
            self.ledger,
            self.metrics,
            writes_per_second=settings.flush_writes_per_second,
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._proxy: Proxy | None = None

    def app(self) -> web.Application:
        """Return the aiohttp application (the upstream client is created on startup)."""
        app = web.Application(client_max_size=self.settings.config.max_body_bytes)
        app.cleanup_ctx.append(self._lifecycle)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/{path:.+}", self._handle)
        app.router.add_route("*", "/{path:.*}", self._not_found)
        return app

    @contextlib.asynccontextmanager
    async def _client_session(self) -> AsyncIterator[aiohttp.ClientSession]:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, ttl_dns_cache=300)
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=self.settings.connect_timeout,
            sock_read=self.settings.read_timeout,
        )
        # auto_decompress=False: compressed answers pass through byte for byte, as a
        # proxy should. No automatic Accept-Encoding: a client that did not ask for
        # compression does not get it.
        async with aiohttp.ClientSession(
            connector=connector,
            timeout=timeout,
            # A proxy keeps no cookies of its own; skipping the jar saves work per turn.
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent"),
        ) as client:
            yield client

    async def _lifecycle(self, _: web.Application) -> AsyncIterator[None]:
        async with self._client_session() as client:
            self._proxy = Proxy(
                self.settings.config,
                self.table,
                self.ledger,
                self.metrics,
                self.creator,
                self.flusher,
                client,
            )
            namespace = self.settings.namespace
            lease = LeaseKeeper(self.kube, namespace, self.settings.replica)
            acknowledger = Acknowledger(
                self.kube,
                namespace,
                self.settings.replica,
                self.table,
                self._proxy.session_turns,
                self._proxy.turn_ended,
            )
            self._tasks = [
                asyncio.create_task(watch_workers(self.kube, namespace, self.table)),
                asyncio.create_task(watch_sessions(self.kube, namespace, self.table, self.ledger)),
                asyncio.create_task(self.flusher.run(self.settings.flush_tick)),
                asyncio.create_task(lease.run()),
                asyncio.create_task(acknowledger.run()),
            ]
            try:
                yield
            finally:
                for task in self._tasks:
                    task.cancel()
                await asyncio.gather(*self._tasks, return_exceptions=True)
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

    async def _not_found(self, request: web.Request) -> web.StreamResponse:
        return await self.proxy.not_found(request)

    async def _healthz(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _readyz(self, _: web.Request) -> web.Response:
        if self.table.synced:
            return web.Response(text="ok")
        return web.Response(status=503, text="bindings not loaded yet")

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )


async def serve(kube: Kube, settings: RouterSettings, host: str, port: int) -> None:
    """Run a router until SIGTERM or SIGINT; write pending usage before exiting."""
    router = Router(kube, settings)
    runner = web.AppRunner(router.app(), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True, backlog=1024)
    await site.start()
    logger.info(
        "router %s serving on http://%s:%d (namespace %s)",
        settings.replica,
        host,
        port,
        settings.namespace,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await kube.aclose()
