"""The simulated engine's block-level prefix cache, modelled on vLLM V1's.

Blocks are identified by chained hashes (:mod:`.tokenizer`); a prompt hits the longest
run of its leading blocks that are cached. Like vLLM:

* a block used by a running request is *referenced* and cannot be evicted; a cached
  block nobody references sits in a free queue in least-recently-used order and is
  evicted from the front when room is needed;
* when a request ends its blocks return to the free queue tail-first, so a prefix's
  first blocks (shared by every later turn) are evicted last;
* at most ``num_tokens - 1`` prompt tokens are served from cache: the engine must
  compute the last prompt token to produce logits;
* the prefix cache metrics count tokens: queries are prompt tokens looked up, hits
  are prompt tokens found.

``kv_usage`` follows vLLM's ``kv_cache_usage_perc``: blocks in use by running
requests over all blocks, so cached blocks that nobody references count as free.

State can be exported to a directory and imported from one (:class:`CacheSnapshot`),
the whole cache or the blocks of one session; this is what the engine checkpoint
driver uses. Pure: the file I/O is in :func:`write_snapshot` / :func:`read_snapshot`,
which the server runs in a thread.
"""

from __future__ import annotations

import json
import os
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from pathlib import Path
from typing import Any, Final

from sessionfleet.simengine.tokenizer import HASH_BYTES

SNAPSHOT_FORMAT: Final = "sessionfleet-sim-cache/v1"
MANIFEST_FILE: Final = "manifest.json"
BLOCKS_FILE: Final = "blocks.bin"


class SnapshotError(ValueError):
    """A cache snapshot cannot be written or read, or does not fit this engine."""


@dataclass(frozen=True, slots=True)
class Lookup:
    """The outcome of looking a prompt up in the cache."""

    hit_blocks: int
    hit_tokens: int
    query_tokens: int


@dataclass(slots=True)
class SessionRecord:
    """The block chain of a session's latest request (prompt and generated text)."""

    hashes: list[bytes]
    tokens: int


class PrefixCache:
    """A capacity-bounded cache of hashed KV blocks with LRU eviction."""

    def __init__(self, capacity_tokens: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        if capacity_tokens < block_size:
            raise ValueError("capacity_tokens must hold at least one block")
        self.block_size = block_size
        self.num_blocks = capacity_tokens // block_size
        self._cached: set[bytes] = set()
        self._free: OrderedDict[bytes, None] = OrderedDict()
        self._refs: Counter[bytes] = Counter()
        self._private_blocks = 0
        self.queries_tokens = 0
        self.hits_tokens = 0
        self.evicted_blocks = 0

    # --- observation ----------------------------------------------------------------

    @property
    def cached_blocks(self) -> int:
        """Blocks held in the cache, referenced or free."""
        return len(self._cached)

    @property
    def kv_usage(self) -> float:
        """Blocks in use by running requests over all blocks, 0-1 (vLLM's definition)."""
        used = len(self._refs) + self._private_blocks
        return min(1.0, used / self.num_blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._cached

    def lru_order(self) -> list[bytes]:
        """Every cached block, least recently used first; referenced blocks last."""
        return list(self._free) + [h for h in self._refs if h in self._cached]

    # --- requests -------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes], prompt_tokens: int) -> Lookup:
        """Count the leading cached blocks of a prompt and record the query in the metrics.

        Only blocks wholly within the first ``prompt_tokens - 1`` tokens may hit.
        """
        limit = min(len(hashes), max(0, prompt_tokens - 1) // self.block_size)
        hit = 0
        while hit < limit and hashes[hit] in self._cached:
            hit += 1
        tokens = hit * self.block_size
        self.queries_tokens += prompt_tokens
        self.hits_tokens += tokens
        return Lookup(hit, tokens, prompt_tokens)

    def acquire(self, hashes: Sequence[bytes], private_blocks: int = 0) -> list[bytes]:
        """Take references on a running request's blocks, caching the ones not cached yet.

        Returns the hashes actually referenced (a prefix of ``hashes``: when the cache
        is full of referenced blocks, the rest are computed but not cached, as a real
        engine would have to preempt). ``private_blocks`` counts the request's blocks
        that are not shareable (its partial tail and generated tokens) towards usage.
        """
        # A 180K-token prompt is 11K blocks: the work is done with C-level bulk
        # operations (map, comprehensions, Counter.update) rather than a Python loop.
        cached, free = self._cached, self._free
        deque(map(free.pop, hashes, repeat(None)), maxlen=0)
        missing = [h for h in hashes if h not in cached]
        room = self.num_blocks - len(cached) + len(free)
        held: Sequence[bytes] = hashes
        if len(missing) > room:
            # Not all of it fits: keep the prefix up to the first block that does not.
            cut = missing[room]
            held = hashes[: hashes.index(cut)]
            missing = missing[:room]
        overflow = len(cached) + len(missing) - self.num_blocks
        for _ in range(max(0, overflow)):
            victim, _ = free.popitem(last=False)
            cached.discard(victim)
            self.evicted_blocks += 1
        cached.update(missing)
        self._refs.update(held)
        self._private_blocks += private_blocks
        return list(held)

    def release(self, held: Sequence[bytes], private_blocks: int = 0) -> None:
        """Drop a finished request's references, tail first into the free queue."""
        self._private_blocks = max(0, self._private_blocks - private_blocks)
        refs, cached, free = self._refs, self._cached, self._free
        for block_hash in reversed(held):
            count = refs[block_hash] - 1
            if count > 0:
                refs[block_hash] = count
                continue
            refs.pop(block_hash, None)  # dict.pop: Counter's own __delitem__ is Python code
            if block_hash in cached:
                free[block_hash] = None

    def insert(self, hashes: Iterable[bytes]) -> int:
        """Cache blocks nobody references (an import), each as the most recent; return how many.

        Blocks already cached are only moved to the recent end. Stops when the cache
        is full of referenced blocks.
        """
        added = 0
        for block_hash in hashes:
            if block_hash in self._cached:
                if block_hash in self._free:
                    self._free.move_to_end(block_hash)
                continue
            if not self._make_room():
                break
            self._cached.add(block_hash)
            self._free[block_hash] = None
            added += 1
        return added

    def clear(self) -> int:
        """Drop every block nobody references (vLLM's reset_prefix_cache); return how many."""
        dropped = len(self._free)
        for block_hash in self._free:
            self._cached.discard(block_hash)
        self._free.clear()
        return dropped

    def _make_room(self) -> bool:
        """Evict free blocks until one more block fits; False when none can be evicted."""
        # Private blocks (partial tails, generated tokens) count towards usage but not
        # here: the simulator does not preempt, so they never stop a block from caching.
        while len(self._cached) >= self.num_blocks:
            if not self._free:
                return False
            victim, _ = self._free.popitem(last=False)
            self._cached.discard(victim)
            self.evicted_blocks += 1
        return True


# --- snapshots --------------------------------------------------------------------------


@dataclass(slots=True)
class CacheSnapshot:
    """Cache state to write to or read from a directory.

    ``blocks`` are in least-recently-used-first order, so importing them one after the
    other rebuilds the same eviction order. ``sessions`` maps a session id to the block
    chain of its latest request.
    """

    model: str
    block_size: int
    blocks: list[bytes]
    sessions: dict[str, SessionRecord] = field(default_factory=dict)

    def manifest(self) -> dict[str, Any]:
        """Return the JSON manifest that describes the snapshot."""
        return {
            "format": SNAPSHOT_FORMAT,
            "model": self.model,
            "blockSize": self.block_size,
            "hash": f"blake2b-{HASH_BYTES * 8}",
            "blocks": len(self.blocks),
            "tokens": len(self.blocks) * self.block_size,
            "sessions": {
                session_id: {
                    "tokens": record.tokens,
                    "chain": [h.hex() for h in record.hashes],
                }
                for session_id, record in sorted(self.sessions.items())
            },
        }


def write_snapshot(snapshot: CacheSnapshot, directory: Path) -> dict[str, Any]:
    """Write ``snapshot`` to ``directory`` (created if needed); return its manifest.

    The blocks file is written first and the manifest last, each through a temporary
    file and a rename, so a reader never sees a manifest without its blocks.
    """
    directory.mkdir(parents=True, exist_ok=True)
    blocks_tmp = directory / f".{BLOCKS_FILE}.tmp"
    blocks_tmp.write_bytes(b"".join(snapshot.blocks))
    os.replace(blocks_tmp, directory / BLOCKS_FILE)
    manifest = snapshot.manifest()
    manifest_tmp = directory / f".{MANIFEST_FILE}.tmp"
    manifest_tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(manifest_tmp, directory / MANIFEST_FILE)
    return manifest


def read_snapshot(directory: Path) -> CacheSnapshot:
    """Read a snapshot written by :func:`write_snapshot`; raise :class:`SnapshotError`."""
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text())
        raw = (directory / BLOCKS_FILE).read_bytes()
    except FileNotFoundError as error:
        raise SnapshotError(f"{directory} holds no cache snapshot: {error.filename}") from error
    except (OSError, ValueError) as error:
        raise SnapshotError(f"cannot read the cache snapshot in {directory}: {error}") from error
    if not isinstance(manifest, dict) or manifest.get("format") != SNAPSHOT_FORMAT:
        raise SnapshotError(f"{directory}: not a {SNAPSHOT_FORMAT} snapshot")
    if len(raw) % HASH_BYTES or len(raw) // HASH_BYTES != manifest.get("blocks"):
        raise SnapshotError(f"{directory}: {BLOCKS_FILE} does not match the manifest")
    blocks = [raw[i : i + HASH_BYTES] for i in range(0, len(raw), HASH_BYTES)]
    sessions: dict[str, SessionRecord] = {}
    try:
        for session_id, entry in manifest.get("sessions", {}).items():
            chain = [bytes.fromhex(h) for h in entry["chain"]]
            sessions[str(session_id)] = SessionRecord(chain, int(entry["tokens"]))
        return CacheSnapshot(str(manifest["model"]), int(manifest["blockSize"]), blocks, sessions)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise SnapshotError(f"{directory}: malformed manifest: {error}") from error
