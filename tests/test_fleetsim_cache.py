"""The per-session prefix cache behaves like a cache of hashed blocks with LRU eviction."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from sessionfleet.fleetsim import PrefixCache


class BlockCache:
    """The reference: individual blocks named by their place in a hash chain, LRU eviction.

    A block of a system prompt is named by (group, index) and shared by the group's
    sessions; any other block by (session, index). A lookup walks the chain from the
    first block and stops at the first missing one. A request touches its private
    blocks tail first, then the shared ones, so that eviction takes a request's tail
    before its head and shared blocks last — vLLM's order.
    """

    def __init__(self, capacity: int, block: int) -> None:
        self.blocks: OrderedDict[tuple[int, int], None] = OrderedDict()
        self.limit = capacity // block
        self.block = block

    def _names(self, key: int, group: int, shared: int, prompt: int) -> list[tuple[int, int]]:
        return [
            (group, j) if (j + 1) * self.block <= shared else (key, j)
            for j in range(prompt // self.block)
        ]

    def access(self, key: int, group: int, shared: int, prompt: int) -> int:
        names = self._names(key, group, shared, prompt)
        cached = 0
        for name in names:
            if name not in self.blocks:
                break
            cached += self.block
        cached = min(cached, (prompt - 1) // self.block * self.block)
        own = [n for n in names if n[0] == key]
        common = [n for n in names if n[0] == group]
        for name in [*reversed(own), *reversed(common)]:
            self.blocks[name] = None
            self.blocks.move_to_end(name)
        while len(self.blocks) > self.limit:
            self.blocks.popitem(last=False)
        return cached

    @property
    def used(self) -> int:
        return len(self.blocks) * self.block


@pytest.mark.parametrize("seed", range(12))
def test_same_hits_as_a_block_cache(seed: int) -> None:
    rng = random.Random(seed)
    block = rng.choice([1, 4, 16])
    capacity = rng.randrange(20, 400) * block + rng.randrange(block)
    fast, reference = PrefixCache(capacity, block), BlockCache(capacity, block)
    groups = {-1: rng.randrange(0, 30) * block, -2: rng.randrange(0, 30) * block}
    sessions = {key: (rng.choice(list(groups)), 0) for key in range(rng.randrange(2, 12))}
    hits = 0
    for _ in range(400):
        key = rng.choice(list(sessions))
        group, prompt = sessions[key]
        prompt = max(prompt, groups[group]) + rng.randrange(1, 40 * block)
        sessions[key] = (group, prompt)
        expected = reference.access(key, group, groups[group], prompt)
        got = fast.access(key, group, groups[group], prompt)
        assert got == expected
        assert fast.used == reference.used <= capacity
        hits += got
    assert hits > 0  # the sequence exercises hits, not only misses


def test_a_session_hits_its_previous_prompt_in_whole_blocks() -> None:
    cache = PrefixCache(10_000, 16)
    assert cache.access(1, -1, 96, 1000) == 0  # nothing cached yet
    assert cache.access(1, -1, 96, 1500) == 992  # 1000 rounded down to blocks
    assert cache.access(2, -1, 96, 800) == 96  # another session: the system prompt only
    assert cache.lookup(1, -1, 96, 2000) == 1488


def test_eviction_takes_the_least_recent_session_tail_first() -> None:
    cache = PrefixCache(3200, 16)
    cache.access(1, -1, 0, 1601)  # 1600 tokens
    cache.access(2, -1, 0, 1601)  # 1600 tokens: full
    cache.access(3, -1, 0, 801)  # 800 more: session 1 loses its last 800 tokens
    assert cache.used <= 3200
    assert cache.cached_tokens(1, -1, 0) == 800
    assert cache.cached_tokens(2, -1, 0) == 1600
    assert cache.lookup(1, -1, 0, 5000) == 800


def test_compaction_keeps_only_the_system_prompt() -> None:
    cache = PrefixCache(100_000, 16)
    cache.access(1, -1, 320, 20_000)
    assert cache.access(1, -1, 320, 5_000, restart=True) == 320
    assert cache.used == 4992


def test_a_child_hits_its_parents_context() -> None:
    cache = PrefixCache(100_000, 16)
    cache.access(1, -1, 320, 20_000)  # the parent: 20,000 tokens
    # A fork sharing 12,000 tokens of the parent's prompt (11,680 beyond the system prompt).
    assert cache.access(2, -1, 320, 14_000, parent=1, parent_tokens=11_680) == 12_000
    # A child placed elsewhere finds the system prompt at best.
    other = PrefixCache(100_000, 16)
    assert other.access(2, -1, 320, 14_000, parent=1, parent_tokens=11_680) == 0


def test_snapshot_and_restore() -> None:
    cache = PrefixCache(50_000, 16)
    cache.access(1, -1, 320, 20_000)
    saved = cache.snapshot()
    cache.access(1, -1, 320, 30_000)
    cache.clear()
    assert cache.used == 0 and cache.lookup(1, -1, 320, 30_000) == 0
    cache.restore(saved)
    assert cache.lookup(1, -1, 320, 30_000) == 20_000
    small = PrefixCache(5_000, 16)
    small.restore(saved)
    assert small.used <= 5_000


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError):
        PrefixCache(100, 0)
