"""httpcore's network streams on asyncio's own transports, TLS included.

httpcore reaches the network through anyio under asyncio, and anyio's TLS stream runs
the TLS record layer in Python with a cancel scope around every read and write, all of
it on the event loop that serves the router's turns. asyncio's transports do the same
work in fewer steps (its SSL protocol feeds the TLS object from the transport's own
buffers): the router's CPU per usage write, the PATCH and its watch event, was 5-12%
lower in two runs (2026-12-04; bench/README.md, "Router: the tail"). This module gives
httpcore that path; requests, timeouts and errors stay httpcore's (its exceptions,
raised for the same causes).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Awaitable, Iterable
from typing import Any

import httpcore

SocketOption = (
    tuple[int, int, int] | tuple[int, int, bytes | bytearray] | tuple[int, int, None, int]
)
"""A ``setsockopt`` argument list, as httpcore's backends take them."""

CLOSE_SECONDS = 1.0
"""The most a close waits for the transport to say its socket is closed (it takes one
turn of the loop)."""

READ_ERRORS: tuple[type[BaseException], ...] = (OSError, asyncio.IncompleteReadError)
"""What a broken connection raises from a read or a write (ssl.SSLError is an OSError)."""


class AsyncioStream(httpcore.AsyncNetworkStream):
    """One connection: asyncio's stream reader and writer, TLS done by the transport."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        """Return up to ``max_bytes`` received; b"" once the server closed."""
        try:
            async with asyncio.timeout(timeout):
                return await self._reader.read(max_bytes)
        except TimeoutError as error:
            raise httpcore.ReadTimeout(str(error) or "read timed out") from error
        except READ_ERRORS as error:
            raise httpcore.ReadError(str(error) or repr(error)) from error

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        """Send ``buffer`` whole; wait only while the transport's buffer is full."""
        if not buffer:
            return
        try:
            async with asyncio.timeout(timeout):
                self._writer.write(buffer)
                await self._writer.drain()
        except TimeoutError as error:
            raise httpcore.WriteTimeout(str(error) or "write timed out") from error
        except READ_ERRORS as error:
            raise httpcore.WriteError(str(error) or repr(error)) from error

    async def aclose(self) -> None:
        """Close the connection now, and return once its socket is closed.

        Not ``close()``: on a TLS transport that sends close_notify and keeps the socket
        open until the server answers in kind (up to 30 s), so a client closed just
        before its loop ends (``asyncio.run``) left the socket open. HTTP/1.1 frames
        every answer, so nothing read depends on a TLS shutdown (as anyio's stream
        closes for httpcore: ``standard_compatible=False``).
        """
        self._writer.transport.abort()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(CLOSE_SECONDS):
                await self._writer.wait_closed()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.AsyncNetworkStream:
        """Upgrade this connection to TLS in place (asyncio's SSL protocol)."""
        try:
            async with asyncio.timeout(timeout):
                await self._writer.start_tls(ssl_context, server_hostname=server_hostname)
        except TimeoutError as error:
            self._writer.transport.abort()
            raise httpcore.ConnectTimeout(str(error) or "TLS handshake timed out") from error
        except READ_ERRORS as error:
            self._writer.transport.abort()
            raise httpcore.ConnectError(str(error) or repr(error)) from error
        return self

    def get_extra_info(self, info: str) -> Any:
        """Answer httpcore's questions about the connection.

        ``is_readable`` is how httpcore tells that a kept connection was closed by the
        server: the transport reads as data arrive, so a closed one shows at the reader
        (end of stream) or the transport, not at the socket.
        """
        if info == "is_readable":
            return self._reader.at_eof() or self._writer.transport.is_closing()
        if info == "ssl_object":
            return self._writer.get_extra_info("ssl_object")
        if info == "client_addr":
            return self._writer.get_extra_info("sockname")
        if info == "server_addr":
            return self._writer.get_extra_info("peername")
        if info == "socket":
            return self._writer.get_extra_info("socket")
        return None


async def _connected(
    opening: Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]], timeout: float | None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Await a connection within ``timeout`` seconds; a failure is httpcore's connect error."""
    try:
        async with asyncio.timeout(timeout):
            return await opening
    except TimeoutError as error:
        raise httpcore.ConnectTimeout(str(error) or "connect timed out") from error
    except OSError as error:
        raise httpcore.ConnectError(str(error) or repr(error)) from error


class AsyncioBackend(httpcore.AsyncNetworkBackend):
    """Opens :class:`AsyncioStream` connections (TCP; TLS through ``start_tls``)."""

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[SocketOption] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        """Connect to ``host``:``port`` within ``timeout`` seconds."""
        reader, writer = await _connected(
            asyncio.open_connection(
                host, port, local_addr=(local_address, 0) if local_address else None
            ),
            timeout,
        )
        raw = writer.get_extra_info("socket")  # TCP_NODELAY is asyncio's default already
        for option in socket_options or ():
            raw.setsockopt(*option)
        return AsyncioStream(reader, writer)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[SocketOption] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        """Connect to the Unix socket at ``path`` within ``timeout`` seconds."""
        reader, writer = await _connected(asyncio.open_unix_connection(path), timeout)
        return AsyncioStream(reader, writer)

    async def sleep(self, seconds: float) -> None:
        """Sleep on the running loop."""
        await asyncio.sleep(seconds)
