"""The simulated engine's tokenizer, block hash chain, chat template and filler text."""

from __future__ import annotations

import hashlib

from hypothesis import given
from hypothesis import strategies as st

from sessionfleet.simengine.tokenizer import (
    CHARS_PER_TOKEN,
    ROOT_HASH,
    chain_hash,
    count_tokens,
    filler_words,
    render_chat,
    split_blocks,
)

TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=600)


@given(TEXT, TEXT, st.integers(min_value=1, max_value=8))
def test_blocks_are_prefix_stable(head: str, tail: str, block_size: int) -> None:
    short = split_blocks(head, block_size)
    long = split_blocks(head + tail, block_size)
    assert long.hashes[: len(short.hashes)] == short.hashes


@given(TEXT, st.integers(min_value=1, max_value=8))
def test_token_count_and_tail(text: str, block_size: int) -> None:
    split = split_blocks(text, block_size)
    assert split.num_tokens == count_tokens(text)
    assert split.tail_start == len(split.hashes) * block_size * CHARS_PER_TOKEN
    assert len(text) - split.tail_start < block_size * CHARS_PER_TOKEN


def test_a_block_depends_on_everything_before_it() -> None:
    block = "x" * 16 * CHARS_PER_TOKEN
    one = split_blocks("a" * 64 + block, 16)
    other = split_blocks("b" * 64 + block, 16)
    assert one.hashes[1] != other.hashes[1]
    assert one.hashes[1] == chain_hash(chain_hash(ROOT_HASH, "a" * 64), block)


def test_hashes_do_not_depend_on_the_process() -> None:
    # BLAKE2b of parent and text: Python's salted hash() would differ between
    # processes, and an exported cache would then never hit in another engine.
    expected = hashlib.blake2b(ROOT_HASH + b"hello", digest_size=16).digest()
    assert chain_hash(ROOT_HASH, "hello") == expected


def test_a_conversation_renders_as_a_growing_prefix() -> None:
    first = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"}]
    reply = "".join(filler_words(b"seed", 7))
    second = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "go"}]
    rendered_first = render_chat(first)
    assert render_chat(second).startswith(rendered_first + reply)


def test_content_parts_and_tool_calls_render_deterministically() -> None:
    calls = [{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"text": "b"}]}]
    assert "ab<|im_end|>" in render_chat(parts)
    one = render_chat([{"role": "assistant", "content": None, "tool_calls": calls}])
    reordered = [{"function": {"arguments": "{}", "name": "ls"}, "type": "function", "id": "c1"}]
    two = render_chat([{"role": "assistant", "content": None, "tool_calls": reordered}])
    assert one == two


def test_filler_words_are_deterministic_one_token_each() -> None:
    words = filler_words(b"x", 100)
    assert words == filler_words(b"x", 100)
    assert words != filler_words(b"y", 100)
    assert count_tokens("".join(words)) == 100
    assert filler_words(b"x", 5) == words[:5]
