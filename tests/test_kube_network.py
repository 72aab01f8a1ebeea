"""The API client's requests on asyncio's transports, over real TLS sockets.

The API server is always reached over TLS; these tests put the client's network layer
(:mod:`sessionfleet.kube.network`) in front of an aiohttp server that serves a
certificate made for the test, and check what a user relies on: the certificate is
verified, connections are kept and replaced, and every way a connection fails is an
:class:`ApiUnavailable`, never a hang or a crash.
"""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import ssl
import threading
import time
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpcore
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from sessionfleet.certificates import self_signed
from sessionfleet.kube import PODS, ApiUnavailable, Forbidden, Gone
from sessionfleet.kube import client as kube_client
from sessionfleet.kube.client import Kube
from sessionfleet.kube.config import KubeConfig
from sessionfleet.kube.network import AsyncioBackend


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = self_signed("api", ["localhost"], ("127.0.0.1",), days=1)
    (tmp_path / "tls.crt").write_bytes(cert)
    (tmp_path / "tls.key").write_bytes(key)
    return tmp_path / "tls.crt", tmp_path / "tls.key"


@pytest.fixture
async def tls_server(
    certificate: tuple[Path, Path],
) -> AsyncIterator[tuple[str, list[int]]]:
    """Serve pods over TLS; answer with each request's client port."""
    ports: list[int] = []

    async def pod(request: web.Request) -> web.Response:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        ports.append(int(peer[1]) if peer else 0)
        name = request.match_info["name"]
        if name == "slow":
            await asyncio.sleep(30)
        response = web.json_response({"metadata": {"name": name}, "padding": "x" * 200_000})
        if name == "close":
            response.force_close()
        return response

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(*certificate)
    app = web.Application()
    app.router.add_get(PODS.path("ns") + "/{name}", pod)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server(ssl=context, keepalive_timeout=0.3)
    yield f"https://127.0.0.1:{server.port}", ports
    await server.close()


def client(url: str, ca: Path | None, **kw: Any) -> Kube:
    return Kube(KubeConfig(server=url, ca_file=str(ca) if ca else None), **kw)


async def test_requests_over_tls_share_one_connection_and_read_large_answers(
    tls_server: tuple[str, list[int]], certificate: tuple[Path, Path]
) -> None:
    url, ports = tls_server
    async with client(url, certificate[0]) as kube:
        for i in range(5):
            pod = await kube.get(PODS, f"p{i}", "ns")
            assert pod["metadata"]["name"] == f"p{i}" and len(pod["padding"]) == 200_000
    assert len(ports) == 5 and len(set(ports)) == 1


async def test_a_tls_connection_the_server_closed_is_replaced(
    tls_server: tuple[str, list[int]], certificate: tuple[Path, Path]
) -> None:
    url, ports = tls_server
    async with client(url, certificate[0]) as kube:
        await kube.get(PODS, "close", "ns")
        await kube.get(PODS, "after-close", "ns")
        await asyncio.sleep(0.8)  # past the server's keep-alive timeout (0.3 s)
        await kube.get(PODS, "after-idle", "ns")
    assert len(set(ports)) == 3


async def test_a_server_certificate_the_ca_did_not_sign_is_refused(
    tls_server: tuple[str, list[int]],
) -> None:
    url, ports = tls_server
    async with client(url, None) as kube:  # the system's CAs: not the test's
        with pytest.raises(ApiUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
            await kube.get(PODS, "p", "ns")
    assert ports == []


async def test_an_answer_that_never_comes_is_a_read_timeout(
    tls_server: tuple[str, list[int]], certificate: tuple[Path, Path]
) -> None:
    url, _ = tls_server
    async with client(url, certificate[0], timeout=0.3) as kube:
        with pytest.raises(ApiUnavailable, match="ReadTimeout"):
            await kube.get(PODS, "slow", "ns")
        # The connection that timed out is not reused: the next request is answered.
        assert (await kube.get(PODS, "next", "ns"))["metadata"]["name"] == "next"


async def test_a_server_that_accepts_and_never_shakes_hands_is_a_connect_timeout() -> None:
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    try:
        stream = await AsyncioBackend().connect_tcp("127.0.0.1", silent.getsockname()[1])
        with pytest.raises(httpcore.ConnectTimeout):
            await stream.start_tls(ssl.create_default_context(), "localhost", timeout=0.3)
    finally:
        silent.close()


async def test_nobody_listening_is_a_connect_error() -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    async with Kube(KubeConfig(server=f"https://127.0.0.1:{port}")) as kube:
        with pytest.raises(ApiUnavailable, match="ConnectError"):
            await kube.get(PODS, "p", "ns")


async def test_a_connection_reset_mid_answer_is_a_read_error() -> None:
    """The server reads the request, then resets the connection without answering."""

    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        raw = writer.get_extra_info("socket")
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        writer.transport.abort()

    server = await asyncio.start_server(reset, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with Kube(KubeConfig(server=f"http://127.0.0.1:{port}")) as kube:
            with pytest.raises(ApiUnavailable, match="ReadError|RemoteProtocolError"):
                await kube.get(PODS, "p", "ns")
    finally:
        server.close()
        await server.wait_closed()


async def test_a_write_that_cannot_drain_is_a_write_timeout() -> None:
    """A peer that never reads: the request body fills the socket buffers and waits."""
    held: list[asyncio.StreamWriter] = []

    async def never_read(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.transport.pause_reading()
        held.append(writer)

    server = await asyncio.start_server(never_read, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    backend = AsyncioBackend()
    try:
        stream = await backend.connect_tcp("127.0.0.1", port, timeout=1)
        with pytest.raises(httpcore.WriteTimeout):
            await stream.write(b"x" * 64 * 1024 * 1024, timeout=0.3)
        await stream.aclose()
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


def event(kind: str, name: str, version: int) -> bytes:
    obj = {"metadata": {"name": name, "resourceVersion": str(version)}}
    return json.dumps({"type": kind, "object": obj}).encode() + b"\n"


@pytest.fixture
async def watch_server(
    certificate: tuple[Path, Path],
) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """Serve a pod watch over TLS as the test's ``script`` says: chunks, then an ending."""
    script: dict[str, Any] = {"chunks": [], "end": "close", "status": 200, "requests": []}

    async def watch(request: web.Request) -> web.StreamResponse:
        script["requests"].append(request)
        if script["status"] != 200:
            return web.json_response(
                {"kind": "Status", "code": script["status"], "message": "denied"},
                status=script["status"],
            )
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        for chunk in script["chunks"]:
            await response.write(chunk)
            await asyncio.sleep(0.01)  # each chunk its own read
        if script["end"] == "abort" and request.transport is not None:
            request.transport.abort()  # mid-stream, without the final chunk
            return response
        await response.write_eof()
        return response

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(*certificate)
    app = web.Application()
    app.router.add_get(PODS.path("ns"), watch)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server(ssl=context)
    yield f"https://127.0.0.1:{server.port}", script
    await server.close()


async def collect(kube: Kube) -> list[tuple[str, str]]:
    return [
        (kind, obj["metadata"]["resourceVersion"])
        async for kind, obj in kube.watch(PODS, "ns", resource_version="7")
    ]


async def test_watch_events_cut_anywhere_arrive_whole_in_order_until_the_server_ends(
    watch_server: tuple[str, dict[str, Any]], certificate: tuple[Path, Path]
) -> None:
    url, script = watch_server
    first = event("ADDED", "a", 8)
    rest = event("BOOKMARK", "", 9) + event("MODIFIED", "a", 10)
    end = len(first)
    # Cut mid-event, just before a newline, after it, and across two events; a blank line.
    script["chunks"] = [
        first[:5],
        first[5 : end - 1],
        first[end - 1 :],
        b"\n",
        rest[:20],
        rest[20:],
    ]
    async with client(url, certificate[0]) as kube:
        assert await collect(kube) == [("ADDED", "8"), ("BOOKMARK", "9"), ("MODIFIED", "10")]
    sent = script["requests"][0]
    assert sent.query["watch"] == "1" and sent.query["resourceVersion"] == "7"
    assert "Accept-Encoding" not in sent.headers  # events are not compressed


async def test_an_expired_version_in_the_stream_is_gone(
    watch_server: tuple[str, dict[str, Any]], certificate: tuple[Path, Path]
) -> None:
    url, script = watch_server
    expired = {"kind": "Status", "code": 410, "message": "too old resource version"}
    script["chunks"] = [
        event("ADDED", "a", 8),
        json.dumps({"type": "ERROR", "object": expired}).encode() + b"\n",
    ]
    async with client(url, certificate[0]) as kube:
        with pytest.raises(Gone, match="too old"):
            await collect(kube)


async def test_a_refused_watch_is_the_refusal(
    watch_server: tuple[str, dict[str, Any]], certificate: tuple[Path, Path]
) -> None:
    url, script = watch_server
    script["status"] = 403
    async with client(url, certificate[0]) as kube:
        with pytest.raises(Forbidden, match="denied"):
            await collect(kube)


@pytest.mark.parametrize(
    ("chunks", "message"),
    [
        ([event("ADDED", "a", 8), b'{"type": "MODIFIED", "obj'], "RemoteProtocolError"),
        ([b"<html>a proxy's error page</html>\n"], "Expecting value"),
        ([b"[1, 2]\n"], "a watch event is an object"),
        ([b"x" * 4096] * 3, "a watch event over 10000 bytes"),
    ],
    ids=["connection-dropped-mid-event", "not-json", "not-an-object", "endless-line"],
)
async def test_a_broken_watch_is_unavailable_after_the_events_it_carried(
    watch_server: tuple[str, dict[str, Any]],
    certificate: tuple[Path, Path],
    chunks: list[bytes],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, script = watch_server
    script["chunks"], script["end"] = chunks, "abort"
    monkeypatch.setattr(kube_client, "MAX_EVENT_BYTES", 10_000)
    seen: list[str] = []
    async with client(url, certificate[0]) as kube:
        with pytest.raises(ApiUnavailable, match=message):
            async for kind, _ in kube.watch(PODS, "ns"):
                seen.append(kind)
    assert seen == (["ADDED"] if len(chunks) == 2 else [])


def test_a_client_closed_as_its_loop_ends_leaves_no_socket_open(
    certificate: tuple[Path, Path],
) -> None:
    """``asyncio.run(...)`` around a client, as a script or a test does: the TLS
    connection is closed when the client is, not left waiting for the server's own
    close_notify (which this server, like a busy one, never sends) when the loop ends."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(*certificate)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    answer = b'{"metadata": {"name": "p"}}'

    def serve_one_and_stay_silent() -> None:
        raw, _ = listener.accept()
        with context.wrap_socket(raw, server_side=True) as conn:
            request = b""
            while b"\r\n\r\n" not in request:
                request += conn.recv(4096)
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(answer)}\r\n\r\n".encode()
                + answer
            )
            time.sleep(2)  # holding the connection, answering nothing more

    server = threading.Thread(target=serve_one_and_stay_silent, daemon=True)
    server.start()

    async def one_request() -> str:
        url = f"https://127.0.0.1:{listener.getsockname()[1]}"
        async with client(url, certificate[0]) as kube:
            return str((await kube.get(PODS, "p", "ns"))["metadata"]["name"])

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert asyncio.run(one_request()) == "p"
            gc.collect()
        assert [str(w.message) for w in caught if w.category is ResourceWarning] == []
    finally:
        server.join()
        listener.close()
