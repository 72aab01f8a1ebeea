"""A worker's prefix cache, kept per session rather than per block.

vLLM caches the KV of full blocks of tokens, keyed by a hash chain (a block's hash
covers every token before it), and evicts unreferenced blocks least recently used
first; a finished request frees its blocks tail first, so of one request the tail
blocks go before the head. A lookup walks the chain from the first block and stops
at the first block that is missing.

A conversation only ever grows by appending, so the blocks one session holds on a
worker are always a prefix of its next prompt, and all blocks of one request are
touched at once. That lets this cache keep one *entry* per session — how many
tokens beyond the shared system prompt it has cached — plus one entry per system
prompt group, in one LRU order:

- a lookup is the system-prompt entry (when complete) plus the session's entry:
  O(1), where a block cache walks every block;
- eviction takes the least recently used entry and shrinks it from its tail, a
  block at a time, exactly as tail-first block eviction would;
- the system prompt's entry is touched after the session's, so it is evicted after
  every private block of the same request, as its blocks (shared by every running
  request of the group) are in vLLM.

``tests/test_fleetsim_cache.py`` checks that this gives the same hits as a cache of
individual hashed blocks. The simplifications, documented in docs/simulator.md:
a child session's copy of its parent's context is counted against capacity twice
(a block cache stores it once), and the old private blocks of a session whose
context was compacted are dropped at once rather than left to age out.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixCache:
    """One worker's prefix cache: capacity in tokens, full blocks of ``block_size`` tokens.

    Keys are integers: a session's key (>= 0) for its private blocks and a group's key
    (< 0) for the system prompt that the group's sessions share. ``shared`` is the
    length of that system prompt rounded down to whole blocks; the block that holds
    its end also holds the session's first own tokens, so it is private.
    """

    __slots__ = ("block_size", "capacity", "entries", "used")

    def __init__(self, capacity: int, block_size: int = 16) -> None:
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        self.capacity = capacity
        self.block_size = block_size
        self.used = 0
        self.entries: OrderedDict[int, int] = OrderedDict()

    def lookup(self, key: int, group: int, shared: int, prompt: int, restart: bool = False) -> int:
        """Return how many leading tokens of ``prompt`` are cached, without touching anything."""
        entries = self.entries
        cached = entries.get(group, 0)
        if cached >= shared and not restart:
            cached += entries.get(key, 0)
        # The engine always computes the last prompt token, to produce the first output.
        limit = (prompt - 1) // self.block_size * self.block_size
        return cached if cached < limit else limit

    def access(
        self,
        key: int,
        group: int,
        shared: int,
        prompt: int,
        restart: bool = False,
        parent: int = -1,
        parent_tokens: int = 0,
    ) -> int:
        """Serve one prompt: return its cached leading tokens, then cache all of it.

        ``restart`` says the session's context was compacted, so its cached private
        blocks no longer match. For a child's first turn, ``parent`` is the parent's
        key and ``parent_tokens`` the (block-aligned) length of the prompt it shares
        with the parent beyond the system prompt.
        """
        entries = self.entries
        block = self.block_size
        group_cached = entries.get(group, 0)
        own = entries.get(key, 0)
        if group_cached < shared:
            cached = group_cached
        else:
            cached = shared
            if not restart:
                cached += own
            if parent_tokens and cached == shared:
                from_parent = entries.get(parent, 0)
                if from_parent:
                    cached += from_parent if from_parent < parent_tokens else parent_tokens
                    entries.move_to_end(parent)
        limit = (prompt - 1) // block * block
        if cached > limit:
            cached = limit

        # Store: the private blocks first, then the shared ones, so that the shared
        # ones are the most recently used (evicted after this request's own).
        stored = prompt // block * block - shared
        if stored < 0:
            stored = 0
        self.used += stored - own + shared - group_cached
        entries[key] = stored
        entries.move_to_end(key)
        entries[group] = shared
        entries.move_to_end(group)
        if self.used > self.capacity:
            self._evict()
        return cached

    def store(self, key: int, group: int, shared: int, tokens: int) -> None:
        """Cache ``tokens`` leading tokens of a session's context (a restore or migration)."""
        entries = self.entries
        stored = max(0, tokens // self.block_size * self.block_size - shared)
        self.used += stored - entries.get(key, 0) + shared - entries.get(group, 0)
        entries[key] = stored
        entries.move_to_end(key)
        entries[group] = shared
        entries.move_to_end(group)
        if self.used > self.capacity:
            self._evict()

    def cached_tokens(self, key: int, group: int, shared: int) -> int:
        """Return how many tokens of a session's context are cached here."""
        group_cached = self.entries.get(group, 0)
        if group_cached < shared:
            return group_cached
        return shared + self.entries.get(key, 0)

    def _evict(self) -> None:
        """Free least recently used blocks until the cache fits its capacity."""
        entries = self.entries
        block = self.block_size
        excess = self.used - self.capacity
        while excess > 0 and entries:
            key, tokens = entries.popitem(last=False)
            if tokens > excess:
                # Only the tail of this entry has to go, in whole blocks.
                freed = -(-excess // block) * block
                if freed < tokens:
                    entries[key] = tokens - freed
                    entries.move_to_end(key, last=False)
                else:
                    freed = tokens
            else:
                freed = tokens
            self.used -= freed
            excess -= freed

    def clear(self) -> None:
        """Drop everything: the worker's pod is gone."""
        self.entries.clear()
        self.used = 0

    def snapshot(self) -> OrderedDict[int, int]:
        """Return a copy of the entries, as a checkpoint saves them."""
        return self.entries.copy()

    def restore(self, saved: OrderedDict[int, int]) -> None:
        """Replace the contents by a snapshot (a new pod restoring a checkpoint)."""
        self.entries = saved.copy()
        self.used = sum(saved.values())
        if self.used > self.capacity:
            self._evict()
