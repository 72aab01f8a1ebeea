"""A router test bed on 127.0.0.1: real simulated engines, routers, the fake Kubernetes API.

Shared by the router's unit tests (the ``fleet`` and ``http`` fixtures are in conftest).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import aiohttp.web
from aiohttp.test_utils import TestServer
from router_fakes import FakeKube

from sessionfleet.kube import WORKERS
from sessionfleet.router.proxy import RouterConfig
from sessionfleet.router.server import Router, RouterSettings
from sessionfleet.simengine.engine import EngineConfig
from sessionfleet.simengine.server import build_app

MODEL = "agent-model"
NS = "default"
SYSTEM = "You are a careful coding agent. " * 30


def worker_object(
    name: str, endpoint: str, *, phase: str = "Ready", model: str = MODEL, max_sessions: int = 8
) -> dict[str, Any]:
    return {
        "apiVersion": "sessionfleet.dev/v1alpha1",
        "kind": "InferenceWorker",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"model": model, "capacity": {"maxSessions": max_sessions}},
        "status": {"phase": phase, "endpoint": endpoint},
    }


class Fleet:
    """Engines, a fake API and routers, all on 127.0.0.1."""

    def __init__(self) -> None:
        self.kube = FakeKube()
        self.servers: list[TestServer] = []
        self.routers: list[Router] = []
        self.http: aiohttp.ClientSession | None = None

    async def engine(self, name: str, **config: Any) -> str:
        server = TestServer(build_app(EngineConfig(model=MODEL, **config)), host="127.0.0.1")
        await server.start_server()
        self.servers.append(server)
        endpoint = str(server.make_url("")).rstrip("/")
        self.kube.put(WORKERS.plural, worker_object(name, endpoint))
        return endpoint

    async def fake_engine(self, name: str, handler: Any, path: str = "/v1/chat/completions") -> str:
        """Register a worker served by ``handler`` (an aiohttp handler for ``path``)."""
        app = aiohttp.web.Application()
        app.router.add_post(path, handler)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        self.servers.append(server)
        endpoint = str(server.make_url("")).rstrip("/")
        self.kube.put(WORKERS.plural, worker_object(name, endpoint))
        return endpoint

    async def router(self, **config: Any) -> tuple[str, Router]:
        settings = RouterSettings(
            namespace=NS,
            replica=f"r{len(self.routers)}",
            config=RouterConfig(**config),
            flush_interval=60,
            flush_writes_per_second=8,
            flush_tick=3600,  # no background writes: each test flushes when it means to
        )
        router = Router(self.kube, settings)  # type: ignore[arg-type]
        server = TestServer(router.app(), host="127.0.0.1")
        await server.start_server(**settings.server_options())
        self.servers.append(server)
        self.routers.append(router)
        return str(server.make_url("")).rstrip("/"), router

    async def close(self) -> None:
        for server in reversed(self.servers):
            await server.close()


def dies_mid_stream(first: bytes) -> Callable[[aiohttp.web.Request], Awaitable[Any]]:
    """An engine handler that starts a stream with ``first``, then drops the connection."""

    async def breaks(request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(first)
        assert request.transport is not None
        request.transport.abort()  # the worker dies mid-stream
        return response

    return breaks


Post = Callable[..., Awaitable[tuple[int, dict[str, Any], dict[str, str]]]]


async def post(
    http: aiohttp.ClientSession,
    url: str,
    body: Any,
    headers: dict[str, str] | None = None,
    path: str = "/v1/chat/completions",
) -> tuple[int, dict[str, Any], dict[str, str]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post(url + path, data=data, headers=headers or {}) as r:
        return r.status, await r.json(), dict(r.headers)


def chat(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": 8, **extra}


def opening(text: str = "Fix the failing test.") -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]


async def until(predicate: Callable[[], bool], timeout: float = 5) -> None:
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in time")
