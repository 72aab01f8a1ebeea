"""Deterministic object names, so every router replica and the operator agree."""

from __future__ import annotations

import hashlib
import re

_UNSAFE = re.compile(r"[^a-z0-9-]+")


def session_object_name(session_id: str) -> str:
    """Return the AgentSession name for a client's session id.

    A readable, DNS-1123-safe prefix of the id plus 10 hex digits of its SHA-256, so
    ids that differ only in case or punctuation never collide, and every replica
    derives the same name without coordination.
    """
    digest = hashlib.sha256(session_id.encode()).hexdigest()[:10]
    readable = _UNSAFE.sub("-", session_id.lower()).strip("-")[:40].strip("-")
    return f"{readable}-{digest}" if readable else f"s-{digest}"


def label_value(text: str) -> str:
    """Return ``text`` made into a valid label value (63 characters of [A-Za-z0-9._-])."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._")
    if len(cleaned) > 63:
        cleaned = f"{cleaned[:52].rstrip('-._')}-{hashlib.sha256(text.encode()).hexdigest()[:10]}"
    return cleaned
