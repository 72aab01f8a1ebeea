"""What sessionfleet relies on in Anthropic's Messages API (``POST /v1/messages``), in one place.

Coding agents such as Claude Code speak Anthropic's Messages API rather than OpenAI's
chat completions, and vLLM serves it too (``vllm/entrypoints/anthropic/``). The router
forwards it like any other ``/v1/`` path; what differs is:

* **errors**: ``{"type": "error", "error": {"type", "message"}}``, with Anthropic's
  error types (``invalid_request_error``, ``not_found_error``, ``overloaded_error``,
  ...); in a stream, an ``event: error`` server-sent event. The Anthropic SDKs read
  the type and message from that shape, and they skip a stream event without an
  ``event:`` line, so an error in OpenAI's shape would end the stream silently;
* **usage**: ``input_tokens`` counts the prompt tokens *not* read from cache;
  ``cache_read_input_tokens`` (vLLM: its prefix-cache hits) and
  ``cache_creation_input_tokens`` (vLLM reports 0: it has no separate cache writes)
  count the rest (:func:`sessionfleet.engines.vllm.parse_usage` reads this shape);
* **streams split the usage**: ``message_start`` carries the input and cache counts,
  the final ``message_delta`` the cumulative ``output_tokens`` (vLLM and Anthropic's
  newer API repeat the input counts there; older servers do not). A reader that keeps
  only the last usage it sees loses the prompt tokens: :func:`merge_stream_usage`
  combines the two as the Anthropic SDKs do.

Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

MESSAGES_PATH: Final = "/v1/messages"
"""The Messages API; ``/v1/messages/count_tokens`` lives under it."""

ERROR_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "request_too_large",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
"""Anthropic's error type for each HTTP status (docs.anthropic.com, "Errors").

Anthropic itself answers 529 when overloaded; a router or engine that is out of
capacity answers 503, which keeps that type."""

STOP_REASONS: Final = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
"""OpenAI finish reasons as Anthropic stop reasons (vLLM's mapping); others map to null."""


def is_messages_path(path: str) -> bool:
    """Whether a request path belongs to the Messages API, whose clients expect its errors."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_type(status: int) -> str:
    """Return Anthropic's error type for an HTTP status (``api_error`` for unlisted ones)."""
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(status: int, message: str) -> dict[str, Any]:
    """Return an error in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def error_event(status: int, message: str) -> bytes:
    """Return the server-sent event that ends a Messages stream with an error."""
    data = json.dumps(error_body(status, message), separators=(",", ":"))
    return f"event: error\ndata: {data}\n\n".encode()


def usage(
    prompt_tokens: int, cached_tokens: int, output_tokens: int, *, details: bool
) -> dict[str, Any]:
    """Return a Messages ``usage`` object with vLLM's semantics.

    With cache details (vLLM's ``--enable-prompt-tokens-details``) ``input_tokens`` is
    the uncached part and the cache counts are present; without them vLLM cannot tell
    cached from uncached and reports the whole prompt as ``input_tokens``, leaving the
    cache counts out (absent means unknown, not zero).
    """
    if not details:
        return {"input_tokens": prompt_tokens, "output_tokens": output_tokens}
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "output_tokens": output_tokens,
        "cache_read_input_tokens": cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def merge_stream_usage(start: Mapping[str, Any], delta: Mapping[str, Any]) -> dict[str, Any]:
    """Combine a stream's ``message_start`` usage with its last ``message_delta`` usage.

    The delta's counts are cumulative and win where present (as in the Anthropic SDKs'
    stream accumulator); the start's input and cache counts stay where the delta does
    not repeat them. A null in the delta means "not reported" and changes nothing.
    """
    merged = dict(start)
    merged.update((key, value) for key, value in delta.items() if value is not None)
    return merged
