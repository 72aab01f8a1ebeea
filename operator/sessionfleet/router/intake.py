"""Taking a request in: what the router accepts before it looks at a body.

A router is the one component every client reaches, so what a request may cost is
bounded before any of it is read:

* the body is JSON (``Content-Type`` absent, JSON, or one that HTTP tools send by
  default: others, such as a multipart form, get 415), and uncompressed
  (``Content-Encoding`` other than ``identity`` is refused with 415: inflating a
  request would let a few kilobytes on the wire become gigabytes in memory, and
  engines do not read compressed requests anyway);
* the body is at most ``max_body_bytes`` (413), announced or not;
* all bodies being read or held at once are at most ``max_inflight_body_bytes``; a
  request that would pass that is answered 503 with ``Retry-After`` before its body is
  read, so a burst of large bodies cannot exhaust the router's memory;
* a body must arrive within ``body_timeout`` seconds (408), so a slow client cannot
  pin a socket and its buffer;
* header values are text (a value that is not valid UTF-8 cannot be forwarded: 400).

Headers themselves are bounded before this, per request and all requests together
(:mod:`.heads`), and their arrival by the server's idle timeout (:mod:`.server`).
"""

from __future__ import annotations

import asyncio
from typing import Final

from aiohttp import web

from sessionfleet.fronts.body import BodyBudget
from sessionfleet.fronts.errors import RouterError
from sessionfleet.router.limits import IntakeLimits

_ACCEPTED_TYPES: Final = frozenset(
    {
        "application/json",
        # What HTTP tools send by default with a body (curl -d, aiohttp with bytes);
        # the body is still checked to be a JSON object.
        "application/x-www-form-urlencoded",
        "application/octet-stream",
        "text/plain",
    }
)
_READ_CHUNK: Final = 1 << 16


def _check_headers(request: web.Request) -> None:
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise RouterError(
            415,
            "unsupported_content_encoding",
            f"Content-Encoding {encoding[:32]!r} is not accepted: send the body uncompressed",
        )
    content_type = request.headers.get("Content-Type")
    if content_type is not None:
        media = content_type.split(";", 1)[0].strip().lower()
        if media not in _ACCEPTED_TYPES and not media.endswith("+json"):
            raise RouterError(
                415,
                "unsupported_content_type",
                f"Content-Type {media[:64]!r} is not accepted: send application/json",
            )
    for name, value in request.headers.items():
        if not value.isascii():
            try:
                value.encode()
            except UnicodeEncodeError:
                raise RouterError(
                    400, "invalid_header", f"header {name[:64]}: the value is not valid UTF-8"
                ) from None


class Intake:
    """Reads request bodies within :class:`IntakeLimits`."""

    def __init__(self, limits: IntakeLimits) -> None:
        self.limits = limits
        self.budget = BodyBudget(limits.max_inflight_body_bytes)

    def _too_large(self) -> RouterError:
        return RouterError(
            413, "body_too_large", f"the body exceeds {self.limits.max_body_bytes} bytes"
        )

    def _busy(self) -> RouterError:
        return RouterError(
            503,
            "router_busy",
            "the router holds too many request bodies at once; retry shortly",
            retry_after=self.limits.retry_after,
        )

    async def read(self, request: web.Request) -> tuple[bytes, int]:
        """Return the body and the budget bytes it holds (give them back when done).

        Raises :class:`RouterError` 415, 400, 413, 408 or 503 as the module says.
        """
        _check_headers(request)
        limit = self.limits.max_body_bytes
        announced = request.content_length
        if announced is not None and announced > limit:
            raise self._too_large()
        # A body of announced length holds that much; a chunked one may grow to the
        # limit, and is charged for it, so that the budget is never overrun.
        held = announced if announced is not None else limit
        if not self.budget.reserve(held):
            raise self._busy()
        try:
            if request.content.is_eof():
                # The whole body came with the head (most turns' do): nothing to wait for,
                # so no timer either.
                return self._whole(request, limit), held
            async with asyncio.timeout(self.limits.body_timeout):
                body = await self._read(request, limit)
        except TimeoutError:
            self.budget.release(held)
            raise RouterError(
                408,
                "body_timeout",
                f"the body did not arrive within {self.limits.body_timeout:g} s",
            ) from None
        except BaseException:
            self.budget.release(held)
            raise
        return body, held

    def _whole(self, request: web.Request, limit: int) -> bytes:
        body = request.content.read_nowait()
        if len(body) > limit:
            raise self._too_large()
        return body

    async def _read(self, request: web.Request, limit: int) -> bytes:
        parts: list[bytes] = []
        size = 0
        while True:
            chunk = await request.content.read(_READ_CHUNK)
            if not chunk:
                return b"".join(parts)
            size += len(chunk)
            if size > limit:
                raise self._too_large()
            parts.append(chunk)
