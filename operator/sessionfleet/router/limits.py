"""The bounds on what requests may cost the router (see :mod:`.intake`).

Kept apart from the code that enforces them, with no aiohttp import, so that the
command line can show the defaults without loading the HTTP stack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from sessionfleet.fronts.options import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_INFLIGHT_BODY_BYTES

DEFAULT_MAX_HEADER_BYTES: Final = 32 << 10
"""32 KiB for a request's line and headers together, as nginx allows by default (four
8 KiB buffers); agents send about 1 KiB."""
DEFAULT_MAX_INFLIGHT_HEADER_BYTES: Final = 16 << 20
"""16 MiB of request heads at once: 512 maximum-size heads, or thousands of real ones. A
head costs about 2.3 times its bytes once parsed (bytes, text and the header map: 38 MiB
measured for 500 heads of 32 KiB), so this is about 40 MiB of the chart's 512 MiB
limit, beside the 192 MiB of bodies."""


@dataclass(frozen=True, slots=True)
class IntakeLimits:
    """Bounds on what one request, and all of them together, may cost."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_inflight_body_bytes: int = DEFAULT_MAX_INFLIGHT_BODY_BYTES
    body_timeout: float = 30.0
    retry_after: int = 1
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    """A request's line and headers together (431 beyond)."""
    max_inflight_header_bytes: int = DEFAULT_MAX_INFLIGHT_HEADER_BYTES
    """Request heads held at once: arriving, queued, or of requests in progress (503)."""

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1 or self.max_inflight_body_bytes < self.max_body_bytes:
            raise ValueError("the in-flight body budget must hold at least one maximum body")
        if self.max_header_bytes < 1024 or self.max_inflight_header_bytes < self.max_header_bytes:
            raise ValueError(
                "a head may have at least 1 KiB, and the in-flight header budget must hold "
                "at least one maximum head"
            )
        if self.body_timeout <= 0:
            raise ValueError("the body timeout must be positive")
