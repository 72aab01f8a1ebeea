"""KV blocks and session manifests as files on shared storage.

Layout under the store's root (a worker's ``checkpoint.storage``, one directory per
namespace and model)::

    <root>/<layout>/blocks/<hh>/<block hash>.kv    one KV block, every layer
    <root>/<layout>/sessions/<session>.json       the block chain of a session's last turn

``<layout>`` is the first 16 hex digits of :func:`layout_fingerprint`: the model, the
KV cache's dtype and per-block shape of every layer, the block size and vLLM's hash
settings. Engines of one model with the same settings share a directory; anything else
never reads it. A block's name is vLLM's chained block hash, which depends on every
token before it, so a file holds exactly the KV of one prefix block and any saved
prefix of any request hits.

Every file is written to a temporary name and renamed into place, so a reader sees a
whole file or none, and two engines writing the same block at once leave one whole
copy. A block file carries its layout's whole fingerprint, its own hash and a CRC-32 of
its payload; a file that is short, long, corrupt, foreign or misnamed reads as a miss
(and is removed), never as KV. Nothing is fsynced: a crash that leaves a renamed file
with lost pages leaves a checksum that no longer matches, which is a miss.

Errors of the storage itself (full, read-only, gone) raise :class:`StoreError` from
writes; reads treat them as misses. The caller degrades to recomputation.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import struct
import time
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

MAGIC: Final = b"SFKV\x01"
"""The first bytes of every block file (the format's version is the last one)."""
_HEADER_SIZE: Final = struct.Struct("<I")
MAX_HEADER_BYTES: Final = 1 << 20
"""A header longer than this is not one of ours: a miss without parsing it."""
BLOCK_SUFFIX: Final = ".kv"
_TEMP_PREFIX: Final = ".tmp-"
_HASH = re.compile(r"^[0-9a-f]{8,128}$")
#: An AgentSession's name: a DNS subdomain, which is also a safe file name.
_SESSION = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
EVICT_TO: Final = 0.9
"""Eviction frees space down to this fraction of the cap, so it does not run per write."""


class StoreError(OSError):
    """The storage refused a write (full, read-only, missing); the message says which."""


def layout_fingerprint(description: Mapping[str, Any]) -> str:
    """Return the hex SHA-256 of a layout description (model, dtype, shapes, hashing)."""
    canonical = json.dumps(description, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def valid_block_hash(text: str) -> bool:
    """Whether ``text`` is a block hash as the store names files (lower-case hex)."""
    return bool(_HASH.fullmatch(text))


def valid_session(text: str) -> bool:
    """Whether ``text`` is a session name the store accepts (an AgentSession's name)."""
    return bool(_SESSION.fullmatch(text))


@dataclass(frozen=True, slots=True)
class Manifest:
    """The blocks of one session's latest turn, in prefix order."""

    session: str
    blocks: tuple[str, ...]
    tokens: int
    """Tokens of the request the chain was taken from (its last block may be partial)."""
    updated: float

    def wire(self) -> dict[str, Any]:
        """Return the JSON form written to the session's file."""
        return {
            "session": self.session,
            "blocks": list(self.blocks),
            "tokens": self.tokens,
            "updated": self.updated,
        }


@dataclass(frozen=True, slots=True)
class SessionReport:
    """What the store holds for one session: the restorable prefix of its last turn."""

    blocks: int
    """Consecutive blocks of the chain present from its start."""
    tokens: int
    bytes: int
    chain: int
    """Blocks in the session's manifest (``blocks`` of them are there)."""


def _write_atomically(path: Path, chunks: Iterable[bytes | memoryview]) -> int:
    """Write ``chunks`` to a temporary file beside ``path``, then rename it into place."""
    temp = path.with_name(f"{_TEMP_PREFIX}{path.name}-{os.getpid()}-{secrets.token_hex(4)}")
    size = 0
    try:
        with open(temp, "wb") as out:
            for chunk in chunks:
                out.write(chunk)
                size += len(chunk)
        os.replace(temp, path)
    except OSError as error:
        try:
            temp.unlink()
        except OSError:
            pass
        raise StoreError(error.errno, f"{path.parent}: {error.strerror or error}") from error
    return size


class BlockStore:
    """One layout's blocks and manifests under a root directory.

    Thread-compatible, not thread-safe: each process keeps one per thread that uses it
    (files are the only shared state, and every change to them is a rename or unlink).
    """

    def __init__(self, root: Path, fingerprint: str, block_tokens: int) -> None:
        self.root = root
        self.fingerprint = fingerprint
        self.block_tokens = block_tokens
        self.directory = root / fingerprint[:16]
        self.blocks_dir = self.directory / "blocks"
        self.sessions_dir = self.directory / "sessions"

    # --- blocks ---------------------------------------------------------------------

    def block_path(self, block_hash: str) -> Path:
        """Return the file of one block (``ValueError`` for a name that is not a hash)."""
        if not valid_block_hash(block_hash):
            raise ValueError(f"not a block hash: {block_hash[:80]!r}")
        return self.blocks_dir / block_hash[:2] / f"{block_hash}{BLOCK_SUFFIX}"

    def has(self, block_hash: str) -> bool:
        """Whether a file for the block exists (its content is checked only when read)."""
        try:
            return self.block_path(block_hash).is_file()
        except (OSError, ValueError):
            return False

    def prefix_hits(self, chain: Sequence[str]) -> int:
        """How many blocks of ``chain``, from its start, the store holds in a row."""
        count = 0
        for block_hash in chain:
            if not self.has(block_hash):
                break
            count += 1
        return count

    def write_block(self, block_hash: str, layers: Sequence[tuple[str, bytes | memoryview]]) -> int:
        """Write one block (every layer's bytes, in order); return the file's size.

        A block already stored is not written again (same hash, same prefix, same KV).

        Raises:
            StoreError: the storage refused the write.

        """
        path = self.block_path(block_hash)
        if path.is_file():
            return 0
        crc = 0
        for _, data in layers:
            crc = zlib.crc32(data, crc)
        header = json.dumps(
            {
                "layout": self.fingerprint,
                "block": block_hash,
                "tokens": self.block_tokens,
                "layers": [[name, len(data)] for name, data in layers],
                "crc32": crc,
            },
            separators=(",", ":"),
        ).encode()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise StoreError(error.errno, f"{path.parent}: {error.strerror}") from error
        return _write_atomically(
            path,
            [MAGIC, _HEADER_SIZE.pack(len(header)), header, *(data for _, data in layers)],
        )

    def read_block(self, block_hash: str, layers: Sequence[tuple[str, int]]) -> list[bytes] | None:
        """Return the block's layers' bytes, or None for a miss.

        ``layers`` is what the reader expects, (name, bytes) per layer in order. A file
        that does not match it exactly, or whose checksum, layout or hash differs, is
        removed and read as a miss, so the block is computed and saved again.
        """
        try:
            path = self.block_path(block_hash)
            data = path.read_bytes()
        except (OSError, ValueError):
            return None
        payload = self._verified(data, block_hash, layers)
        if payload is None:
            self._discard(path)
            return None
        try:
            os.utime(path)  # the eviction's "recently used"
        except OSError:
            pass
        return payload

    def _verified(
        self, data: bytes, block_hash: str, layers: Sequence[tuple[str, int]]
    ) -> list[bytes] | None:
        start = len(MAGIC) + _HEADER_SIZE.size
        if len(data) < start or not data.startswith(MAGIC):
            return None
        (header_size,) = _HEADER_SIZE.unpack_from(data, len(MAGIC))
        if header_size > MAX_HEADER_BYTES or start + header_size > len(data):
            return None
        try:
            header = json.loads(data[start : start + header_size])
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(header, dict):
            return None
        expected = [[name, size] for name, size in layers]
        if (
            header.get("layout") != self.fingerprint
            or header.get("block") != block_hash
            or header.get("layers") != expected
        ):
            return None
        offset = start + header_size
        if len(data) != offset + sum(size for _, size in layers):
            return None
        view = memoryview(data)
        if zlib.crc32(view[offset:]) != header.get("crc32"):
            return None
        payload = []
        for _, size in layers:
            payload.append(bytes(view[offset : offset + size]))
            offset += size
        return payload

    @staticmethod
    def _discard(path: Path) -> None:
        try:
            path.unlink()
        except OSError:
            pass

    def block_size_on_disk(self, block_hash: str) -> int:
        """Return the block file's size in bytes, 0 when absent."""
        try:
            return self.block_path(block_hash).stat().st_size
        except (OSError, ValueError):
            return 0

    # --- sessions -------------------------------------------------------------------

    def _manifest_path(self, session: str) -> Path:
        if not valid_session(session):
            raise ValueError(f"not a session name: {session[:80]!r}")
        return self.sessions_dir / f"{session}.json"

    def write_manifest(self, manifest: Manifest) -> None:
        """Record a session's block chain (its latest turn replaces the previous one).

        Raises:
            StoreError: the storage refused the write.

        """
        path = self._manifest_path(manifest.session)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise StoreError(error.errno, f"{path.parent}: {error.strerror}") from error
        _write_atomically(path, [json.dumps(manifest.wire(), separators=(",", ":")).encode()])

    def read_manifest(self, session: str) -> Manifest | None:
        """Return a session's manifest, or None when absent or unreadable."""
        try:
            raw = json.loads(self._manifest_path(session).read_bytes())
            blocks = tuple(str(b) for b in raw["blocks"])
            if raw["session"] != session or not all(valid_block_hash(b) for b in blocks):
                return None
            return Manifest(session, blocks, int(raw["tokens"]), float(raw["updated"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def sessions(self) -> list[str]:
        """Return the sessions with a manifest."""
        try:
            names = os.listdir(self.sessions_dir)
        except OSError:
            return []
        return sorted(
            n[: -len(".json")] for n in names if n.endswith(".json") and valid_session(n[:-5])
        )

    def report(self, session: str) -> SessionReport:
        """Report what a new engine would load for the session's next turn."""
        manifest = self.read_manifest(session)
        if manifest is None:
            return SessionReport(0, 0, 0, 0)
        present = self.prefix_hits(manifest.blocks)
        size = sum(self.block_size_on_disk(b) for b in manifest.blocks[:present])
        tokens = min(present * self.block_tokens, manifest.tokens)
        return SessionReport(present, tokens, size, len(manifest.blocks))

    def forget(self, sessions: Iterable[str]) -> tuple[int, int]:
        """Remove finished sessions' manifests and the blocks no other session uses.

        A block in a remaining session's chain (a shared system prompt, a parent's
        context) stays. Blocks of no session (requests without one) are left to
        eviction. Returns (blocks removed, bytes freed).
        """
        gone = {s for s in sessions if valid_session(s)}
        doomed: set[str] = set()
        for session in gone:
            manifest = self.read_manifest(session)
            if manifest is not None:
                doomed.update(manifest.blocks)
            try:
                self._manifest_path(session).unlink()
            except OSError:
                pass
        if not doomed:
            return 0, 0
        for session in self.sessions():
            if session not in gone:
                kept = self.read_manifest(session)
                if kept is not None:
                    doomed.difference_update(kept.blocks)
        return _remove(self.block_path(block_hash) for block_hash in doomed)

    def stale_sessions(self, live: Iterable[str], now: float, grace: float) -> list[str]:
        """Sessions with a manifest that are not ``live`` and had no turn for ``grace`` s.

        ``live`` is what the operator knew when it asked; a session newer than that
        (its manifest written since, within the grace) is not stale.
        """
        keep = set(live)
        stale = []
        for session in self.sessions():
            if session in keep:
                continue
            manifest = self.read_manifest(session)
            if manifest is None or now - manifest.updated > grace:
                stale.append(session)
        return stale

    # --- size -----------------------------------------------------------------------

    def _block_files(self) -> list[tuple[float, int, Path]]:
        found = []
        try:
            shards = list(os.scandir(self.blocks_dir))
        except OSError:
            return []
        for shard in shards:
            try:
                entries = list(os.scandir(shard.path))
            except OSError:
                continue
            for entry in entries:
                if not entry.name.endswith(BLOCK_SUFFIX):
                    continue
                try:
                    stat = entry.stat()
                except OSError:
                    continue
                found.append((stat.st_mtime, stat.st_size, Path(entry.path)))
        return found

    def usage(self) -> tuple[int, int]:
        """(block files, bytes) in this layout's directory."""
        files = self._block_files()
        return len(files), sum(size for _, size, _ in files)

    def evict(self, max_bytes: int) -> tuple[int, int]:
        """Remove the least recently used blocks until at most ``EVICT_TO`` of the cap is used.

        Returns (blocks removed, bytes freed); nothing when the store is under its cap.
        A read refreshes a block's time, so the prefixes sessions come back to stay.
        """
        files = self._block_files()
        total = sum(size for _, size, _ in files)
        if max_bytes <= 0 or total <= max_bytes:
            return 0, 0
        target = int(max_bytes * EVICT_TO)
        victims = []
        for _, size, path in sorted(files):
            if total <= target:
                break
            victims.append(path)
            total -= size
        return _remove(victims)

    def sweep_temporaries(self, older_than: float = 600.0) -> int:
        """Remove temporary files a killed writer left behind; return how many."""
        now = time.time()
        removed = 0
        for directory in [str(self.sessions_dir), *self._shards()]:
            try:
                entries = list(os.scandir(directory))
            except OSError:
                continue
            for entry in entries:
                try:
                    if entry.name.startswith(_TEMP_PREFIX) and (
                        now - entry.stat().st_mtime > older_than
                    ):
                        os.unlink(entry.path)
                        removed += 1
                except OSError:
                    continue
        return removed

    def _shards(self) -> list[str]:
        try:
            return [e.path for e in os.scandir(self.blocks_dir) if e.is_dir()]
        except OSError:
            return []

    def probe(self) -> str | None:
        """Whether the store can be written now: None, or why not (full, read-only…)."""
        try:
            self.blocks_dir.mkdir(parents=True, exist_ok=True)
            _write_atomically(self.blocks_dir / "probe", [b"ok"])
        except OSError as error:
            return describe(error)
        return None


def _remove(paths: Iterable[Path]) -> tuple[int, int]:
    """Delete the files that are still there; return (files removed, bytes freed)."""
    removed = freed = 0
    for path in paths:
        try:
            size = path.stat().st_size
            path.unlink()
        except OSError:
            continue
        removed += 1
        freed += size
    return removed, freed


def describe(error: OSError) -> str:
    """Return a short reason for a storage error, as a worker condition shows it."""
    names = {
        errno.ENOSPC: "StorageFull",
        errno.EDQUOT: "StorageFull",
        errno.EROFS: "StorageReadOnly",
        errno.EACCES: "StorageNotWritable",
        errno.EPERM: "StorageNotWritable",
    }
    name = names.get(error.errno or 0, "StorageError")
    return f"{name}: {error.strerror or error}"
