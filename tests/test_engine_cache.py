"""The simulated engine's prefix cache: hits, LRU eviction, references, snapshots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sessionfleet.simengine.cache import (
    BLOCKS_FILE,
    MANIFEST_FILE,
    CacheSnapshot,
    PrefixCache,
    SessionRecord,
    SnapshotError,
    read_snapshot,
    write_snapshot,
)

BLOCK = 4


def chain(name: str, n: int) -> list[bytes]:
    return [f"{name}{i}".encode().ljust(16, b".") for i in range(n)]


def serve(cache: PrefixCache, hashes: list[bytes]) -> None:
    """One finished request: reference its blocks, then release them."""
    cache.release(cache.acquire(hashes))


def test_hits_are_the_leading_cached_blocks_only() -> None:
    cache = PrefixCache(capacity_tokens=100 * BLOCK, block_size=BLOCK)
    blocks = chain("a", 5)
    serve(cache, blocks[:3])
    assert cache.lookup(blocks, prompt_tokens=5 * BLOCK + 1).hit_tokens == 3 * BLOCK
    # A hole in the chain ends the hit: later blocks cannot be reached.
    gapped = PrefixCache(capacity_tokens=100 * BLOCK, block_size=BLOCK)
    serve(gapped, [blocks[0], blocks[2]])
    assert gapped.lookup(blocks, prompt_tokens=5 * BLOCK + 1).hit_blocks == 1


def test_the_last_prompt_token_is_never_a_hit() -> None:
    cache = PrefixCache(capacity_tokens=100 * BLOCK, block_size=BLOCK)
    blocks = chain("a", 3)
    serve(cache, blocks)
    # The prompt is exactly three blocks: the engine must compute its last token,
    # so only two blocks can be served from cache (as in vLLM).
    assert cache.lookup(blocks, prompt_tokens=3 * BLOCK).hit_blocks == 2
    assert cache.lookup(blocks, prompt_tokens=3 * BLOCK + 1).hit_blocks == 3


def test_metrics_count_tokens() -> None:
    cache = PrefixCache(capacity_tokens=100 * BLOCK, block_size=BLOCK)
    blocks = chain("a", 2)
    cache.lookup(blocks, 9)
    serve(cache, blocks)
    cache.lookup(blocks, 9)
    assert (cache.queries_tokens, cache.hits_tokens) == (18, 8)


def test_lru_eviction_takes_the_oldest_and_chain_tails_first() -> None:
    cache = PrefixCache(capacity_tokens=4 * BLOCK, block_size=BLOCK)
    old = chain("a", 3)
    serve(cache, old)
    new = chain("b", 3)
    serve(cache, new)
    # Room for four blocks: the old chain lost its last two blocks, not its first.
    assert old[0] in cache
    assert old[1] not in cache and old[2] not in cache
    assert all(h in cache for h in new)
    assert cache.evicted_blocks == 2


def test_a_touched_chain_becomes_recent() -> None:
    cache = PrefixCache(capacity_tokens=4 * BLOCK, block_size=BLOCK)
    first, second = chain("a", 2), chain("b", 2)
    serve(cache, first)
    serve(cache, second)
    serve(cache, first)  # a later turn of the first session
    serve(cache, chain("c", 2))
    assert all(h in cache for h in first)
    assert not any(h in cache for h in second)


def test_referenced_blocks_are_never_evicted() -> None:
    cache = PrefixCache(capacity_tokens=4 * BLOCK, block_size=BLOCK)
    running = cache.acquire(chain("a", 3))
    held = cache.acquire(chain("b", 3))
    # Only one block was free to take: the rest of the second request is not cached.
    assert len(held) == 1
    assert all(h in cache for h in running)
    assert cache.kv_usage == 1.0
    cache.release(running)
    cache.release(held)
    assert cache.kv_usage == 0.0
    assert cache.cached_blocks == 4


def test_usage_counts_private_blocks_and_shared_blocks_once() -> None:
    cache = PrefixCache(capacity_tokens=10 * BLOCK, block_size=BLOCK)
    shared = chain("a", 2)
    one = cache.acquire(shared, private_blocks=1)
    two = cache.acquire(shared, private_blocks=1)
    assert cache.kv_usage == pytest.approx(4 / 10)
    cache.release(one, private_blocks=1)
    assert cache.kv_usage == pytest.approx(3 / 10)
    cache.release(two, private_blocks=1)
    assert cache.kv_usage == 0.0


def test_clear_drops_only_unreferenced_blocks() -> None:
    cache = PrefixCache(capacity_tokens=10 * BLOCK, block_size=BLOCK)
    serve(cache, chain("a", 2))
    running = cache.acquire(chain("b", 2))
    assert cache.clear() == 2
    assert all(h in cache for h in running)
    assert cache.cached_blocks == 2


def test_insert_preserves_order_and_capacity() -> None:
    cache = PrefixCache(capacity_tokens=3 * BLOCK, block_size=BLOCK)
    blocks = chain("a", 5)
    assert cache.insert(blocks) == 5
    # Inserted least-recent first: the last three remain.
    assert cache.lru_order() == blocks[2:]


def test_capacity_must_hold_a_block() -> None:
    with pytest.raises(ValueError):
        PrefixCache(capacity_tokens=3, block_size=4)


def test_snapshot_round_trip(tmp_path: Path) -> None:
    snapshot = CacheSnapshot(
        model="m",
        block_size=16,
        blocks=chain("a", 3),
        sessions={"s1": SessionRecord(chain("a", 2), 40)},
    )
    manifest = write_snapshot(snapshot, tmp_path / "cp")
    assert manifest["blocks"] == 3 and manifest["tokens"] == 48
    back = read_snapshot(tmp_path / "cp")
    assert back.blocks == snapshot.blocks
    assert back.sessions["s1"].hashes == chain("a", 2)
    assert back.sessions["s1"].tokens == 40
    assert (back.model, back.block_size) == ("m", 16)
    assert not list((tmp_path / "cp").glob(".*.tmp"))


def test_read_refuses_what_is_not_a_snapshot(tmp_path: Path) -> None:
    with pytest.raises(SnapshotError, match="holds no cache snapshot"):
        read_snapshot(tmp_path)
    write_snapshot(CacheSnapshot("m", 16, chain("a", 2)), tmp_path)
    (tmp_path / BLOCKS_FILE).write_bytes(b"short")
    with pytest.raises(SnapshotError, match="does not match the manifest"):
        read_snapshot(tmp_path)
    (tmp_path / MANIFEST_FILE).write_text(json.dumps({"format": "other"}))
    with pytest.raises(SnapshotError, match="not a sessionfleet-sim-cache/v1 snapshot"):
        read_snapshot(tmp_path)
