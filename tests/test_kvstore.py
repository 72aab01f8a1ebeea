"""The KV block store's files, its session manifests and the scheduler side's decisions.

Real files in a temporary directory; the faults are real too: a full disk is the
kernel's ENOSPC from /dev/full, an unwritable root a path under a regular file. The
connector itself (the half inside vLLM) runs against real engines in e2e/test_vllm.py.
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

import pytest

from sessionfleet.kvstore import store as store_module
from sessionfleet.kvstore.plan import RequestBlocks, loadable_blocks, session_tag
from sessionfleet.kvstore.store import (
    MAGIC,
    BlockStore,
    Manifest,
    StoreError,
    describe,
    layout_fingerprint,
)

LAYOUT = layout_fingerprint({"model": "tiny", "block_size": 4, "dtype": "bfloat16"})
OTHER_LAYOUT = layout_fingerprint({"model": "other", "block_size": 4, "dtype": "bfloat16"})
LAYERS = [("model.layers.0.attn", 64), ("model.layers.1.attn", 64)]


def block_hash(index: int) -> str:
    return f"{index:064x}"


def payload(seed: int) -> list[tuple[str, bytes]]:
    return [
        (name, bytes((seed + i + j) % 256 for j in range(size)))
        for i, (name, size) in enumerate(LAYERS)
    ]


@pytest.fixture
def store(tmp_path: Path) -> BlockStore:
    return BlockStore(tmp_path / "kv", LAYOUT, block_tokens=4)


def test_a_block_round_trips_and_a_second_write_of_it_is_skipped(store: BlockStore) -> None:
    size = store.write_block(block_hash(1), payload(1))
    assert size > 128 and store.has(block_hash(1))
    assert store.read_block(block_hash(1), LAYERS) == [data for _, data in payload(1)]
    assert store.write_block(block_hash(1), payload(1)) == 0  # same hash: already there
    assert store.read_block(block_hash(2), LAYERS) is None


@pytest.mark.parametrize(
    "damage",
    ["flip a payload byte", "truncate", "append", "bad magic", "garbage header", "empty"],
)
def test_a_damaged_block_is_a_miss_and_is_removed(store: BlockStore, damage: str) -> None:
    store.write_block(block_hash(1), payload(1))
    path = store.block_path(block_hash(1))
    data = bytearray(path.read_bytes())
    if damage == "flip a payload byte":
        data[-5] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) - 7]
    elif damage == "append":
        data += b"x"
    elif damage == "bad magic":
        data[0:1] = b"X"
    elif damage == "garbage header":
        data[len(MAGIC) + 4 : len(MAGIC) + 10] = b"\xff\xfe{{{"
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    assert store.read_block(block_hash(1), LAYERS) is None
    assert not path.exists()  # computed and saved again next time, not read again


def test_a_foreign_or_misnamed_or_reshaped_block_is_a_miss(
    store: BlockStore, tmp_path: Path
) -> None:
    # Another model's block, copied into this layout's directory under the same name.
    foreign = BlockStore(tmp_path / "kv", OTHER_LAYOUT, block_tokens=4)
    foreign.write_block(block_hash(1), payload(1))
    store.block_path(block_hash(1)).parent.mkdir(parents=True, exist_ok=True)
    os.replace(foreign.block_path(block_hash(1)), store.block_path(block_hash(1)))
    assert store.read_block(block_hash(1), LAYERS) is None
    # This layout's block 2, renamed to block 3: its header names block 2.
    store.write_block(block_hash(2), payload(2))
    store.block_path(block_hash(3)).parent.mkdir(parents=True, exist_ok=True)
    os.replace(store.block_path(block_hash(2)), store.block_path(block_hash(3)))
    assert store.read_block(block_hash(3), LAYERS) is None
    # A reader that expects other layer sizes (a changed engine) gets nothing.
    store.write_block(block_hash(4), payload(4))
    assert store.read_block(block_hash(4), [(LAYERS[0][0], 32), (LAYERS[1][0], 96)]) is None


def test_names_that_are_not_hashes_never_become_paths(store: BlockStore) -> None:
    for name in ("../../etc/passwd", "ABC", "", "a" * 200):
        assert not store.has(name)
        assert store.read_block(name, LAYERS) is None
        with pytest.raises(ValueError):
            store.write_block(name, payload(0))
    with pytest.raises(ValueError):
        store.write_manifest(Manifest("../x", (), 0, 0.0))


def test_a_full_disk_is_a_store_error_and_leaves_no_file(
    store: BlockStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = open

    def open_full(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        # The temporary file is written on a device the kernel says is full.
        if "w" in mode and ".tmp-" in str(path):
            Path(path).touch()
            return real_open("/dev/full", mode, *args, **kwargs)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(store_module, "open", open_full, raising=False)
    with pytest.raises(StoreError) as raised:
        store.write_block(block_hash(1), payload(1))
    assert raised.value.errno == errno.ENOSPC
    assert describe(raised.value).startswith("StorageFull")
    assert not store.has(block_hash(1))
    assert list(store.block_path(block_hash(1)).parent.iterdir()) == []  # the temp is gone
    with pytest.raises(StoreError):
        store.write_manifest(Manifest("s-1", (block_hash(1),), 4, 0.0))
    assert store.probe() is not None and store.probe().startswith("StorageFull")  # type: ignore[union-attr]


def test_an_unwritable_root_is_a_store_error_and_reads_are_misses(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    store = BlockStore(blocker / "kv", LAYOUT, block_tokens=4)
    with pytest.raises(StoreError):
        store.write_block(block_hash(1), payload(1))
    assert store.read_block(block_hash(1), LAYERS) is None
    assert store.prefix_hits([block_hash(1)]) == 0
    assert store.probe() is not None
    assert store.report("s-1").tokens == 0 and store.forget(["s-1"]) == (0, 0)


def _write_many(root: str, rounds: int) -> None:
    store = BlockStore(Path(root), LAYOUT, block_tokens=4)
    for _ in range(rounds):
        try:
            store.block_path(block_hash(7)).unlink()
        except FileNotFoundError:
            pass
        store.write_block(block_hash(7), payload(7))


def test_two_engines_writing_one_block_at_once_leave_a_whole_block(store: BlockStore) -> None:
    # Two processes remove and write the same block as fast as they can while this one
    # reads it: every read is the whole block or a miss, never a part of one.
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_write_many, args=(str(store.root), 300)) for _ in range(2)]
    for writer in writers:
        writer.start()
    whole = 0
    deadline = time.monotonic() + 60
    while any(w.is_alive() for w in writers) and time.monotonic() < deadline:
        read = store.read_block(block_hash(7), LAYERS)
        if read is not None:
            assert read == [data for _, data in payload(7)]
            whole += 1
    for writer in writers:
        writer.join(timeout=60)
        assert writer.exitcode == 0
    store.write_block(block_hash(7), payload(7))
    assert store.read_block(block_hash(7), LAYERS) is not None
    temporaries = [p for p in store.blocks_dir.rglob("*") if p.name.startswith(".tmp-")]
    assert temporaries == []


def test_report_counts_the_prefix_present_and_forget_keeps_shared_blocks(store: BlockStore) -> None:
    system = [block_hash(i) for i in range(3)]  # a system prompt both sessions share
    a = [*system, block_hash(10), block_hash(11)]
    b = [*system, block_hash(20)]
    for index, name in enumerate({*a, *b}):
        store.write_block(name, payload(index))
    store.write_manifest(Manifest("sess-a", tuple(a), 22, 1.0))
    store.write_manifest(Manifest("sess-b", tuple(b), 17, 1.0))
    assert store.sessions() == ["sess-a", "sess-b"]
    report = store.report("sess-a")
    assert (report.blocks, report.tokens, report.chain) == (5, 20, 5) and report.bytes > 0
    store.block_path(block_hash(10)).unlink()  # a hole: only the prefix before it loads
    assert store.report("sess-a").tokens == 12
    assert store.report("sess-b").tokens == 16  # 17 tokens: 4 whole blocks, all stored
    removed, freed = store.forget(["sess-a"])
    assert removed == 1 and freed > 0  # block 11 only: 10 was gone, 0-2 are b's too
    assert store.sessions() == ["sess-b"]
    assert all(store.has(h) for h in b) and not store.has(block_hash(11))
    assert store.forget(["sess-b", "not-there", "../x"])[0] == 4
    assert store.usage() == (0, 0)


def test_eviction_removes_the_least_recently_used_blocks_down_under_the_cap(
    store: BlockStore,
) -> None:
    for index in range(10):
        store.write_block(block_hash(index), payload(index))
        os.utime(store.block_path(block_hash(index)), (1000 + index, 1000 + index))
    files, size = store.usage()
    assert files == 10
    store.read_block(block_hash(0), LAYERS)  # used now: the newest
    per_block = size // 10
    assert store.evict(0) == (0, 0) and store.evict(size) == (0, 0)
    removed, freed = store.evict(per_block * 5)
    # Down to 90% of the cap: 4 of the 10 blocks stay.
    assert removed == 6 and store.usage() == (4, size - freed)
    assert size - freed <= per_block * 5 * 0.9
    assert [store.has(block_hash(i)) for i in range(10)] == [True] + [False] * 6 + [True] * 3


def test_a_killed_writers_temporaries_are_swept(store: BlockStore) -> None:
    store.write_block(block_hash(1), payload(1))
    leftover = store.block_path(block_hash(1)).with_name(".tmp-leftover")
    leftover.write_bytes(b"half")
    os.utime(leftover, (1, 1))
    fresh = leftover.with_name(".tmp-fresh")
    fresh.write_bytes(b"being written")
    assert store.sweep_temporaries() == 1
    assert fresh.exists() and not leftover.exists() and store.has(block_hash(1))


def test_a_manifest_that_is_not_one_reads_as_none(store: BlockStore) -> None:
    store.write_manifest(Manifest("sess-a", (block_hash(1),), 4, 1.0))
    assert store.read_manifest("sess-a") == Manifest("sess-a", (block_hash(1),), 4, 1.0)
    path = store.sessions_dir / "sess-a.json"
    for text in (
        "{",
        '{"session": "sess-b", "blocks": [], "tokens": 0, "updated": 0}',
        '{"session": "sess-a", "blocks": ["../x"], "tokens": 0, "updated": 0}',
        "[]",
    ):
        path.write_text(text)
        assert store.read_manifest("sess-a") is None
        assert store.report("sess-a").tokens == 0


# --- the scheduler side's decisions ------------------------------------------------


def test_loadable_blocks_start_after_the_engines_own_hit_and_stop_at_a_miss() -> None:
    chain = [block_hash(i) for i in range(8)]
    stored = set(chain[:6])
    # 30 tokens in blocks of 4: at most 7 whole blocks within the first 29 tokens.
    assert loadable_blocks(chain, 30, 0, 4, stored.__contains__) == 6
    assert loadable_blocks(chain, 30, 8, 4, stored.__contains__) == 4  # 2 held locally
    assert loadable_blocks(chain, 30, 24, 4, stored.__contains__) == 0
    # The last token is always computed: a prompt of exactly 8 blocks loads 7.
    assert loadable_blocks(chain, 32, 0, 4, set(chain).__contains__) == 7
    stored.discard(chain[2])
    assert loadable_blocks(chain, 30, 0, 4, stored.__contains__) == 2  # a prefix, not holes
    assert loadable_blocks([], 30, 0, 4, stored.__contains__) == 0
    assert loadable_blocks(chain, 1, 0, 4, stored.__contains__) == 0


def test_a_request_saves_each_completed_block_once_and_again_after_a_preemption() -> None:
    chain = [block_hash(i) for i in range(6)]
    stored = {chain[0]}
    tracked = RequestBlocks()
    tracked.allocate([10, 11, 12], replace=True)
    # The first step computes 9 tokens: blocks 0 and 1 complete; 0 is stored already.
    assert tracked.to_save(chain[:2], 9, 4, stored.__contains__) == [(11, chain[1])]
    assert tracked.to_save(chain[:2], 9, 4, stored.__contains__) == []  # handled
    tracked.allocate([13], replace=False)
    # Decode fills block 2 and 3; vLLM has hashed block 2 only so far.
    assert tracked.to_save(chain[:3], 16, 4, stored.__contains__) == [(12, chain[2])]
    assert tracked.to_save(chain[:4], 16, 4, stored.__contains__) == [(13, chain[3])]
    # Preempted and resumed with new blocks: what the store still lacks is saved again.
    tracked.allocate([20, 21, 22, 23], replace=True)
    assert tracked.to_save(chain[:4], 16, 4, {chain[0], chain[1]}.__contains__) == [
        (22, chain[2]),
        (23, chain[3]),
    ]


def test_a_session_tag_is_an_agentsession_name_or_nothing() -> None:
    assert session_tag("claude-code-1-3f2a9c0d1e2b") == "claude-code-1-3f2a9c0d1e2b"
    for bad in (None, 7, "", "../x", "Upper", "a" * 300, "with space"):
        assert session_tag(bad) is None


def test_sessions_not_live_and_idle_past_the_grace_are_stale(store: BlockStore) -> None:
    now = 10_000.0
    store.write_manifest(Manifest("live", (block_hash(1),), 4, now - 5000))
    store.write_manifest(Manifest("finished", (block_hash(2),), 4, now - 5000))
    store.write_manifest(Manifest("brand-new", (block_hash(3),), 4, now - 10))
    # "brand-new" began after the operator listed the live sessions: within the grace.
    assert store.stale_sessions(["live"], now, grace=300) == ["finished"]
    assert store.stale_sessions(["live"], now, grace=5) == ["brand-new", "finished"]
