r"""The paths the router serves, as the client wrote them; every other one is a 404.

The router forwards a request's path to the worker byte for byte. A path that is not
exactly one of the API's (``/v1/../collective_rpc``, ``/v1/%2e%2e/sleep``,
``/v1//chat/completions``, ``/v1\pause``) could reach one of the engine's own endpoints
behind any hop that normalises it (vLLM's development mode serves ``/collective_rpc``,
``/sleep`` and ``/pause``), so such a path is refused before routing, not cleaned up:
the router compares the raw path (before percent-decoding and dot-segment removal) with
an allow-list, and answers 404 ``not_found`` for anything else.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Final

from aiohttp import web

from sessionfleet.engines.anthropic import is_messages_path
from sessionfleet.fronts.errors import RouterError

SERVED_POSTS: Final = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
    }
)
"""The OpenAI-compatible and Anthropic APIs forwarded to workers (docs/clients.md)."""
SERVED_GETS: Final = frozenset({"/healthz", "/readyz", "/metrics", "/v1/models"})
"""The router's own endpoints."""
_SEGMENT: Final = r"[A-Za-z0-9_:@+=,~-][A-Za-z0-9._:@+=,~-]*"
_MODEL_PATH: Final = re.compile(rf"/v1/models/{_SEGMENT}(?:/{_SEGMENT})*")
"""``GET /v1/models/{id}``: ids may hold ``/`` (``org/model``) but no empty, dot-led or
percent-encoded segment."""


def is_served(raw_path: str) -> bool:
    """Whether a raw request path (query excluded) is one the router serves."""
    return (
        raw_path in SERVED_POSTS
        or raw_path in SERVED_GETS
        or _MODEL_PATH.fullmatch(raw_path) is not None
    )


@web.middleware
async def only_served_paths(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Answer 404 for a path outside the allow-list, before any routing or reading."""
    raw_path = request.raw_path.partition("?")[0]
    if is_served(raw_path):
        return await handler(request)
    error = RouterError(404, "not_found", f"the router does not serve {raw_path[:200]!r}")
    return error.response(anthropic=is_messages_path(request.path))
