"""Checkpoint paths that a client's strings cannot steer out of the checkpoint storage.

Two rules, one per side:

- the node agent (root, with the host's filesystem) writes and reads CRIU images only
  strictly inside its storage root: :func:`confine` resolves a requested directory,
  following every symlink that exists, and refuses it unless the real path lies below
  the root's real path;
- a session id (any printable ASCII a client sent, ``../x`` included) is never a path
  component as is: :func:`session_directory` names a session's directory with the
  same DNS-safe name as its AgentSession (a readable part and a hash).
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath

from sessionfleet.api.worker import CheckpointStorage
from sessionfleet.resources.names import session_object_name

DEFAULT_STORAGE_ROOT = Path(CheckpointStorage().path)
"""The agent's default storage root: a worker's default ``checkpoint.storage.path``."""
MAX_PATH_CHARS = 4096
"""Linux's ``PATH_MAX``: a longer path could not be opened anyway."""

# Printable ASCII only, without '%' and '\': nothing on the way decodes a path, so an
# encoded '..' (%2e%2e, ..%5c) would be a literal name; refusing them keeps the path
# the caller sees the path the agent uses.
_SAFE_TEXT = re.compile(r"^[\x20-\x24\x26-\x5b\x5d-\x7e]+$")


def checked_path(text: object, field: str) -> PurePosixPath:
    """Return ``text`` as an absolute path without ``.`` or ``..``; :class:`ValueError` if not.

    Lexical checks only: :func:`confine` then resolves the path on the filesystem.
    """
    if not isinstance(text, str) or not text.startswith("/"):
        raise ValueError(f"{field} must be an absolute path (a string starting with '/')")
    if len(text) > MAX_PATH_CHARS:
        raise ValueError(f"{field} is longer than {MAX_PATH_CHARS} characters")
    if not _SAFE_TEXT.fullmatch(text):
        raise ValueError(
            f"{field} may hold only printable ASCII characters other than '%' and '\\'"
        )
    if any(part in (".", "..") for part in text.split("/")):
        raise ValueError(f"{field} must be an absolute path without '.' or '..' components")
    return PurePosixPath(text)


def confine(text: object, root: Path, field: str = "imagesDir") -> Path:
    """Return the real path of ``text`` when it lies strictly inside ``root``.

    Every symlink that exists on the way is followed (of the path and of the root), so
    a link inside the root that points out of it is refused; the parts that do not
    exist yet are taken as written, and they hold no ``..``. The caller must use the
    returned path, not ``text``: only that one was checked. Blocking (it reads the
    filesystem): run it in a thread.
    """
    path = checked_path(text, field)
    real_root = Path(os.path.realpath(root))
    real = Path(os.path.realpath(path))
    if real == real_root or not real.is_relative_to(real_root):
        resolved = "" if str(real) == str(path) else f" (it resolves to {real})"
        raise ValueError(
            f"{field} {path}{resolved} is not inside the agent's storage root {root}: "
            "put the worker's checkpoint storage under it, or start the agent with "
            "--storage-root"
        )
    return real


def session_directory(location: str, session_id: str) -> str:
    """Return the directory of one session's state inside a checkpoint's ``location``."""
    return f"{location.rstrip('/')}/{session_object_name(session_id)}"


__all__ = [
    "DEFAULT_STORAGE_ROOT",
    "MAX_PATH_CHARS",
    "checked_path",
    "confine",
    "session_directory",
]
