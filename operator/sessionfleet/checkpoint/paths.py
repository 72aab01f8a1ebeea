"""Checkpoint paths that a client's strings cannot steer out of the checkpoint storage.

Three rules:

- the node agent (root, with the host's filesystem) writes and reads CRIU images only
  strictly inside ``<storage root>/<namespace>/``: :func:`confined_parts` checks a
  requested directory lexically, whole path components against the root and the
  namespace (never string prefixes), and :func:`open_confined` then opens it one
  component at a time, each relative to the descriptor of the one before, with
  ``O_NOFOLLOW``: a symlink anywhere below the root is refused, and one swapped in after
  the check cannot redirect the agent, because nothing is looked up by name again.
  Every later file operation goes through the held descriptor
  (:class:`ConfinedDirectory`);
- a namespace's tree is ``<root>/<namespace>``, decided by the first component below
  the one root: namespace ``llama`` cannot reach ``<root>/prod/llama/…``, however its
  worker's ``storage.path`` is set;
- a session id (any printable ASCII a client sent, ``../x`` included) is never a path
  component as is: :func:`session_directory` names a session's directory with the
  same DNS-safe name as its AgentSession (a readable part and a hash).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from pathlib import Path, PurePosixPath
from types import TracebackType

from sessionfleet.api.worker import CheckpointStorage
from sessionfleet.resources.names import session_object_name

DEFAULT_STORAGE_ROOT = Path(CheckpointStorage().path)
"""The agent's default storage root: a worker's default ``checkpoint.storage.path``."""
MAX_PATH_CHARS = 4096
"""Linux's ``PATH_MAX``: a longer path could not be opened anyway."""
IMAGES_MODE = 0o700
"""A directory the agent creates for images: only root may plant anything in it."""
PARENT_MODE = 0o755
"""A directory on the way: the engine driver's pods create their checkpoints beside."""

# Printable ASCII only, without '%' and '\': nothing on the way decodes a path, so an
# encoded '..' (%2e%2e, ..%5c) would be a literal name; refusing them keeps the path
# the caller sees the path the agent uses.
_SAFE_TEXT = re.compile(r"^[\x20-\x24\x26-\x5b\x5d-\x7e]+$")
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def checked_path(text: object, field: str) -> PurePosixPath:
    """Return ``text`` as an absolute path without ``.`` or ``..``; :class:`ValueError` if not.

    Lexical checks only: :func:`open_confined` then opens the path on the filesystem.
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


def confined_parts(
    text: object, root: Path, namespace: str, field: str = "imagesDir"
) -> tuple[str, ...]:
    """Return the components of ``text`` below ``root``; :class:`ValueError` unless confined.

    ``text`` must lie strictly inside ``<root>/<namespace>/``, compared component by
    component (``/root-evil`` is not inside ``/root``, ``<root>/prod/llama`` is not
    inside namespace ``llama``'s tree). ``root`` may be written as configured or as its
    real path (the root itself is the administrator's, and is followed when opened).
    Pure but for ``realpath`` of the root.
    """
    path = checked_path(text, field)
    if not namespace or "/" in namespace or namespace in (".", ".."):
        raise ValueError(f"namespace {namespace!r} is not a namespace's name")
    parts: tuple[str, ...] | None = None
    for base in (PurePosixPath(root), PurePosixPath(os.path.realpath(root))):
        if path.is_relative_to(base):
            parts = path.relative_to(base).parts
            break
    tree = f"{root}/{namespace}"
    if parts is None or len(parts) < 2 or parts[0] != namespace:
        raise ValueError(
            f"{field} {path} is not inside {tree}/, namespace {namespace}'s tree in the "
            "agent's storage root: keep the worker's checkpoint storage.path at the agent's "
            "--storage-root"
        )
    return parts


class ConfinedDirectory:
    """A directory inside the storage root, held open: every operation is relative to it.

    :attr:`path` is where it was asked for (for messages and answers); :attr:`handle` is
    a path through the descriptor itself (``/proc/<agent pid>/fd/<n>``), for the
    ``criu`` command, which takes a directory by name: a renamed or swapped component
    on the way cannot redirect it, since the kernel resolves the descriptor, not the
    names. The agent's own files in it (CRIU's log and PID file, the metadata) are
    reached the same way, each opened with ``O_NOFOLLOW`` or created with ``O_EXCL``.
    """

    def __init__(self, fd: int, path: Path) -> None:
        self.fd = fd
        self.path = path

    @property
    def handle(self) -> Path:
        """Return a path that names this directory through its descriptor."""
        return Path(f"/proc/{os.getpid()}/fd/{self.fd}")

    def close(self) -> None:
        """Close the descriptor."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> ConfinedDirectory:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()


def open_confined(
    text: object, root: Path, namespace: str, *, create: bool, field: str = "imagesDir"
) -> ConfinedDirectory:
    """Open ``text`` inside ``<root>/<namespace>/`` without following any link below the root.

    Each component is opened relative to the one before with ``O_DIRECTORY |
    O_NOFOLLOW``; with ``create``, a missing one is made (``mkdir`` does not follow a
    link either; the last one only root may write to). :class:`ValueError` when the
    path is not confined or a component is a link or not a directory;
    :class:`LookupError` when it does not exist and ``create`` is off. Blocking: run it
    in a thread.
    """
    parts = confined_parts(text, root, namespace, field)
    path = Path(str(text))  # as asked, now checked: what messages and answers name
    current = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for index, part in enumerate(parts):
            last = index == len(parts) - 1
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, IMAGES_MODE if last else PARENT_MODE, dir_fd=current)
            try:
                following = os.open(part, _DIRECTORY_FLAGS, dir_fd=current)
            except FileNotFoundError:
                raise LookupError(f"{field} {path} does not exist") from None
            except OSError as error:
                if error.errno in (errno.ELOOP, errno.ENOTDIR):
                    at = Path(str(root), *parts[: index + 1])
                    raise ValueError(
                        f"{field} {path}: {at} is a symbolic link or not a directory; the "
                        "agent follows no link below its storage root"
                    ) from None
                raise
            os.close(current)
            current = following
    except BaseException:
        os.close(current)
        raise
    return ConfinedDirectory(current, path)


def session_directory(location: str, session_id: str) -> str:
    """Return the directory of one session's state inside a checkpoint's ``location``."""
    return f"{location.rstrip('/')}/{session_object_name(session_id)}"


__all__ = [
    "DEFAULT_STORAGE_ROOT",
    "MAX_PATH_CHARS",
    "ConfinedDirectory",
    "checked_path",
    "confined_parts",
    "open_confined",
    "session_directory",
]
