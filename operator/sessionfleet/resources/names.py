"""Deterministic object names, so every router replica and the operator agree."""

from __future__ import annotations

import hashlib
import re
from functools import lru_cache
from typing import Final

_UNSAFE = re.compile(r"[^a-z0-9-]+")


_NOT_NAME = re.compile(r"[^a-z0-9]+")
_READABLE_CHARS: Final = 40
_HASH_CHARS: Final = 12


@lru_cache(maxsize=65536)
def session_object_name(session_id: str, owner: str | None = None) -> str:
    """Return the AgentSession name for a session id: a DNS-1123 label, same on every replica.

    A readable part (the id lowercased, runs of other characters turned into ``-``,
    at most 40 characters) and 12 hex digits of a SHA-256, so that ids that differ only
    in case or punctuation still get different names: ``Sess_42`` becomes
    ``sess-42-<hash>``. At most 53 characters. With an ``owner`` (the authenticated
    client) the hash covers the owner too, so two clients that send the same id get
    two sessions.
    """
    key = session_id if owner is None else f"{owner}\x00{session_id}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:_HASH_CHARS]
    readable = _NOT_NAME.sub("-", session_id.lower()).strip("-")[:_READABLE_CHARS].strip("-")
    return f"{readable}-{digest}" if readable else f"session-{digest}"


def label_value(text: str) -> str:
    """Return ``text`` made into a valid label value (63 characters of [A-Za-z0-9._-])."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._")
    if len(cleaned) > 63:
        cleaned = f"{cleaned[:52].rstrip('-._')}-{hashlib.sha256(text.encode()).hexdigest()[:10]}"
    return cleaned
