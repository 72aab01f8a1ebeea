"""Bounding request heads (the request line and headers) before anything else is done.

aiohttp's parser limits a header line to 8 KiB and a request to 128 headers: about
1 MiB of text a request, near 2 MiB once parsed, held while the head arrives (up to
the idle timeout) and then for as long as the request lives, authenticated or not, body
sent or not. Two bounds keep that within the container:

* a request's line and headers together are at most ``max_header_bytes``: a head still
  arriving past it is answered 431 at once and the connection closed; a complete one
  past it (it came in one read) is answered 431 before its handler runs;
* the heads held at once, on all connections, are at most ``max_inflight_header_bytes``:
  a connection whose next bytes of a head would pass that is answered 503 with
  ``Retry-After`` and closed. A head is charged from its first byte until its request
  has been answered (or the connection is gone), so the budget covers heads arriving,
  requests queued behind a pipelined one, and requests in progress.

:class:`BoundedHeads` is the connection's protocol that counts and refuses; the
listening socket's factory (:mod:`.server`) builds one per connection.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Final

from aiohttp import web
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import EMPTY_PAYLOAD, StreamReader
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from prometheus_client import CollectorRegistry, Counter, Gauge

from sessionfleet.engines.anthropic import is_messages_path
from sessionfleet.fronts.body import BodyBudget
from sessionfleet.fronts.errors import REASON_HEADER, RouterError
from sessionfleet.router.limits import IntakeLimits

_REQUEST_LINE_EXTRA: Final = len("  HTTP/1.1\r\n") + len("\r\n")
"""The spaces and version of the request line, and the blank line ending the head."""
_HEADER_LINE_EXTRA: Final = len(": \r\n")


class HeadBudget(BodyBudget):
    """The bytes of request heads held at once, against a cap."""

    def replace(self, old: int, new: int) -> None:
        """Exchange a charge of ``old`` bytes for one of ``new`` (the head is held already)."""
        self.used += new - old


def head_size(method: str, raw_path: str, raw_headers: tuple[tuple[bytes, bytes], ...]) -> int:
    """Return the bytes of a request's line and headers as sent (give or take whitespace)."""
    size = len(method) + len(raw_path) + _REQUEST_LINE_EXTRA
    return size + sum(len(name) + len(value) + _HEADER_LINE_EXTRA for name, value in raw_headers)


def too_large(limit: int) -> RouterError:
    """Return the answer to a head over ``limit`` bytes."""
    return RouterError(
        431,
        "headers_too_large",
        f"the request line and headers exceed {limit} bytes (--max-header-bytes)",
    )


def busy(retry_after: int) -> RouterError:
    """Return the answer to a head that does not fit in the in-flight budget."""
    return RouterError(
        503,
        "router_busy",
        "the router holds too many request headers at once; retry shortly",
        retry_after=retry_after,
    )


def raw_answer(error: RouterError) -> bytes:
    """Return ``error`` as a whole HTTP/1.1 answer that closes the connection."""
    body = error.body()
    lines = [
        f"HTTP/1.1 {error.status} {_REASONS.get(error.status, 'Error')}",
        "Content-Type: application/json",
        f"{REASON_HEADER}: {error.code}",
        "Connection: close",
        f"Content-Length: {len(body)}",
    ]
    if error.retry_after is not None:
        lines.append(f"Retry-After: {error.retry_after}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


_REASONS: Final = {
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


class HeadGuard:
    """What every connection of one router shares: the limits, the budget, the metrics."""

    def __init__(self, limits: IntakeLimits, registry: CollectorRegistry) -> None:
        self.limits = limits
        self.budget = HeadBudget(limits.max_inflight_header_bytes)
        self.refusals = Counter(
            "sessionfleet_router_head_refusals",
            "Requests refused for their headers: too_large (431), busy (503, the budget "
            "of headers held at once is spent).",
            ["reason"],
            registry=registry,
        )
        held = Gauge(
            "sessionfleet_router_header_bytes",
            "Bytes of request headers held: arriving, queued, or of requests in progress.",
            registry=registry,
        )
        held.set_function(lambda: self.budget.used)
        self._too_large = raw_answer(too_large(limits.max_header_bytes))
        self._busy = raw_answer(busy(limits.retry_after))

    def refusal(self, reason: str) -> bytes:
        """Count a refusal and return its answer."""
        self.refusals.labels(reason).inc()
        return self._too_large if reason == "too_large" else self._busy


class BoundedHeads(RequestHandler):
    """aiohttp's connection handler, charging the heads it receives to a :class:`HeadGuard`.

    Bytes received while no request body is open belong to a head. They are charged as
    they arrive, and the parser is given at most ``max_header_bytes`` of a head; once it
    completes a head, the charge becomes the head's own size and stays until its
    request has been handled. Bytes of a head that follow the end of a body in the same
    read go uncounted: at most one read (256 KiB).
    """

    def __init__(self, manager: web.Server, *, guard: HeadGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._arriving = 0
        """Bytes charged for the head being received."""
        self._charges: deque[int] = deque()
        """One charge per complete request not yet handled, in the parser's order."""
        self._open_body: StreamReader | None = None
        self._discarding = False
        """Refused: what arrives now is dropped until the connection closes."""

    def data_received(self, data: bytes) -> None:
        """Charge head bytes; refuse a head over its limit or over the budget."""
        if self._discarding or self._force_close or self._close or self.transport is None:
            return
        body = self._open_body
        if body is not None and not body.is_eof():
            super().data_received(data)
            return
        self._open_body = None
        # The parser is never given more than a head may hold: the rest of a larger read
        # is fed after it, once the head is complete (a body, or the next request).
        room = self._guard.limits.max_header_bytes + 1 - self._arriving
        head, rest = (data, b"") if len(data) <= room else (data[:room], data[room:])
        if not self._guard.budget.reserve(len(head)):
            self._refuse("busy")
            return
        self._arriving += len(head)
        before = self._request_count
        super().data_received(head)
        emitted = self._request_count - before
        if emitted:
            self._charge_complete(emitted)
        elif self._arriving > self._guard.limits.max_header_bytes:
            self._refuse("too_large")
            return
        if rest:
            self.data_received(rest)

    def _charge_complete(self, emitted: int) -> None:
        """Replace the arriving charge by the sizes of the ``emitted`` complete heads."""
        messages = list(self._messages)[-emitted:]
        sizes = [_message_size(message) for message, _ in messages]
        self._guard.budget.replace(self._arriving, sum(sizes))
        self._arriving = 0
        self._charges.extend(sizes)
        if len(messages) == emitted:
            payload = messages[-1][1]
            if payload is not EMPTY_PAYLOAD and not payload.is_eof():
                self._open_body = payload

    def _refuse(self, reason: str) -> None:
        answer = self._guard.refusal(reason)
        transport = self.transport
        idle = self._current_request is None and not self._messages
        if transport is None or not idle:
            # With a request in progress its answer would be cut: only close.
            self.force_close()
            return
        transport.write(answer)
        # Closing with the client's bytes unread would send a reset, which destroys the
        # answer in the client's buffers before it reads it; so what still arrives is
        # dropped unread for the lingering time, as aiohttp does after an early answer.
        self._discarding = True
        self._loop.call_later(self._lingering_time, self.force_close)

    async def _handle_request(
        self,
        request: BaseRequest,
        start_time: float | None,
        request_handler: Callable[[BaseRequest], Awaitable[web.StreamResponse]],
    ) -> tuple[web.StreamResponse, bool]:
        charge = self._charges.popleft() if self._charges else 0
        try:
            return await super()._handle_request(request, start_time, request_handler)
        finally:
            self._guard.budget.release(charge)

    def connection_lost(self, exc: BaseException | None) -> None:
        """Give back what this connection still holds: a head arriving, queued requests."""
        self._guard.budget.release(self._arriving + sum(self._charges))
        self._arriving = 0
        self._charges.clear()
        super().connection_lost(exc)


def bounded_handler(server: web.Server, guard: HeadGuard) -> BoundedHeads:
    """Return a connection handler of ``server`` that charges its heads to ``guard``."""
    # What web.Server.__call__ does for its own RequestHandler: the same loop and the
    # server's handler settings (keep-alive, lingering, decompression).
    return BoundedHeads(server, guard=guard, loop=server._loop, **server._kwargs)


def _message_size(message: object) -> int:
    if isinstance(message, RawRequestMessage):
        return head_size(message.method, message.path, message.raw_headers)
    return 0  # a parser error: answered 400 at once, nothing kept


def head_limit(limits: IntakeLimits) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Return a middleware answering 431 for a complete head over ``max_header_bytes``."""
    limit = limits.max_header_bytes

    @web.middleware
    async def refuse_large_heads(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if head_size(request.method, request.raw_path, request.raw_headers) > limit:
            response = too_large(limit).response(anthropic=is_messages_path(request.path))
            response.force_close()
            return response
        return await handler(request)

    return refuse_large_heads
