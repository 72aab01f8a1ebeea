"""Text to tokens and blocks for the simulated engine, and the block hash chain.

Tokens are those of :mod:`sessionfleet.workload` (four characters make one token), so
the fleet simulator, the trace loader and this engine count alike, and a 700 KB request
is about 180K tokens. That split is **prefix-stable**: the tokens of a conversation's
first N messages are the first tokens of the conversation with one more message, which
is what makes a prefix cache hit turn after turn.

A block is ``block_size`` consecutive tokens, so ``4 * block_size`` characters. Block
*i* is identified by a hash of block *i-1*'s hash and block *i*'s text (a hash chain,
as in vLLM's prefix cache): a block matches only when everything before it matches too.
The hash is BLAKE2b, not Python's ``hash()``: the latter is salted per process
(``PYTHONHASHSEED``) and an exported cache would never hit in another process, the very
trap docs/background.md ("vLLM interfaces") describes for vLLM + LMCache.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from sessionfleet.workload import CHARS_PER_TOKEN, count_tokens, tokenize

__all__ = [
    "CHARS_PER_TOKEN",
    "HASH_BYTES",
    "ROOT_HASH",
    "BlockSplit",
    "chain_hash",
    "count_tokens",
    "filler_words",
    "anthropic_chat",
    "render_chat",
    "render_message",
    "split_blocks",
    "tokenize",
]

ROOT_HASH: Final = b"sessionfleet-sim-v1"
"""The parent of a prompt's first block; changing it invalidates every exported cache."""

HASH_BYTES: Final = 16


def chain_hash(parent: bytes, block_text: str) -> bytes:
    """Return the hash of a block given its parent's hash and its text."""
    data = parent + block_text.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=HASH_BYTES).digest()


@dataclass(frozen=True, slots=True)
class BlockSplit:
    """A text cut into full blocks (by hash) and a partial tail."""

    hashes: list[bytes]
    """The hash of each full block, in order."""
    num_tokens: int
    """All tokens of the text: full blocks and tail."""
    tail_start: int
    """The character offset where the partial tail (fewer than block_size tokens) begins."""

    @property
    def last_hash(self) -> bytes | None:
        """The hash of the last full block, or None when there is none."""
        return self.hashes[-1] if self.hashes else None


def split_blocks(text: str, block_size: int, parent: bytes = ROOT_HASH) -> BlockSplit:
    """Cut ``text`` into blocks of ``block_size`` tokens chained from ``parent``."""
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    width = block_size * CHARS_PER_TOKEN
    full = len(text) // width
    hashes: list[bytes] = []
    previous = parent
    data = text.encode("utf-8", "surrogatepass")
    if len(data) == len(text):
        # ASCII (most prompts): character and byte offsets agree, so the blocks are
        # slices of one encoded buffer, hashed without a copy. Same hashes as below.
        view = memoryview(data)
        blake2b = hashlib.blake2b
        for start in range(0, full * width, width):
            digest = blake2b(previous, digest_size=HASH_BYTES)
            digest.update(view[start : start + width])
            previous = digest.digest()
            hashes.append(previous)
    else:
        for start in range(0, full * width, width):
            previous = chain_hash(previous, text[start : start + width])
            hashes.append(previous)
    return BlockSplit(hashes, count_tokens(text), full * width)


# --- the chat template ----------------------------------------------------------------

_OPEN: Final = "<|im_start|>"
_CLOSE: Final = "<|im_end|>\n"


def _content_text(content: Any) -> str:
    """Return the text of a message's content: a string, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
        return "".join(parts)
    raise ValueError("message content must be a string, a list of parts, or null")


def render_message(message: Mapping[str, Any]) -> str:
    """Render one chat message as the template does (ChatML-like)."""
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ValueError("every message needs a role")
    text = _content_text(message.get("content"))
    tool_calls = message.get("tool_calls")
    if tool_calls:
        # Sorted keys: the same calls always render to the same tokens.
        text += json.dumps(tool_calls, sort_keys=True, separators=(",", ":"))
    return f"{_OPEN}{role}\n{text}{_CLOSE}"


def render_chat(messages: Sequence[Mapping[str, Any]]) -> str:
    """Render a conversation and the generation prompt for the assistant's reply.

    The rendering of the first N messages is a prefix of the rendering of N+1
    messages, and an assistant reply rendered in the next request starts with this
    function's trailing generation prompt followed by the reply's text, so the blocks
    the engine cached while generating the reply hit in the next turn.
    """
    if not messages:
        raise ValueError("messages must not be empty")
    return "".join(render_message(m) for m in messages) + f"{_OPEN}assistant\n"


BILLING_HEADER_PREFIX: Final = "x-anthropic-billing-header"
"""Claude Code sends a system block starting with this, holding a per-request hash; vLLM
drops it because it would make every prompt's prefix differ (no cache hit ever)."""


def _blocks(content: Any, where: str) -> list[Mapping[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(
        isinstance(block, Mapping) and isinstance(block.get("type"), str) for block in content
    ):
        raise ValueError(f"{where} must be a string or a list of content blocks with a type")
    return content


def _result_text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(
            part["text"]
            for part in content
            if isinstance(part, Mapping) and isinstance(part.get("text"), str)
        )
    return content if isinstance(content, str) else ""


def anthropic_chat(system: Any, messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Turn a Messages API request (``system``, ``messages``) into chat messages.

    As vLLM does before applying its chat template: the system text first; text blocks
    become the content, ``tool_use`` blocks tool calls, ``tool_result`` blocks messages
    of role ``tool``; images and thinking blocks carry no text here. A reply sent back
    as the next turn's assistant message renders as the chat API's would, so the
    blocks cached while generating it hit. Raises ValueError for a malformed request.
    """
    chat: list[dict[str, Any]] = []
    if system is not None:
        parts = [
            block["text"]
            for block in _blocks(system, "system")
            if block["type"] == "text"
            and isinstance(block.get("text"), str)
            and not block["text"].startswith(BILLING_HEADER_PREFIX)
        ]
        if parts:
            chat.append({"role": "system", "content": "".join(parts)})
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or message.get("role") not in ("user", "assistant"):
            raise ValueError(
                f"messages.{index}: every message is an object with role user or assistant "
                "(the system prompt goes in the top-level system field)"
            )
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for block in _blocks(message.get("content"), f"messages.{index}.content"):
            kind = block["type"]
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use":
                arguments = json.dumps(block.get("input") or {}, sort_keys=True)
                function = {"name": block.get("name") or "", "arguments": arguments}
                call_id = block.get("id") or ""
                calls.append({"id": call_id, "type": "function", "function": function})
            elif kind == "tool_result":
                chat.append(
                    {
                        "role": "tool",
                        "tool_call_id": block.get("tool_use_id") or "",
                        "content": _result_text(block.get("content")),
                    }
                )
        converted: dict[str, Any] = {"role": message["role"], "content": "".join(texts)}
        if calls:
            converted["tool_calls"] = calls
        if texts or calls:
            chat.append(converted)
    if not chat:
        raise ValueError("messages must hold some text")
    return chat


# --- generated text -------------------------------------------------------------------

# Three letters and a space: every word is exactly one token, and n words are n tokens.
_VOCABULARY: Final = tuple(
    f"{word} "
    for word in (
        "the fix run bug add set get for map key log cli api end new old top row "
        "col sum max min arg var def try use out via now"
    ).split()
)


def filler_words(seed: bytes, count: int) -> list[str]:
    """Return ``count`` deterministic filler words (one token each) for generated text.

    The same seed gives the same words, so a replayed request generates the same
    reply; the seed is the prompt's hash, so different prompts differ. Joined with
    ``""`` they are the reply's text.
    """
    words: list[str] = []
    state = seed
    while len(words) < count:
        state = hashlib.blake2b(state, digest_size=32).digest()
        words.extend(_VOCABULARY[byte % len(_VOCABULARY)] for byte in state)
    return words[:count]
