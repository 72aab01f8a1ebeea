"""The bounds on what requests may cost the router (see :mod:`.intake`).

Kept apart from the code that enforces them, with no aiohttp import, so that the
command line can show the defaults without loading the HTTP stack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

DEFAULT_MAX_BODY_BYTES: Final = 8 << 20
"""8 MiB. A 200K-token conversation is about 0.8 MB of JSON (4 bytes a token, 700 KB
measured for 180K tokens); escaping, tool schemas and a few images fit under 8 MiB."""
DEFAULT_MAX_INFLIGHT_BODY_BYTES: Final = 192 << 20
"""192 MiB: 24 maximum-size bodies at once, within the chart's 512 MiB memory limit."""


@dataclass(frozen=True, slots=True)
class IntakeLimits:
    """Bounds on what one request, and all of them together, may cost."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_inflight_body_bytes: int = DEFAULT_MAX_INFLIGHT_BODY_BYTES
    body_timeout: float = 30.0
    retry_after: int = 1

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1 or self.max_inflight_body_bytes < self.max_body_bytes:
            raise ValueError("the in-flight body budget must hold at least one maximum body")
        if self.body_timeout <= 0:
            raise ValueError("the body timeout must be positive")
