"""A deterministic approximate tokenizer: four characters make one token.

The simulator, the trace loader and (later) the simulated engine need token counts
that are the same on every machine and need no model files. Four characters per
token is the usual rule of thumb for English text and code with BPE tokenizers.

The split is into fixed four-character pieces, so it is *prefix-stable*: when text
``a`` is a prefix of text ``b``, every whole piece of ``a`` is also a piece of ``b``
at the same position. A prefix cache keyed on these pieces therefore behaves like
one keyed on real token ids for a conversation that only grows by appending.
"""

from __future__ import annotations

CHARS_PER_TOKEN = 4


def count_tokens(text: str) -> int:
    """Return the approximate number of tokens in ``text`` (a partial piece counts as one)."""
    return -(-len(text) // CHARS_PER_TOKEN)


def tokenize(text: str) -> list[str]:
    """Split ``text`` into its approximate tokens: consecutive four-character pieces.

    ``len(tokenize(text)) == count_tokens(text)`` always holds.
    """
    return [text[i : i + CHARS_PER_TOKEN] for i in range(0, len(text), CHARS_PER_TOKEN)]
