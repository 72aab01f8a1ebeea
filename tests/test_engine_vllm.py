"""Reading ``usage`` in the shapes OpenAI-compatible servers send."""

from __future__ import annotations

from typing import Any

import pytest

from sessionfleet.engines.vllm import Usage, parse_usage, usage_of_response


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        (
            {
                "prompt_tokens": 100,
                "completion_tokens": 5,
                "total_tokens": 105,
                "prompt_tokens_details": {"cached_tokens": 96},
            },
            Usage(100, 5, 96),
        ),
        (
            {"prompt_tokens": 100, "completion_tokens": 5, "prompt_tokens_details": None},
            Usage(100, 5, None),
        ),
        ({"prompt_tokens": 7}, Usage(7, 0, None)),
        (
            {"input_tokens": 50, "output_tokens": 3, "input_tokens_details": {"cached_tokens": 32}},
            Usage(50, 3, 32),
        ),
        (
            {
                "input_tokens": 10,
                "output_tokens": 4,
                "cache_read_input_tokens": 80,
                "cache_creation_input_tokens": 6,
            },
            Usage(96, 4, 80),
        ),
        # Nulls, as a server serialising Anthropic's model without cache details sends:
        # the cache is unknown, not empty.
        (
            {
                "input_tokens": 10,
                "output_tokens": 4,
                "cache_read_input_tokens": None,
                "cache_creation_input_tokens": None,
            },
            Usage(10, 4, None),
        ),
        ({"prompt_tokens": -1}, None),
        ({"prompt_tokens": True}, None),
        ({"total_tokens": 3}, None),
        ("usage", None),
        (None, None),
    ],
)
def test_parse_usage(usage: Any, expected: Usage | None) -> None:
    assert parse_usage(usage) == expected


def test_usage_of_response_finds_the_responses_api_event() -> None:
    event = {"type": "response.completed", "response": {"usage": {"input_tokens": 9}}}
    assert usage_of_response(event) == Usage(9, 0, None)
    assert usage_of_response({"choices": []}) is None
    assert usage_of_response([1]) is None


def test_uncached_tokens() -> None:
    assert Usage(100, 1, 60).uncached_tokens == 40
    assert Usage(100, 1, None).uncached_tokens == 100
