"""What sessionfleet relies on in vLLM's interfaces, in one place (docs/background.md).

* the metric names of the V1 engine (the old ``vllm:gpu_cache_usage_perc`` and
  ``vllm:gpu_prefix_cache_*`` names are deprecated; a scraper that knows only those
  breaks on current vLLM);
* the ``usage`` object of a response and where the cached prompt tokens are
  (``usage.prompt_tokens_details.cached_tokens``, only with
  ``--enable-prompt-tokens-details``; for streams only with
  ``stream_options.include_usage`` or ``--enable-force-include-usage``);
* the engine arguments the operator must pass so that the router sees that usage.

The simulated engine publishes the same names and fields, so code written against this
module works against both. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

NUM_REQUESTS_RUNNING: Final = "vllm:num_requests_running"
"""Gauge: requests the engine is running (prefill or decode)."""
NUM_REQUESTS_WAITING: Final = "vllm:num_requests_waiting"
"""Gauge: requests queued, not yet scheduled."""
KV_CACHE_USAGE_PERC: Final = "vllm:kv_cache_usage_perc"
"""Gauge, 0-1: the fraction of KV blocks in use by running requests."""
PREFIX_CACHE_QUERIES: Final = "vllm:prefix_cache_queries"
"""Counter (exposed with ``_total``): prompt tokens looked up in the prefix cache."""
PREFIX_CACHE_HITS: Final = "vllm:prefix_cache_hits"
"""Counter (exposed with ``_total``): prompt tokens found in the prefix cache."""
CACHE_CONFIG_INFO: Final = "vllm:cache_config_info"
"""Info gauge (value 1) with the cache configuration as labels."""
PROMPT_TOKENS: Final = "vllm:prompt_tokens"
"""Counter (exposed with ``_total``): prompt tokens processed."""
GENERATION_TOKENS: Final = "vllm:generation_tokens"
"""Counter (exposed with ``_total``): tokens generated."""
REQUEST_SUCCESS: Final = "vllm:request_success"
"""Counter (exposed with ``_total``), label ``finished_reason``: finished requests."""

DEPRECATED_METRICS: Final = (
    "vllm:gpu_cache_usage_perc",
    "vllm:gpu_prefix_cache_queries",
    "vllm:gpu_prefix_cache_hits",
)
"""Names older vLLM versions used; current versions no longer publish them."""

USAGE_ARGS: Final = ("--enable-prompt-tokens-details", "--enable-force-include-usage")
"""Engine arguments without which the router cannot account a session's tokens.

Without the first, responses carry no ``cached_tokens``; without the second, a stream
carries no usage unless the client asked for it with ``stream_options.include_usage``.
The simulated engine accepts the same two flags.
"""


@dataclass(frozen=True, slots=True)
class Usage:
    """Token usage of one response, as the engine reported it."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None
    """None when the engine did not report it (no ``prompt_tokens_details``)."""

    @property
    def uncached_tokens(self) -> int:
        """Prompt tokens the engine computed (not served from its prefix cache)."""
        return self.prompt_tokens - (self.cached_tokens or 0)


def _count(value: Any) -> int | None:
    # bool is an int subclass; a JSON true is not a token count.
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def parse_usage(usage: Any) -> Usage | None:
    """Read a ``usage`` object in any of the shapes OpenAI-compatible servers send.

    * Chat and completions: ``prompt_tokens``, ``completion_tokens``,
      ``prompt_tokens_details.cached_tokens``.
    * Responses API: ``input_tokens``, ``output_tokens``,
      ``input_tokens_details.cached_tokens``.
    * Anthropic messages: ``input_tokens`` (uncached only), ``output_tokens``,
      ``cache_read_input_tokens`` and ``cache_creation_input_tokens``.

    Returns None when ``usage`` is not an object with token counts.
    """
    if not isinstance(usage, Mapping):
        return None
    prompt = _count(usage.get("prompt_tokens"))
    if prompt is not None:
        details = usage.get("prompt_tokens_details")
        cached = _count(details.get("cached_tokens")) if isinstance(details, Mapping) else None
        completion = _count(usage.get("completion_tokens")) or 0
        return Usage(prompt, completion, cached)
    inputs = _count(usage.get("input_tokens"))
    if inputs is None:
        return None
    completion = _count(usage.get("output_tokens")) or 0
    read_field, written_field = (
        usage.get("cache_read_input_tokens"),
        usage.get("cache_creation_input_tokens"),
    )
    if read_field is not None or written_field is not None:
        # Anthropic counts cache reads and writes apart from input_tokens; a null (or
        # absent) pair means the server could not tell, as vLLM without cache details.
        read = _count(read_field) or 0
        written = _count(written_field) or 0
        return Usage(inputs + read + written, completion, read)
    details = usage.get("input_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, Mapping) else None
    return Usage(inputs, completion, cached)


def usage_of_response(body: Any) -> Usage | None:
    """Return the usage of a decoded response or stream chunk, if it carries one.

    The Responses API nests it under ``response`` in its final
    ``response.completed`` event; the other APIs put it at the top level.
    """
    if not isinstance(body, Mapping):
        return None
    found = parse_usage(body.get("usage"))
    if found is None and isinstance(body.get("response"), Mapping):
        found = parse_usage(body["response"].get("usage"))
    return found
