"""The router's client for its workers (:mod:`sessionfleet.router.upstream`), over real sockets.

Each test puts a scripted HTTP server on 127.0.0.1 in front of the client: it reads one
request at a time and answers with the bytes the test gives, so that every framing a
worker may send, every malformed answer and every way a connection ends is exercised.
What a user relies on: answers arrive whole and byte for byte, connections are kept only
when that is safe, and anything else is an :class:`UpstreamError`, never a hang, a
crash, or a buffer that grows with the worker's answer.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessionfleet.certificates import self_signed
from sessionfleet.router import upstream as upstream_module
from sessionfleet.router.upstream import (
    MAX_HEAD_BYTES,
    READ_HIGH_WATER,
    Upstream,
    UpstreamError,
    UpstreamResponse,
    UpstreamTimeout,
    UpstreamUnreachable,
    _Connection,
    _read_head,
    request_head,
)

Answer = Callable[[bytes, asyncio.StreamWriter], Awaitable[bool]]
"""Given the request's bytes, write an answer; return False to close the connection."""


@dataclass
class Scripted:
    """A server answering each request with ``answer``; records what it received."""

    answer: Answer
    requests: list[bytes] = field(default_factory=list)
    connections: int = 0
    closed_by_client: int = 0
    port: int = 0


async def _read_request(reader: asyncio.StreamReader) -> bytes | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + await reader.readexactly(length)


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Answer], Awaitable[Scripted]]]:
    servers: list[asyncio.Server] = []

    async def start(answer: Answer) -> Scripted:
        scripted = Scripted(answer)

        async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            scripted.connections += 1
            try:
                while (request := await _read_request(reader)) is not None:
                    scripted.requests.append(request)
                    if not await scripted.answer(request, writer):
                        return
                    await writer.drain()
                scripted.closed_by_client += 1
            except ConnectionError:
                scripted.closed_by_client += 1
            finally:
                writer.close()

        server = await asyncio.start_server(connection, "127.0.0.1", 0)
        servers.append(server)
        scripted.port = server.sockets[0].getsockname()[1]
        return scripted

    yield start
    for server in servers:
        server.close()


def fixed(answer: bytes, *, keep: bool = True) -> Answer:
    async def write(_: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(answer)
        return keep

    return write


def pool(read_timeout: float = 5.0, **kwargs: object) -> Upstream:
    return Upstream(connect_timeout=2.0, read_timeout=read_timeout, **kwargs)  # type: ignore[arg-type]


async def closed_by_client(server: Scripted, within: float = 2.0) -> None:
    """Wait (a bounded time) for the client to close a connection to ``server``."""
    deadline = asyncio.get_running_loop().time() + within
    while not server.closed_by_client and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)


async def whole(response: UpstreamResponse) -> bytes:
    parts = []
    while chunk := await response.next_chunk():
        parts.append(chunk)
    return b"".join(parts)


OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"a": true}'


async def test_an_answer_of_known_length_arrives_whole_and_the_connection_is_kept(
    serve: Callable[[Answer], Awaitable[Scripted]],
) -> None:
    server = await serve(fixed(OK))
    client = pool()
    endpoint = f"http://127.0.0.1:{server.port}"
    for _ in range(3):
        response = await client.post(endpoint, "/v1/x?q=1", [("X-A", "1"), ("X-A", "2")], b"{}")
        assert (response.status, response.reason) == (200, "OK")
        assert response.headers == [("Content-Type", "application/json"), ("Content-Length", "11")]
        assert (response.content_type, response.content_length) == ("application/json", 11)
        assert await response.read() == b'{"a": true}'
        response.release()
    assert server.connections == client.opened == 1
    assert (
        server.requests[0]
        == (
            f"POST /v1/x?q=1 HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nX-A: 1\r\nX-A: 2\r\n"
            "Content-Length: 2\r\n\r\n{}"
        ).encode()
    )
    await client.aclose()


async def test_a_large_body_is_sent_whole(serve: Callable[[Answer], Awaitable[Scripted]]) -> None:
    server = await serve(fixed(OK))
    client = pool()
    body = bytes(range(256)) * 4096  # 1 MiB: head and body go out in two writes
    response = await client.post(f"http://127.0.0.1:{server.port}", "/", [], body)
    await response.read()
    response.release()
    assert server.requests[0].endswith(b"\r\n\r\n" + body)
    await client.aclose()


async def test_a_chunked_answer_arriving_byte_by_byte_is_unframed(
    serve: Callable[[Answer], Awaitable[Scripted]],
) -> None:
    events = [b"data: one\n\n", b"data: " + b"x" * 5000 + b"\n\n", b"data: [DONE]\n\n"]
    framed = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\nT: 1\r\n\r\n"
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )

    async def trickle(_: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(head)
        for i in range(len(framed)):
            writer.write(framed[i : i + 1])
            if i % 500 == 0:
                await writer.drain()
                await asyncio.sleep(0)
        return True

    server = await serve(trickle)
    client = pool()
    for _ in range(2):
        response = await client.post(f"http://127.0.0.1:{server.port}", "/", [], b"{}")
        assert response.content_type == "text/event-stream"
        assert response.content_length is None
        assert await whole(response) == b"".join(events)
        response.release()
    assert client.opened == 1  # the answer ended at its last chunk: the connection was kept
    await client.aclose()


async def test_an_answer_without_length_ends_with_its_connection(
    serve: Callable[[Answer], Awaitable[Scripted]],
) -> None:
    server = await serve(fixed(b"HTTP/1.1 200 OK\r\n\r\nall of it", keep=False))
    client = pool()
    for _ in range(2):
        response = await client.post(f"http://127.0.0.1:{server.port}", "/", [], b"")
        assert await response.read() == b"all of it"
        response.release()
    assert client.opened == 2
    await client.aclose()


async def test_a_reset_is_not_the_end_of_an_answer_without_length(
    serve: Callable[[Answer], Awaitable[Scripted]],
) -> None:
    async def reset(_: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\n\r\npart")
        await writer.drain()
        await asyncio.sleep(0.05)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
        return False

    server = await serve(reset)
    client = pool()
    response = await client.post(f"http://127.0.0.1:{server.port}", "/", [], b"")
    assert await response.next_chunk() == b"part"
    with pytest.raises(UpstreamError, match="ended early"):
        await response.next_chunk()
    response.release()
    await client.aclose()


@pytest.mark.parametrize(
    ("answer", "kept"),
    [
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", False),
        (b"HTTP/1.1 200 OK\r\nConnection: keep-alive, Close\r\nContent-Length: 0\r\n\r\n", False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", False),
        (b"HTTP/1.1 204 No Content\r\n\r\n", True),
        (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", True),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\nContent-Length: 2\r\n\r\nok", True),
    ],
)
async def test_which_connections_are_kept(
    serve: Callable[[Answer], Awaitable[Scripted]], answer: bytes, kept: bool
) -> None:
    server = await serve(fixed(answer))
    client = pool()
    for _ in range(2):
        response = await client.post(f"http://127.0.0.1:{server.port}", "/", [], b"")
        assert response.status in (200, 204)
        await response.read()
        response.release()
    assert client.opened == (1 if kept else 2)
    await client.aclose()


MALFORMED = {
    "no status line": b"hello\r\n\r\n",
    "HTTP/2": b"HTTP/2 200 OK\r\n\r\n",
    "status of two digits": b"HTTP/1.1 20 OK\r\n\r\n",
    "control character in reason": b"HTTP/1.1 200 O\x01K\r\n\r\n",
    "folded field": b"HTTP/1.1 200 OK\r\nA: 1\r\n  2\r\nContent-Length: 0\r\n\r\n",
    "field without colon": b"HTTP/1.1 200 OK\r\nA 1\r\n\r\n",
    "space before colon": b"HTTP/1.1 200 OK\r\nContent-Length : 0\r\n\r\n",
    "bare LF in value": b"HTTP/1.1 200 OK\r\nA: 1\nB: 2\r\nContent-Length: 0\r\n\r\n",
    "value not UTF-8": b"HTTP/1.1 200 OK\r\nA: \xff\xfe\r\nContent-Length: 0\r\n\r\n",
    "length and coding": (
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"
    ),
    "another coding": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
    "lengths that disagree": b"HTTP/1.1 200 OK\r\nContent-Length: 2, 3\r\n\r\nok",
    "length not a number": b"HTTP/1.1 200 OK\r\nContent-Length: +2\r\n\r\nok",
    "length too long": b"HTTP/1.1 200 OK\r\nContent-Length: 1" + b"0" * 20 + b"\r\n\r\n",
    "switching protocols": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n",
    "too many interim answers": b"HTTP/1.1 100 Continue\r\n\r\n" * 9,
    "too many fields": b"HTTP/1.1 200 OK\r\n" + b"A: 1\r\n" * 129 + b"\r\n",
    "head over the limit": b"HTTP/1.1 200 OK\r\nA: " + b"x" * MAX_HEAD_BYTES + b"\r\n\r\n",
    "unended head over the limit": b"HTTP/1.1 200 OK\r\nA: " + b"x" * (MAX_HEAD_BYTES + 10),
    "closed within the head": b"HTTP/1.1 200 OK\r\nA: 1",
}


@pytest.mark.parametrize("answer", MALFORMED.values(), ids=MALFORMED.keys())
async def test_a_malformed_answer_head_is_an_upstream_error(
    serve: Callable[[Answer], Awaitable[Scripted]], answer: bytes
) -> None:
    server = await serve(fixed(answer, keep=False))
    client = pool(read_timeout=2.0)
    with pytest.raises(UpstreamError) as caught:
        await client.post(f"http://127.0.0.1:{server.port}", "/", [], b"")
    assert type(caught.value) is UpstreamError
    assert client.idle_count() == 0
    await client.aclose()


BAD_BODIES = {
    "chunk size not hex": b"zz\r\nab\r\n0\r\n\r\n",
    "chunk size line over the limit": b"1" + b" " * 5000 + b"\r\n",
    "unended chunk size line over the limit": b"1;" + b"e" * 5000,
    "chunk data without CRLF": b"2\r\nabXY0\r\n\r\n",
    "trailers over the limit": b"0\r\nT: " + b"x" * 70_000,
    "closed within a chunk": b"5\r\nab",
}


@pytest.mark.parametrize("body", BAD_BODIES.values(), ids=BAD_BODIES.keys())
async def test_a_malformed_chunked_body_is_an_upstream_error(
    serve: Callable[[Answer], Awaitable[Scripted]], body: bytes
) -> None:
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    server = await serve(fixed(head + body, keep=False))
    client = pool(read_timeout=2.0)
    response = await client.post(f"http://127.0.0.1:{server.port}", "/", [], b"")
    with pytest.raises(UpstreamError):
        await whole(response)
    response.release()
    assert client.idle_count() == 0
    await client.aclose()


async def test_a_body_shorter_than_its_length_is_an_upstream_error(
    serve: Callable[[Answer], Awaitable[Scripted]],
) -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort"
    server = await serve(fixed(answer, keep=False))
    client = pool()
    response = await client.post(f"http://127.0.0.1:{server.port}", "/", [], b"")
    with pytest.raises(UpstreamError, match="ended early"):
        await response.read()
    response.release()
    await client.aclose()


async def test_no_answer_or_no_listener_is_unreachable(
    serve: Callable[[Answer], Awaitable[Scripted]],
) -> None:
    async def hang_up(_: bytes, writer: asyncio.StreamWriter) -> bool:
        return False

    server = await serve(hang_up)
    client = pool()
    with pytest.raises(UpstreamUnreachable, match="closed the connection"):
        await client.post(f"http://127.0.0.1:{server.port}", "/", [], b"")
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    with pytest.raises(UpstreamUnreachable, match="cannot connect"):
        await client.post(f"http://127.0.0.1:{port}", "/", [], b"")
    await client.aclose()


@pytest.mark.parametrize("endpoint", ["ftp://127.0.0.1:1", "http://", "http://h:99999", "x"])
async def test_an_endpoint_that_is_not_an_http_url_is_an_upstream_error(endpoint: str) -> None:
    with pytest.raises(UpstreamError, match="endpoint"):
        await pool().post(endpoint, "/", [], b"")


async def test_a_silent_worker_times_out_and_a_slow_one_does_not(
    serve: Callable[[Answer], Awaitable[Scripted]],
) -> None:
    async def silent(_: bytes, writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(5)
        return False

    async def slow(_: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\n")
        for byte in b"steady":
            await asyncio.sleep(0.1)
            writer.write(bytes([byte]))
            await writer.drain()
        return True

    client = pool(read_timeout=0.3)
    quiet = await serve(silent)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(UpstreamTimeout, match="nothing for 0.3 s"):
        await client.post(f"http://127.0.0.1:{quiet.port}", "/", [], b"")
    assert 0.25 < loop.time() - started < 2.0
    trickling = await serve(slow)
    response = await client.post(f"http://127.0.0.1:{trickling.port}", "/", [], b"")
    started = loop.time()
    assert await whole(response) == b"steady"  # 0.6 s in all, never 0.3 s of silence
    assert loop.time() - started > 0.3
    response.release()
    await client.aclose()


async def test_a_worker_silent_mid_body_times_out(
    serve: Callable[[Answer], Awaitable[Scripted]],
) -> None:
    async def stall(_: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await writer.drain()
        await asyncio.sleep(5)
        return False

    server = await serve(stall)
    client = pool(read_timeout=0.3)
    response = await client.post(f"http://127.0.0.1:{server.port}", "/", [], b"")
    assert await response.next_chunk() == b"abc"
    with pytest.raises(UpstreamTimeout):
        await response.next_chunk()
    response.release()
    await client.aclose()


async def test_a_large_answer_not_taken_pauses_reading(
    serve: Callable[[Answer], Awaitable[Scripted]],
) -> None:
    body = b"y" * (8 << 20)
    server = await serve(
        fixed(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    )
    client = pool()
    response = await client.post(f"http://127.0.0.1:{server.port}", "/", [], b"")
    await asyncio.sleep(0.3)  # time for the worker to send what the socket takes
    held = len(response._connection.buffer)
    assert 0 < held <= READ_HIGH_WATER + (256 << 10)  # one read past the mark at most
    assert await whole(response) == body
    response.release()
    assert client.opened == 1 and client.idle_count() == 1
    await client.aclose()


@pytest.mark.parametrize("size", [READ_HIGH_WATER + 1, 1 << 20])
async def test_an_answer_past_the_read_pause_is_read_whole(
    serve: Callable[[Answer], Awaitable[Scripted]], size: int
) -> None:
    body = bytes(range(256)) * (size // 256) + b"z" * (size % 256)
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    server = await serve(fixed(answer))
    client = pool(read_timeout=5.0)
    for _ in range(2):
        response = await client.post(f"http://127.0.0.1:{server.port}", "/", [], b"")
        assert await asyncio.wait_for(response.read(), 5) == body
        response.release()
    assert client.opened == 1
    await client.aclose()


async def test_an_answer_left_unread_closes_its_connection(
    serve: Callable[[Answer], Awaitable[Scripted]],
) -> None:
    async def stream(_: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        while True:
            await asyncio.sleep(0.02)
            writer.write(b"1\r\nz\r\n")
            await writer.drain()  # raises once the client has gone

    server = await serve(stream)
    client = pool()
    response = await client.post(f"http://127.0.0.1:{server.port}", "/", [], b"")
    assert await response.next_chunk() == b"abc"
    response.release()  # the client left mid-answer
    await closed_by_client(server)
    assert server.closed_by_client == 1  # the worker saw its client leave
    assert client.idle_count() == 0
    await client.aclose()


async def test_a_cancelled_request_closes_its_connection(
    serve: Callable[[Answer], Awaitable[Scripted]],
) -> None:
    async def never(_: bytes, writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(2)
        return False

    server = await serve(never)
    client = pool()
    task = asyncio.create_task(client.post(f"http://127.0.0.1:{server.port}", "/", [], b""))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert client.idle_count() == 0
    await client.aclose()


async def test_connections_closed_by_the_worker_or_idle_too_long_are_not_reused(
    serve: Callable[[Answer], Awaitable[Scripted]], monkeypatch: pytest.MonkeyPatch
) -> None:
    server = await serve(fixed(OK, keep=False))  # the worker closes after each answer
    client = pool()
    endpoint = f"http://127.0.0.1:{server.port}"
    for _ in range(3):
        response = await client.post(endpoint, "/", [], b"")
        await response.read()
        response.release()
        await asyncio.sleep(0.05)  # the worker's close arrives
    assert client.opened == 3  # each turn on a new connection, none failed
    kept = await serve(fixed(OK))
    monkeypatch.setattr(upstream_module, "IDLE_SECONDS", 0.1)
    for _ in range(2):
        response = await client.post(f"http://127.0.0.1:{kept.port}", "/", [], b"")
        await response.read()
        response.release()
        await asyncio.sleep(0.2)  # past the idle time
    assert kept.connections == 2
    await client.aclose()


async def test_concurrent_turns_each_get_a_connection(
    serve: Callable[[Answer], Awaitable[Scripted]],
) -> None:
    async def echo(request: bytes, writer: asyncio.StreamWriter) -> bool:
        body = request.split(b"\r\n\r\n", 1)[1]
        await asyncio.sleep(0.01)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        return True

    server = await serve(echo)
    client = pool()

    async def turn(n: int) -> bytes:
        response = await client.post(f"http://127.0.0.1:{server.port}", "/", [], b"%d" % n)
        try:
            return await response.read()
        finally:
            response.release()

    for _ in range(3):
        answers = await asyncio.gather(*(turn(n) for n in range(64)))
        assert answers == [b"%d" % n for n in range(64)]
    assert client.opened == 64 and client.idle_count() == 64
    await client.aclose()
    assert client.idle_count() == 0


async def test_an_answer_ending_after_the_pool_closed_closes_its_connection(
    serve: Callable[[Answer], Awaitable[Scripted]],
) -> None:
    server = await serve(fixed(OK))
    client = pool()
    response = await client.post(f"http://127.0.0.1:{server.port}", "/", [], b"")
    await client.aclose()  # shutting down with a turn in flight
    assert await response.read() == b'{"a": true}'
    response.release()
    assert client.idle_count() == 0
    await closed_by_client(server)
    assert server.closed_by_client == 1


@pytest.mark.parametrize(
    ("name", "value"), [("X-A", "a\r\nInjected: 1"), ("X-A", "a\nb"), ("X\r\nA", "1")]
)
def test_a_request_field_with_a_line_break_is_refused(name: str, value: str) -> None:
    with pytest.raises(UpstreamError, match="line break"):
        request_head("POST", "h:1", "/", [(name, value)], 0)


async def test_https_endpoints_verify_the_workers_certificate(
    serve: Callable[[Answer], Awaitable[Scripted]], tmp_path: Path
) -> None:
    cert, key = self_signed("worker", ["localhost"], ("127.0.0.1",), days=1)
    (tmp_path / "tls.crt").write_bytes(cert)
    (tmp_path / "tls.key").write_bytes(key)
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(OK)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=server_context)
    port = server.sockets[0].getsockname()[1]
    trusting = ssl.create_default_context(cafile=str(tmp_path / "tls.crt"))
    client = pool(ssl_context=trusting)
    response = await client.post(f"https://127.0.0.1:{port}", "/", [], b"")
    assert await response.read() == b'{"a": true}'
    response.release()
    with pytest.raises(UpstreamUnreachable, match="cannot connect"):
        await pool().post(f"https://127.0.0.1:{port}", "/", [], b"")  # the system's trust
    server.close()
    await client.aclose()


async def test_a_worker_that_never_finishes_the_handshake_is_a_connect_timeout() -> None:
    listener = socket.create_server(("127.0.0.1", 0))  # accepts, never speaks TLS
    port = listener.getsockname()[1]
    client = Upstream(connect_timeout=0.3, read_timeout=5.0)
    with pytest.raises(UpstreamTimeout, match="no connection"):
        await client.post(f"https://127.0.0.1:{port}", "/", [], b"")
    listener.close()


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.closing = False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True


async def _parse(data: bytes, pieces: list[int]) -> None:
    """Feed ``data`` to a connection in pieces, then its end; read one answer whole."""
    connection = _Connection(asyncio.get_running_loop(), read_timeout=5.0)
    connection.connection_made(_Transport())
    start = 0
    for size in [*pieces, len(data)]:
        connection.data_received(data[start : start + size])
        start += size
        if start >= len(data):
            break
    connection.eof_received()
    status, reason, fields, http11 = await _read_head(connection)
    response = UpstreamResponse(pool(), "k", connection, status, reason, fields, keep_alive=http11)
    await whole(response)
    response.release()


_HEADS = st.sampled_from(
    [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n\r\n",
        b"",
    ]
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    head=_HEADS,
    data=st.binary(max_size=300)
    | st.lists(
        st.sampled_from([b"\r\n", b"0", b"5", b"a", b";x", b"abcde", b"HTTP/1.1 ", b":", b" "])
    ).map(b"".join),
    pieces=st.lists(st.integers(min_value=1, max_value=40), max_size=8),
)
def test_any_bytes_from_a_worker_are_an_answer_or_an_upstream_error(
    head: bytes, data: bytes, pieces: list[int]
) -> None:
    try:
        asyncio.run(asyncio.wait_for(_parse(head + data, pieces), 5))
    except UpstreamError:
        pass
