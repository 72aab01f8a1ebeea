"""The router's client for its workers: keep-alive HTTP/1.1, one turn per connection at a time.

A proxy needs little of a general HTTP client: the request's body is bytes already, its
headers are checked, and the target is a worker's ``http://<podIP>:<port>``. aiohttp's
client builds per request a URL, a request object with automatic headers, cookies and a
payload lookup, a response object, a timer, and on Python 3.11 a task to write the body:
96 µs of CPU per request in a loop at 64 connections, against 39 µs for this module
(``bench/router/client_cpu.py``; bench/README.md, "Router: the tail"), and the difference
was a fifth of the router's CPU per turn. This module is the part of HTTP/1.1 a proxy
uses, with the bounds an answer from a worker that misbehaves needs:

* the answer's head (status line and fields) is at most 64 KiB and 128 fields; a field
  or status line that is not HTTP/1.1's syntax is an error, not a guess;
* the body's length is Content-Length, chunked transfer coding, or the connection's end;
  both a length and a coding, another coding, or lengths that disagree are an error (a
  proxy that frames an answer differently from the next hop is how answers are
  smuggled), as are a chunk size line over 4 KiB and trailers over 64 KiB;
* the body is handed on as it arrives, and reading from the worker pauses while more
  than 256 KiB of it wait to be taken (a slow client slows the worker's socket, not the
  router's memory);
* a connection attempt has ``connect_timeout``; a worker silent for ``read_timeout``
  while an answer is awaited times out;
* a connection goes back to the pool only after a complete answer that did not ask to
  close it; an answer not read to its end closes it, which is how an engine learns that
  its client left (vLLM then aborts the request). An idle connection is kept for
  :data:`IDLE_SECONDS`, less than the five seconds uvicorn, vLLM's server, keeps one
  open, so that the router does not send a turn on a connection the worker is closing.
"""

from __future__ import annotations

import asyncio
import re
import ssl
from collections import deque
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlsplit

MAX_HEAD_BYTES: Final = 64 * 1024
MAX_FIELDS: Final = 128
MAX_CHUNK_LINE: Final = 4096
MAX_TRAILER_BYTES: Final = 64 * 1024
MAX_INTERIM: Final = 8
"""Interim (1xx) answers skipped before the final one."""
READ_HIGH_WATER: Final = 256 * 1024
READ_LOW_WATER: Final = 64 * 1024
IDLE_SECONDS: Final = 4.0
"""How long an idle connection is kept: under uvicorn's default keep-alive of 5 s."""
MAX_IDLE_PER_WORKER: Final = 1024
_WRITE_TOGETHER: Final = 64 * 1024
"""Bodies up to this size go out in the same write (one send) as the head."""

_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([1-9][0-9][0-9])(?: ([^\x00-\x08\x0a-\x1f\x7f]*))?")
_FIELD = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):[ \t]*([^\x00-\x08\x0a-\x1f\x7f]*?)[ \t]*")
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,15})[ \t]*(?:;[^\x00-\x08\x0a-\x1f\x7f]*)?")
_LENGTH = re.compile(r"[0-9]{1,18}")
_NO_BODY: Final = frozenset({204, 304})


class UpstreamError(Exception):
    """The worker's answer could not be had or read; the message says why."""


class UpstreamUnreachable(UpstreamError):
    """No connection to the worker, or it closed the connection before answering."""


class UpstreamTimeout(UpstreamError, TimeoutError):
    """The worker did not accept the connection, or was silent, for too long."""


@dataclass(frozen=True, slots=True)
class _Target:
    host: str
    port: int
    tls: bool
    authority: str
    """The Host field: the endpoint's host and port as written."""


def _target(endpoint: str) -> _Target:
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UpstreamError(f"endpoint {endpoint[:128]!r} is not an http(s) URL")
    try:
        port = parts.port
    except ValueError as error:
        raise UpstreamError(f"endpoint {endpoint[:128]!r}: {error}") from None
    tls = parts.scheme == "https"
    return _Target(parts.hostname, port or (443 if tls else 80), tls, parts.netloc)


def request_head(
    method: str, authority: str, target: str, fields: list[tuple[str, str]], length: int
) -> bytes:
    """Return an HTTP/1.1 request head; a line break in a field would be a second field."""
    lines = [f"{method} {target} HTTP/1.1\r\nHost: {authority}\r\n"]
    for name, value in fields:
        if "\n" in value or "\r" in value or "\n" in name or "\r" in name:
            raise UpstreamError(f"the request field {name[:64]!r} holds a line break")
        lines.append(f"{name}: {value}\r\n")
    lines.append(f"Content-Length: {length}\r\n\r\n")
    try:
        return "".join(lines).encode()
    except UnicodeEncodeError as error:
        raise UpstreamError(f"a request field is not text: {error}") from None


class _Connection(asyncio.Protocol):
    """One connection to a worker: bytes in a buffer, and a waiter for more of them."""

    def __init__(self, loop: asyncio.AbstractEventLoop, read_timeout: float) -> None:
        self.loop = loop
        self.read_timeout = read_timeout
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.ended: UpstreamUnreachable | None = None
        """Why no more bytes will come (the worker closed it, or it failed); None: open."""
        self.closed_cleanly = False
        """The worker ended the connection in order (not a reset or an error)."""
        self.idle_since = 0.0
        self._waiter: asyncio.Future[None] | None = None
        self._wait_since = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._paused = False

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > READ_HIGH_WATER and not self._paused and self.transport:
            self._paused = True
            self.transport.pause_reading()
        self._wake(None)

    def eof_received(self) -> bool:
        self.closed_cleanly = self.ended is None
        self._end(UpstreamUnreachable("the worker closed the connection"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is None:
            self.closed_cleanly = self.closed_cleanly or self.ended is None
            self._end(UpstreamUnreachable("the worker closed the connection"))
        else:
            self._end(UpstreamUnreachable(f"the connection to the worker failed: {exc!r}"))
        self._stop_timer()

    # reading, for one answer at a time

    def _end(self, why: UpstreamUnreachable) -> None:
        if self.ended is None:
            self.ended = why
        self._wake(None)

    def _wake(self, error: BaseException | None) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            if error is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(error)

    async def more(self) -> None:
        """Wait for bytes past those in the buffer; raise when none will come in time."""
        if self.ended is not None:
            raise UpstreamUnreachable(*self.ended.args)  # a new one: no traceback piles up
        self._waiter = self.loop.create_future()
        self._wait_since = self.loop.time()
        if self._timer is None:
            self._timer = self.loop.call_at(self._wait_since + self.read_timeout, self._check)
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _check(self) -> None:
        """Fail a wait that has lasted ``read_timeout``; else re-arm for when it would have."""
        self._timer = None
        if self._waiter is None or self._waiter.done():
            return  # nothing awaited: the next wait arms the timer again
        deadline = self._wait_since + self.read_timeout
        if self.loop.time() >= deadline:
            self._wake(UpstreamTimeout(f"the worker sent nothing for {self.read_timeout:g} s"))
        else:
            self._timer = self.loop.call_at(deadline, self._check)

    def take(self, size: int) -> bytes:
        """Remove and return up to ``size`` bytes from the buffer's start."""
        if size >= len(self.buffer):
            data = bytes(self.buffer)
            self.buffer.clear()
        else:
            data = bytes(self.buffer[:size])
            del self.buffer[:size]
        if self._paused and len(self.buffer) < READ_LOW_WATER and self.transport:
            self._paused = False
            self.transport.resume_reading()
        return data

    # the pool's view

    def usable(self, now: float) -> bool:
        """Whether an idle connection may carry the next request."""
        return (
            self.ended is None
            and not self.buffer
            and self.transport is not None
            and not self.transport.is_closing()
            and now - self.idle_since < IDLE_SECONDS
        )

    def close(self) -> None:
        """Close the connection (the worker sees the client leave)."""
        if self.transport is not None:
            self.transport.close()
        self._stop_timer()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class UpstreamResponse:
    """A worker's answer: its status and fields at once, its body as it comes."""

    def __init__(
        self,
        pool: Upstream,
        key: str,
        connection: _Connection,
        status: int,
        reason: str,
        headers: list[tuple[str, str]],
        *,
        keep_alive: bool,
    ) -> None:
        self._pool = pool
        self._key = key
        self._connection = connection
        self.status = status
        self.reason = reason
        self.headers = headers
        """The answer's fields in order, names as the worker spelled them."""
        self.content_type = ""
        """The media type, lower case, parameters dropped; empty when not given."""
        self.content_length: int | None = None
        self._chunked = False
        self._remaining = 0
        """Bytes left of the body (length framing) or of the current chunk (chunked)."""
        self._until_close = False
        self._keep = keep_alive
        self._done = False
        self._released = False
        self._frame(headers)

    def _frame(self, headers: list[tuple[str, str]]) -> None:
        lengths: set[str] = set()
        codings: list[str] = []
        for name, value in headers:
            lower = name.lower()
            if lower == "content-length":
                lengths.update(part.strip() for part in value.split(","))
            elif lower == "transfer-encoding":
                codings.append(value)
            elif lower == "connection":
                if "close" in (token.strip().lower() for token in value.split(",")):
                    self._keep = False
            elif lower == "content-type":
                self.content_type = value.split(";", 1)[0].strip().lower()
        if self.status in _NO_BODY:
            self._done = True
            return
        if codings:
            if lengths:
                raise UpstreamError("the worker's answer has both a length and a coding")
            coding = ",".join(codings).strip().lower()
            if coding != "chunked":
                raise UpstreamError(f"the worker's transfer coding {coding[:64]!r} is not chunked")
            self._chunked = True
            return
        if lengths:
            if len(lengths) != 1 or not _LENGTH.fullmatch(length := lengths.pop()):
                raise UpstreamError("the worker's Content-Length is not one number")
            self.content_length = self._remaining = int(length)
            self._done = self._remaining == 0
            return
        self._until_close, self._keep = True, False

    async def read(self) -> bytes:
        """Return the rest of the body, all of it (for answers of a known, bounded length).

        Taken piece by piece as it arrives, so that reading, paused past
        :data:`READ_HIGH_WATER`, resumes: an answer is usually one piece.
        """
        parts = []
        while chunk := await self.next_chunk():
            parts.append(chunk)
        return b"".join(parts)

    async def next_chunk(self) -> bytes:
        """Return the body's next bytes as they arrive; ``b""`` once it is complete."""
        if self._done:
            return b""
        while True:
            data = self._available()
            if data or self._done:
                return data
            await self._more()

    async def _more(self) -> None:
        try:
            await self._connection.more()
        except UpstreamUnreachable as error:
            if self._until_close and self._connection.closed_cleanly:
                self._done = True  # the connection's end is the body's end
                return
            raise UpstreamError(f"the worker's answer ended early: {error}") from None

    def _available(self) -> bytes:
        """Take what the buffer holds of the body now (a chunked body: its data only)."""
        buffer = self._connection.buffer
        if self._until_close:
            return self._connection.take(len(buffer))
        if not self._chunked:
            data = self._connection.take(self._remaining)
            self._remaining -= len(data)
            self._done = self._remaining == 0
            return data
        return self._dechunk()

    def _dechunk(self) -> bytes:
        """Take every complete piece of chunked framing the buffer holds; return its data."""
        connection = self._connection
        buffer = connection.buffer
        parts: list[bytes] = []
        while buffer:
            if self._remaining > 0:
                data = connection.take(self._remaining)
                self._remaining -= len(data)
                parts.append(data)
                if self._remaining > 0:
                    break
                self._remaining = -2  # the CRLF after a chunk's data
            if self._remaining == -2:
                if len(buffer) < 2:
                    break
                if buffer[:2] != b"\r\n":
                    raise UpstreamError("the worker's chunk does not end with CRLF")
                connection.take(2)
                self._remaining = 0
                continue
            end = buffer.find(b"\r\n")
            if end < 0:
                if len(buffer) > MAX_CHUNK_LINE:
                    raise UpstreamError(f"the worker's chunk size line is over {MAX_CHUNK_LINE}")
                break
            match = _CHUNK_SIZE.fullmatch(buffer, 0, end)
            if match is None or end > MAX_CHUNK_LINE:
                raise UpstreamError("the worker's chunk size line is malformed")
            size = int(match[1], 16)
            if size == 0:
                self._trailers_end(end + 2)  # done once they are all in
                break
            connection.take(end + 2)
            self._remaining = size
        return b"".join(parts)

    def _trailers_end(self, start: int) -> None:
        """After the last chunk: once its trailers (ignored) are in, take them; done."""
        buffer = self._connection.buffer
        if buffer.startswith(b"\r\n", start):
            end = start + 2
        else:
            found = buffer.find(b"\r\n\r\n", start)
            if found < 0:
                if len(buffer) > MAX_TRAILER_BYTES:
                    raise UpstreamError(f"the worker's trailers are over {MAX_TRAILER_BYTES}")
                return
            end = found + 4
        self._connection.take(end)
        self._done = True

    def release(self) -> None:
        """Give the connection back (a complete answer) or close it (anything else)."""
        if self._released:
            return
        self._released = True
        if self._done and self._keep:
            self._pool._give_back(self._key, self._connection)
        else:
            self._connection.close()


class Upstream:
    """Connections to workers, kept per endpoint; ``post`` sends one turn."""

    def __init__(
        self,
        *,
        connect_timeout: float,
        read_timeout: float,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._ssl = ssl_context
        """For https endpoints; None: the system's trust, made on first use."""
        self._idle: dict[str, deque[_Connection]] = {}
        self._targets: dict[str, _Target] = {}
        self._swept = 0.0
        self._closed = False
        self.opened = 0
        """Connections opened so far (tests and metrics read it)."""

    def _target(self, endpoint: str) -> _Target:
        target = self._targets.get(endpoint)
        if target is None:
            if len(self._targets) > 4096:
                self._targets.clear()
            target = self._targets[endpoint] = _target(endpoint)
        return target

    async def post(
        self, endpoint: str, path: str, fields: list[tuple[str, str]], body: bytes
    ) -> UpstreamResponse:
        """Send ``POST path`` with ``body`` to the worker; return its answer once its head is in.

        The caller reads the body and then calls :meth:`UpstreamResponse.release`.
        Raises :class:`UpstreamUnreachable`, :class:`UpstreamTimeout`, or
        :class:`UpstreamError` for an answer that is not HTTP.
        """
        target = self._target(endpoint)
        head = request_head("POST", target.authority, path, fields, len(body))
        connection = self._idle_connection(endpoint) or await self._connect(target)
        assert connection.transport is not None
        try:
            if len(body) <= _WRITE_TOGETHER:
                connection.transport.write(head + body)
            else:
                connection.transport.write(head)
                connection.transport.write(body)
            return await self._answer(endpoint, connection)
        except BaseException:
            connection.close()
            raise

    def _idle_connection(self, key: str) -> _Connection | None:
        idle = self._idle.get(key)
        now = asyncio.get_running_loop().time()
        while idle:
            connection = idle.pop()
            if connection.usable(now):
                return connection
            connection.close()
        return None

    async def _connect(self, target: _Target) -> _Connection:
        loop = asyncio.get_running_loop()
        context: ssl.SSLContext | None = None
        if target.tls:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, connection = await loop.create_connection(
                    lambda: _Connection(loop, self.read_timeout),
                    target.host,
                    target.port,
                    ssl=context,
                )
        except TimeoutError:
            raise UpstreamTimeout(
                f"no connection to {target.authority} within {self.connect_timeout:g} s"
            ) from None
        except OSError as error:
            raise UpstreamUnreachable(f"cannot connect to {target.authority}: {error}") from None
        self.opened += 1
        return connection

    async def _answer(self, key: str, connection: _Connection) -> UpstreamResponse:
        for _ in range(MAX_INTERIM + 1):
            status, reason, fields, http11 = await _read_head(connection)
            if status == 101:
                raise UpstreamError("the worker switched protocols")
            if status >= 200:
                # HTTP/1.0 keeps a connection only when asked to; none of our workers is one.
                return UpstreamResponse(
                    self, key, connection, status, reason, fields, keep_alive=http11
                )
        raise UpstreamError(f"the worker sent over {MAX_INTERIM} interim answers")

    def _give_back(self, key: str, connection: _Connection) -> None:
        now = connection.loop.time()
        connection.idle_since = now
        idle = self._idle.get(key)
        if idle is None:
            idle = self._idle[key] = deque()
        if self._closed or len(idle) >= MAX_IDLE_PER_WORKER:
            connection.close()
        else:
            idle.append(connection)
        if now - self._swept > IDLE_SECONDS:
            self._sweep(now)

    def _sweep(self, now: float) -> None:
        """Close connections idle too long, and forget workers with none left."""
        self._swept = now
        for key in list(self._idle):
            kept = deque[_Connection]()
            for connection in self._idle[key]:
                if connection.usable(now):
                    kept.append(connection)
                else:
                    connection.close()
            if kept:
                self._idle[key] = kept
            else:
                del self._idle[key]

    def idle_count(self) -> int:
        """Idle connections held now."""
        return sum(len(idle) for idle in self._idle.values())

    async def aclose(self) -> None:
        """Close every idle connection (those in use close when their answers end)."""
        self._closed = True
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports finish closing


async def _read_head(connection: _Connection) -> tuple[int, str, list[tuple[str, str]], bool]:
    """Read one answer head: status, reason, fields, and whether it is HTTP/1.1."""
    buffer = connection.buffer
    start = 0
    while True:
        end = buffer.find(b"\r\n\r\n", start)
        if end >= 0:
            break
        if len(buffer) > MAX_HEAD_BYTES:
            raise UpstreamError(f"the worker's answer head is over {MAX_HEAD_BYTES} bytes")
        start = max(0, len(buffer) - 3)
        try:
            await connection.more()
        except UpstreamUnreachable:
            if buffer:
                raise UpstreamError(
                    "the worker closed the connection within its answer's head"
                ) from None
            raise
    if end > MAX_HEAD_BYTES:
        raise UpstreamError(f"the worker's answer head is over {MAX_HEAD_BYTES} bytes")
    lines = connection.take(end + 4)[:end].split(b"\r\n")
    status_line = _STATUS_LINE.fullmatch(lines[0])
    if status_line is None:
        raise UpstreamError(f"the worker's status line is not HTTP/1.x: {lines[0][:64]!r}")
    if len(lines) > MAX_FIELDS + 1:
        raise UpstreamError(f"the worker's answer has over {MAX_FIELDS} fields")
    fields = []
    for line in lines[1:]:
        field = _FIELD.fullmatch(line)
        if field is None:
            raise UpstreamError(f"the worker sent a malformed field: {line[:64]!r}")
        try:
            fields.append((field[1].decode("ascii"), field[2].decode()))
        except UnicodeDecodeError:
            raise UpstreamError(f"the worker's field {field[1][:64]!r} is not UTF-8") from None
    reason = (status_line[3] or b"").decode("latin-1")
    return int(status_line[2]), reason, fields, status_line[1] == b"1"
