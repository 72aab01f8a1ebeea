"""The API client's connections: a stack of open ones, one request on each at a time.

httpx's transport hands every request to httpcore's connection pool, which on every
request and every response matches each waiting request against each connection and
asks each idle connection's socket whether the server closed it (a few system calls
per connection). With tens of connections open, as after an API server's slow spell,
that was a quarter of the operator's CPU while binding sessions (bench/README.md,
"Scale"). Here a request waits for a turn (at most ``size`` open at once, first come
first served), takes the connection used last, and only that one is asked whether it
is still open; connections idle for longer than ``keepalive`` seconds are closed as
others come back. Connections are made by httpcore's own factory, so TLS and a proxy
from the environment work as through httpx, on asyncio's transports
(:mod:`sessionfleet.kube.network`).
"""

from __future__ import annotations

import asyncio
import ssl
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

import httpcore

from sessionfleet.kube.network import AsyncioBackend

Connect = Callable[[httpcore.Origin], httpcore.AsyncConnectionInterface]
"""Makes one connection to an origin (httpcore's factory; a benchmark's stand-in)."""

TRANSPORT_ERRORS: tuple[type[Exception], ...] = (
    httpcore.TimeoutException,
    httpcore.NetworkError,
    httpcore.ProtocolError,
    httpcore.ProxyError,
    httpcore.UnsupportedProtocol,
    httpcore.ConnectionNotAvailable,
    OSError,
    zlib.error,
)
"""What a request that got no readable answer raises (ssl.SSLError is an OSError)."""


@dataclass(frozen=True, slots=True)
class Answer:
    """A whole response: its status, headers and body (still content-encoded)."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes

    def header(self, name: bytes) -> bytes | None:
        """Return the first value of header ``name`` (lower case), or None."""
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None


def decoded(answer: Answer) -> bytes:
    """Return the body of ``answer`` without its content encoding (gzip or deflate)."""
    encoding = (answer.header(b"content-encoding") or b"identity").strip().lower()
    if encoding == b"gzip":
        return zlib.decompress(answer.body, 16 + zlib.MAX_WBITS)
    if encoding == b"deflate":
        try:
            return zlib.decompress(answer.body)
        except zlib.error:  # raw deflate, without the zlib header (as some servers send)
            return zlib.decompress(answer.body, -zlib.MAX_WBITS)
    return answer.body


def origin_of(url: SplitResult) -> httpcore.Origin:
    """Return the scheme, host and port of an http(s) URL, the scheme's port if none."""
    port = url.port or (443 if url.scheme == "https" else 80)
    return httpcore.Origin(url.scheme.encode(), (url.hostname or "").encode(), port)


def url_at(origin: httpcore.Origin, target: str) -> httpcore.URL:
    """Return the URL of ``target`` (path and query) at ``origin``, parsed already."""
    return httpcore.URL(
        scheme=origin.scheme, host=origin.host, port=origin.port, target=target.encode()
    )


async def _exchange(
    connection: httpcore.AsyncConnectionInterface, request: httpcore.Request
) -> Answer:
    """Send ``request`` on ``connection`` and read the whole answer."""
    response = await connection.handle_async_request(request)
    try:
        body = await response.aread()
    finally:
        await response.aclose()
    return Answer(response.status, response.headers, body)


def factory(ssl_context: ssl.SSLContext, proxy: str | None, keepalive: float) -> Connect:
    """Return httpcore's own connection factory: direct, or through ``proxy``."""
    pool = httpcore.AsyncConnectionPool(
        ssl_context=ssl_context,
        proxy=httpcore.Proxy(proxy) if proxy else None,
        keepalive_expiry=keepalive,
        network_backend=AsyncioBackend(),
    )
    return pool.create_connection


class Connections:
    """Up to ``size`` requests at once to one origin, on connections kept between them."""

    def __init__(self, origin: httpcore.Origin, connect: Connect, *, size: int, keepalive: float):
        self._origin = origin
        self._connect = connect
        self._keepalive = keepalive
        self._turns = asyncio.Semaphore(size)
        self._closed = False
        # (when it was given back, connection); the newest on the right.
        self._idle: deque[tuple[float, httpcore.AsyncConnectionInterface]] = deque()

    async def send(
        self, request: httpcore.Request, ready: Callable[[], None] | None = None
    ) -> Answer:
        """Send ``request`` and read its whole answer; httpcore's errors pass through.

        ``ready``, when given, is called once the request has its turn and a connection,
        just before it is sent: what it raises passes through, the request unsent (the
        write gate, asked again at the last moment: the wait may have been long).
        """
        async with self._turns:
            connection = await self._take()
            if ready is not None:
                try:
                    ready()
                except BaseException:
                    await self._give_back(connection)
                    raise
            try:
                answer = await _exchange(connection, request)
            except BaseException:
                await connection.aclose()
                raise
            await self._give_back(connection)
            return answer

    async def _take(self) -> httpcore.AsyncConnectionInterface:
        while self._idle:
            _, connection = self._idle.pop()
            if connection.is_idle() and not connection.has_expired():
                return connection
            await connection.aclose()
        return self._connect(self._origin)

    async def _give_back(self, connection: httpcore.AsyncConnectionInterface) -> None:
        now = time.monotonic()
        # Not kept when the server answered "Connection: close", nor after aclose().
        if connection.is_idle() and not self._closed:
            self._idle.append((now, connection))
        else:
            await connection.aclose()
        while self._idle and now - self._idle[0][0] > self._keepalive:
            _, stale = self._idle.popleft()
            await stale.aclose()

    @property
    def idle(self) -> int:
        """Connections open and waiting for a request."""
        return len(self._idle)

    async def aclose(self) -> None:
        """Close every idle connection (requests in flight close theirs when done)."""
        self._closed = True
        while self._idle:
            _, connection = self._idle.pop()
            await connection.aclose()


async def fetch_once(url: str, timeout: float) -> Answer:
    """GET ``url`` on a connection of its own, closed after; no proxy.

    For an engine's metrics: scraped every 15 s, each engine at an address of its own,
    a kept connection would idle past any keep-alive, and a pool of hundreds of them
    is what costs (see above). httpcore's errors pass through.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise httpcore.UnsupportedProtocol(f"not an http(s) URL: {url!r}")
    origin = origin_of(parts)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    request = httpcore.Request(
        b"GET",
        url_at(origin, target),
        headers=[(b"Host", parts.netloc.encode()), (b"Accept-Encoding", b"gzip, deflate")],
        extensions={"timeout": dict.fromkeys(("connect", "read", "write", "pool"), timeout)},
    )
    async with httpcore.AsyncHTTPConnection(
        origin, keepalive_expiry=0, network_backend=AsyncioBackend()
    ) as connection:
        return await _exchange(connection, request)
