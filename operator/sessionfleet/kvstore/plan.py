"""The scheduler side's decisions, without vLLM: which blocks a step loads and saves.

vLLM's scheduler hands the connector its requests, their block ids and their chained
block hashes (``Request.block_hashes``: block ``i``'s hash covers every token up to the
end of block ``i``). These functions and :class:`RequestBlocks` decide, from those
numbers only, what the worker side copies; the connector turns them into metadata.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sessionfleet.kvstore.store import valid_session


def loadable_blocks(
    chain: Sequence[str],
    num_tokens: int,
    computed_tokens: int,
    block_tokens: int,
    stored: Callable[[str], bool],
) -> int:
    """How many blocks after the ``computed_tokens`` the engine holds can come from the store.

    vLLM must compute at least the request's last token, so only whole blocks within
    the first ``num_tokens - 1`` count; the hits must follow one another from the first
    block the engine lacks (a prefix, not scattered blocks).
    """
    first = computed_tokens // block_tokens
    usable = min(len(chain), max(num_tokens - 1, 0) // block_tokens)
    count = 0
    for index in range(first, usable):
        if not stored(chain[index]):
            break
        count += 1
    return count


def session_tag(session_id: object) -> str | None:
    """Return the store's name for a request's session (vLLM's ``X-Session-ID``), or None.

    The router sends the AgentSession's name, which is already a safe file name; any
    other value (a client's own id sent straight to the engine) is not a session the
    store records.
    """
    return session_id if isinstance(session_id, str) and valid_session(session_id) else None


@dataclass(slots=True)
class RequestBlocks:
    """One running request's blocks as the scheduler told the connector about them."""

    block_ids: list[int] = field(default_factory=list)
    saved_upto: int = 0
    """Blocks before this index are handled: stored already, or queued this run."""

    def allocate(self, block_ids: Sequence[int], replace: bool) -> None:
        """Blocks the scheduler gave the request this step (all of them after a preemption)."""
        if replace:
            self.block_ids = list(block_ids)
            self.saved_upto = 0
        else:
            self.block_ids.extend(block_ids)

    def to_save(
        self,
        chain: Sequence[str],
        computed_after_step: int,
        block_tokens: int,
        stored: Callable[[str], bool],
    ) -> list[tuple[int, str]]:
        """(block id, hash) of the blocks this step completes that the store lacks.

        A block is complete once the step has computed all of its tokens; its hash
        exists once vLLM has hashed it (prompt blocks at once, output blocks as they
        fill). Blocks the engine found in its own prefix cache are saved too when the
        store lacks them, so an evicted or dropped block comes back.
        """
        full = min(computed_after_step // block_tokens, len(chain), len(self.block_ids))
        wanted = [
            (self.block_ids[index], chain[index])
            for index in range(self.saved_upto, full)
            if not stored(chain[index])
        ]
        self.saved_upto = max(self.saved_upto, full)
        return wanted
