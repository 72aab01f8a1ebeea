"""The API client's own connections: kept, reused, replaced when the server closed them.

Against an aiohttp server over a real socket (the requests' client side is
``sessionfleet.kube.connections``; e2e/ runs it against the real API server).
"""

from __future__ import annotations

import asyncio
import gzip
import zlib
from collections.abc import AsyncIterator
from typing import Any

import httpcore
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from sessionfleet.kube import PODS, ApiUnavailable
from sessionfleet.kube.client import Kube
from sessionfleet.kube.config import KubeConfig
from sessionfleet.kube.connections import Answer, Connections, decoded


@pytest.fixture
async def server() -> AsyncIterator[tuple[TestServer, list[int]]]:
    """Answer a pod GET with the client's port; ``close`` asks to close, ``garbled`` lies."""
    ports: list[int] = []

    async def pod(request: web.Request) -> web.Response:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        ports.append(int(peer[1]) if peer else 0)
        name = request.match_info["name"]
        if name == "garbled":
            return web.Response(
                body=b"not gzip at all",
                headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
            )
        response = web.json_response({"metadata": {"name": name}})
        if name == "close":
            response.force_close()
        return response

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(30)
        return web.json_response({})

    app = web.Application()
    app.router.add_get(PODS.path("ns", "slow"), slow)
    app.router.add_get(PODS.path("ns") + "/{name}", pod)
    test_server = TestServer(app, host="127.0.0.1")
    await test_server.start_server(keepalive_timeout=0.3)
    yield test_server, ports
    await test_server.close()


def client(server: TestServer, **kw: Any) -> Kube:
    return Kube(KubeConfig(server=str(server.make_url("")).rstrip("/")), **kw)


async def test_one_connection_serves_request_after_request(
    server: tuple[TestServer, list[int]],
) -> None:
    test_server, ports = server
    async with client(test_server) as kube:
        for i in range(5):
            assert (await kube.get(PODS, f"p{i}", "ns"))["metadata"]["name"] == f"p{i}"
    assert len(ports) == 5 and len(set(ports)) == 1


async def test_a_connection_the_server_closed_is_replaced_and_nothing_fails(
    server: tuple[TestServer, list[int]],
) -> None:
    """Closed on the server's word ("Connection: close") or after its idle timeout."""
    test_server, ports = server
    async with client(test_server) as kube:
        await kube.get(PODS, "close", "ns")
        await kube.get(PODS, "after-close", "ns")
        await asyncio.sleep(0.8)  # the server's keep-alive timeout (0.3 s) passes
        await kube.get(PODS, "after-idle", "ns")
    assert len(set(ports)) == 3


async def test_a_garbled_answer_is_an_unavailable_server_not_a_crash(
    server: tuple[TestServer, list[int]],
) -> None:
    test_server, _ = server
    async with client(test_server) as kube:
        with pytest.raises(ApiUnavailable, match="GET /api/v1/namespaces/ns/pods/garbled"):
            await kube.get(PODS, "garbled", "ns")
        assert (await kube.get(PODS, "next", "ns"))["metadata"]["name"] == "next"


async def test_a_cancelled_request_gives_its_turn_back(
    server: tuple[TestServer, list[int]],
) -> None:
    test_server, _ = server
    async with client(test_server, max_in_flight=1) as kube:
        stuck = asyncio.create_task(kube.get(PODS, "slow", "ns"))
        await asyncio.sleep(0.2)
        stuck.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stuck
        answer = await asyncio.wait_for(kube.get(PODS, "p", "ns"), 5)
        assert answer["metadata"]["name"] == "p"


class Recorded:
    """A connection that answers at once and records whether it was closed."""

    def __init__(self) -> None:
        self.closed = False

    async def handle_async_request(self, request: httpcore.Request) -> httpcore.Response:
        await asyncio.sleep(0.01)
        return httpcore.Response(200, content=b"{}")

    def is_idle(self) -> bool:
        return not self.closed

    def has_expired(self) -> bool:
        return self.closed

    async def aclose(self) -> None:
        self.closed = True


async def test_connections_idle_past_the_keepalive_are_closed_as_others_come_back() -> None:
    made: list[Recorded] = []

    def connect(origin: httpcore.Origin) -> Any:
        made.append(Recorded())
        return made[-1]

    origin = httpcore.Origin(b"http", b"127.0.0.1", 80)
    connections = Connections(origin, connect, size=8, keepalive=0.2)
    request = httpcore.Request("GET", "http://127.0.0.1/x")
    await asyncio.gather(*(connections.send(request) for _ in range(3)))
    assert (len(made), connections.idle) == (3, 3)
    await asyncio.sleep(0.3)
    await connections.send(request)  # takes the newest; the two older ones are stale
    assert connections.idle == 1
    assert sorted(c.closed for c in made) == [False, True, True]
    await connections.aclose()
    assert all(c.closed for c in made)


@pytest.mark.parametrize(
    ("encoding", "encode"),
    [
        (b"gzip", gzip.compress),
        (b"deflate", zlib.compress),
        (b"deflate", lambda data: zlib.compress(data)[2:-4]),  # raw, no zlib header
        (b"identity", lambda data: data),
    ],
)
def test_bodies_are_decoded_as_their_encoding_says(encoding: bytes, encode: Any) -> None:
    body = b'{"kind": "Pod"}' * 50
    answer = Answer(200, [(b"Content-Encoding", encoding)], encode(body))
    assert decoded(answer) == body
