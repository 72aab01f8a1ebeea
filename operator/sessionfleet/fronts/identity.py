"""Who a turn belongs to: the session id and parent from the client's headers.

Coding agents name their sessions in different headers (docs/background.md, "Session identity"):

==============  =======================================  ==================================
client          session id                               parent (subagents)
==============  =======================================  ==================================
configured      ``X-Session-Id`` (``--session-header``)  ``X-Parent-Session-Id``
Claude Code     ``x-claude-code-session-id``; a child    ``x-claude-code-parent-agent-id``,
                sends ``x-claude-code-agent-id``         else the root session id
Codex           ``session-id``                           (none)
OpenCode        ``x-session-id``                         ``x-parent-session-id``
==============  =======================================  ==================================

The configured header wins over the clients' own, since an operator who set it means
it. A "final" marker header (``X-Session-Final: true``) says that this turn is the
session's last. The AgentSession's object name is derived from the session id alone
(:func:`session_object_name`), so every router replica computes the same name and a
concurrent create by two replicas collides instead of creating two objects; with client
authentication on, from the client and the id, so clients cannot share a session.

Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from sessionfleet.api import SessionClient
from sessionfleet.resources.names import session_object_name

__all__ = ["Identity", "IdentityError", "HeaderConfig", "identify", "session_object_name"]

CLAUDE_CODE_SESSION: Final = "x-claude-code-session-id"
CLAUDE_CODE_AGENT: Final = "x-claude-code-agent-id"
CLAUDE_CODE_PARENT: Final = "x-claude-code-parent-agent-id"
CODEX_SESSION: Final = "session-id"
OPENCODE_SESSION: Final = "x-session-id"
OPENCODE_PARENT: Final = "x-parent-session-id"

MAX_SESSION_ID: Final = 256
_VALID_ID = re.compile(rf"[\x21-\x7e]{{1,{MAX_SESSION_ID}}}")
_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"", "0", "false", "no", "off"})


class IdentityError(ValueError):
    """A session header that cannot name a session; the message says which and why."""


@dataclass(frozen=True, slots=True)
class HeaderConfig:
    """Which headers name the session, its parent, and the final turn."""

    session_header: str = "X-Session-Id"
    parent_header: str = "X-Parent-Session-Id"
    final_header: str = "X-Session-Final"


@dataclass(frozen=True, slots=True)
class Identity:
    """The session a turn belongs to, as the client named it."""

    session_id: str
    parent_id: str | None
    client: SessionClient
    final: bool
    header: str
    """The header the session id came from, for error messages."""


def _valid(value: str, header: str) -> str:
    if _VALID_ID.fullmatch(value) is None:
        raise IdentityError(
            f"header {header}: a session id is 1 to {MAX_SESSION_ID} printable ASCII "
            "characters without spaces"
        )
    return value


def identify(headers: Mapping[str, str], config: HeaderConfig = HeaderConfig()) -> Identity | None:
    """Return the turn's session identity, None for a request without one.

    ``headers`` must look names up case-insensitively (aiohttp's and multidict's do).
    Raises :class:`IdentityError` for a session or parent id that is not a valid id,
    and for a final marker that is neither true nor false.
    """
    parent: str | None = None
    header = config.session_header
    session = headers.get(header)
    client = SessionClient.HEADER
    if session:
        parent = headers.get(config.parent_header)
        if header.lower() == OPENCODE_SESSION and "opencode" in headers.get("User-Agent", ""):
            client = SessionClient.OPENCODE
    elif agent := headers.get(CLAUDE_CODE_AGENT):
        # A Claude Code subagent: its own id, with its parent agent (or the root
        # session) as parent.
        session, header, client = agent, CLAUDE_CODE_AGENT, SessionClient.CLAUDE_CODE
        parent = headers.get(CLAUDE_CODE_PARENT) or headers.get(CLAUDE_CODE_SESSION)
    elif claude := headers.get(CLAUDE_CODE_SESSION):
        session, header, client = claude, CLAUDE_CODE_SESSION, SessionClient.CLAUDE_CODE
    elif codex := headers.get(CODEX_SESSION):
        session, header, client = codex, CODEX_SESSION, SessionClient.CODEX
    elif opencode := headers.get(OPENCODE_SESSION):
        session, header, client = opencode, OPENCODE_SESSION, SessionClient.OPENCODE
        parent = headers.get(OPENCODE_PARENT)
    else:
        return None
    session_id = _valid(session.strip(), header)
    parent_id = _valid(parent.strip(), "parent session") if parent else None
    if parent_id == session_id:
        parent_id = None  # a session is not its own parent (the API server refuses it)
    return Identity(session_id, parent_id, client, _final(headers, config.final_header), header)


def _final(headers: Mapping[str, str], name: str) -> bool:
    value = headers.get(name)
    if value is None:
        return False
    value = value.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise IdentityError(f"header {name}: expected true or false, not {value[:32]!r}")
