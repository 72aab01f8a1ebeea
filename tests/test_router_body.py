"""Finding the model in a request body and the usage in a response, without decoding them."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sessionfleet.engines.vllm import Usage
from sessionfleet.fronts.body import (
    HEAD_BYTES,
    TAIL_BYTES,
    BodyError,
    find_model,
    usage_in_body,
    usage_in_stream,
    usage_in_tail,
)


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m1", "messages": []}',
        b'{"messages": [{"role": "user", "content": "x"}], "model":"m1"}',
        b'  {\n  "stream": true,\n  "model" :\t "m1"\n}',
        # A message that talks about models, quoted keys and all.
        json.dumps(
            {"messages": [{"role": "user", "content": 'say "model": "m2", ok'}], "model": "m1"}
        ).encode(),
        # A tool schema with a nested "model" key: decoded in full, still the top level.
        json.dumps(
            {
                "tools": [{"parameters": {"properties": {"model": {"type": "string"}}}}],
                "model": "m1",
            }
        ).encode(),
        # Gemini-style role "model" is a value, not a key.
        json.dumps({"messages": [{"role": "model", "content": "x"}], "model": "m1"}).encode(),
        # The key written with an escape: not found by the scan, found by decoding.
        b'{"mod\\u0065l": "m1"}',
        # Nested keys before and after the top-level one.
        b'{"a": {"model": "x"}, "model": "m1"}',
        b'{"messages": [], "model": "m1", "tools": [{"model": "m2"}]}',
        b'{"messages": [{"model": "m2"}], "model" : "m1" , "stream": true}\n',
        b'{"a": [{"model": "m2"}], "b": {"model": "m3"}, "model": "m1"}',
        b'{"model": "m\\u0031"}',
        # Anthropic's Messages API: a system prompt in blocks that talk about models,
        # tools whose input_schema has a model property, metadata; model last.
        json.dumps(
            {
                "max_tokens": 8192,
                "system": [{"type": "text", "text": '{"model": "m2"}', "cache_control": {}}],
                "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
                "tools": [
                    {
                        "name": "pick",
                        "input_schema": {"type": "object", "properties": {"model": {}}},
                    }
                ],
                "metadata": {"user_id": "u"},
                "stream": True,
                "model": "m1",
            }
        ).encode(),
    ],
)
def test_find_model(body: bytes) -> None:
    assert find_model(body) == "m1"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "must be a JSON object"),
        (b"[1]", "must be a JSON object"),
        (b'{"messages": []}', "has no model field"),
        (b'{"model": 3}', "non-empty string"),
        (b'{"model": ""}', "non-empty string"),
        (b'{"model": null, "x": 1}', "non-empty string"),
        (b'{"model": "' + b"m" * 300 + b'"}', "at most 256"),
        (b'{"x": 1, "model": "a", "model": "b", nope', "not a complete JSON object"),
        (b"{nope", "has no model field|not a complete JSON object"),
    ],
)
def test_find_model_refusals(body: bytes, message: str) -> None:
    with pytest.raises(BodyError, match=message):
        find_model(body)


@given(
    st.dictionaries(
        st.text(max_size=8).filter(lambda k: k != "model"), st.text(max_size=40), max_size=5
    ),
    st.text(min_size=1, max_size=50),
)
def test_find_model_agrees_with_json(extra: dict[str, str], model: str) -> None:
    body = json.dumps({**extra, "model": model, "messages": [{"content": json.dumps(extra)}]})
    assert find_model(body.encode()) == model


def test_a_700kb_body_is_scanned() -> None:
    content = "def f(x):\n    return x  # model\n" * 22000
    body = json.dumps({"messages": [{"role": "user", "content": content}], "model": "big"})
    assert len(body) > 700_000
    assert find_model(body.encode()) == "big"


USAGE = {
    "prompt_tokens": 120,
    "completion_tokens": 4,
    "total_tokens": 124,
    "prompt_tokens_details": {"cached_tokens": 96},
}


def sse(*events: object) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + (
        b"data: [DONE]\n\n"
    )


def test_usage_in_a_stream_tail() -> None:
    stream = sse(
        {"choices": [{"delta": {"content": 'the "usage": 5'}}], "usage": None},
        {"choices": [], "usage": USAGE},
    )
    assert usage_in_tail(stream) == Usage(120, 4, 96)
    assert usage_in_tail(stream[len(stream) // 3 :]) == Usage(120, 4, 96)


def test_no_usage_in_a_stream() -> None:
    stream = sse({"choices": [{"delta": {"content": "hi"}}], "usage": None})
    assert usage_in_tail(stream) is None
    assert usage_in_tail(b"data: [DONE]\n\n") is None


def test_usage_of_the_responses_api() -> None:
    done = {
        "type": "response.completed",
        "response": {
            "usage": {
                "input_tokens": 50,
                "output_tokens": 2,
                "input_tokens_details": {"cached_tokens": 48},
            }
        },
    }
    assert usage_in_tail(b"event: response.completed\n" + sse(done)) == Usage(50, 2, 48)


def anthropic_stream(opening: dict[str, int], closing: dict[str, int], deltas: int) -> bytes:
    """A Messages stream as Anthropic (and vLLM) write it: named events, usage split."""

    def event(name: str, data: dict[str, object]) -> bytes:
        return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n".encode()

    message = {"id": "msg_1", "role": "assistant", "content": [], "usage": opening}
    parts = [
        event("message_start", {"message": message}),
        event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
    ]
    # The model's text may quote the event names and keys; escaped, they are no keys.
    text = 'a "usage": {"input_tokens": 1} and "type":"message_start" '
    parts += [
        event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}})
    ] * deltas
    parts += [
        event("content_block_stop", {"index": 0}),
        event("message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": closing}),
        event("message_stop", {}),
    ]
    return b"".join(parts)


@pytest.mark.parametrize(
    ("opening", "closing", "expected"),
    [
        # Anthropic's documented split: input and cache counts first, output at the end.
        (
            {"input_tokens": 30, "cache_read_input_tokens": 90, "output_tokens": 1},
            {"output_tokens": 12},
            Usage(120, 12, 90),
        ),
        # vLLM: the whole prompt first (no cache counts yet), every count at the end.
        (
            {"input_tokens": 120, "output_tokens": 0},
            {
                "input_tokens": 30,
                "output_tokens": 12,
                "cache_read_input_tokens": 90,
                "cache_creation_input_tokens": 0,
            },
            Usage(120, 12, 90),
        ),
        # Nulls at the end mean "not reported": the opening counts stay.
        (
            {"input_tokens": 30, "cache_read_input_tokens": 90, "output_tokens": 0},
            {"output_tokens": 12, "input_tokens": None, "cache_read_input_tokens": None},
            Usage(120, 12, 90),
        ),
    ],
)
@pytest.mark.parametrize("deltas", [3, 2000])
def test_usage_of_an_anthropic_stream_is_merged_from_its_two_halves(
    opening: dict[str, int], closing: dict[str, int], expected: Usage, deltas: int
) -> None:
    stream = anthropic_stream(opening, closing, deltas)
    # What the router keeps: the first bytes and the last ones.
    head, tail = stream[:HEAD_BYTES], stream[-TAIL_BYTES:]
    assert usage_in_stream(head, tail) == expected
    if deltas > 100:
        assert b"event: message_start" not in tail  # the tail alone has lost the prompt


def test_an_anthropic_stream_cut_before_its_end_counts_its_prompt() -> None:
    stream = anthropic_stream({"input_tokens": 30, "cache_read_input_tokens": 90}, {}, 3)
    cut = stream[: stream.index(b"event: content_block_stop")]
    assert usage_in_stream(cut[:HEAD_BYTES], cut[-TAIL_BYTES:]) == Usage(120, 0, 90)


def test_other_streams_keep_their_last_usage() -> None:
    # A chat stream whose text quotes an Anthropic event is still a chat stream.
    stream = sse(
        {"choices": [{"delta": {"content": '"type":"message_start","usage":{}'}}]},
        {"choices": [], "usage": USAGE},
    )
    assert usage_in_stream(stream[:HEAD_BYTES], stream) == Usage(120, 4, 96)
    assert usage_in_stream(b"", b"data: [DONE]\n\n") is None


def test_usage_in_a_body() -> None:
    body = {"choices": [{"message": {"content": "x" * 40000}}], "usage": USAGE}
    assert usage_in_body(json.dumps(body).encode()) == Usage(120, 4, 96)
    assert usage_in_body(json.dumps({"choices": []}).encode()) is None
    assert usage_in_body(b"not json") is None


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(st.sampled_from(["model", "x", "y"]), children, max_size=3)
    ),
    max_leaves=12,
)


@given(
    st.dictionaries(st.sampled_from(["messages", "tools", "a", "b"]), JSON_VALUES, max_size=4),
    st.text(min_size=1, max_size=20),
    st.integers(min_value=0, max_value=4),
    st.sampled_from([None, 0, 2]),
)
def test_find_model_with_nested_model_keys(
    extra: dict[str, object], model: str, position: int, indent: int | None
) -> None:
    items = list(extra.items())
    items.insert(min(position, len(items)), ("model", model))
    body = json.dumps(dict(items), indent=indent).encode()
    assert find_model(body) == model
