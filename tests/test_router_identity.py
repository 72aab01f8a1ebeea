"""Session identity from the clients' headers, and the AgentSession name derived from it."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict

from sessionfleet.api import SessionClient
from sessionfleet.fronts.identity import (
    HeaderConfig,
    Identity,
    IdentityError,
    identify,
    session_object_name,
)

DEFAULT = HeaderConfig()


def ident(headers: dict[str, str], config: HeaderConfig = DEFAULT) -> Identity | None:
    return identify(CIMultiDict(headers), config)


@pytest.mark.parametrize(
    ("headers", "session", "parent", "client"),
    [
        ({"X-Session-Id": "abc"}, "abc", None, SessionClient.HEADER),
        (
            {"x-session-id": "abc", "X-Parent-Session-Id": "root"},
            "abc",
            "root",
            SessionClient.HEADER,
        ),
        (
            {"x-session-id": "abc", "User-Agent": "opencode/0.9"},
            "abc",
            None,
            SessionClient.OPENCODE,
        ),
        ({"x-claude-code-session-id": "cc-root"}, "cc-root", None, SessionClient.CLAUDE_CODE),
        (
            {
                "x-claude-code-session-id": "cc-root",
                "x-claude-code-agent-id": "cc-child",
                "x-claude-code-parent-agent-id": "cc-mid",
            },
            "cc-child",
            "cc-mid",
            SessionClient.CLAUDE_CODE,
        ),
        (
            {"x-claude-code-session-id": "cc-root", "x-claude-code-agent-id": "cc-child"},
            "cc-child",
            "cc-root",
            SessionClient.CLAUDE_CODE,
        ),
        ({"session-id": "codex-1"}, "codex-1", None, SessionClient.CODEX),
        # The configured header wins over a client's own.
        ({"X-Session-Id": "mine", "session-id": "codex-1"}, "mine", None, SessionClient.HEADER),
    ],
)
def test_clients(
    headers: dict[str, str], session: str, parent: str | None, client: SessionClient
) -> None:
    found = ident(headers)
    assert found is not None
    assert (found.session_id, found.parent_id, found.client) == (session, parent, client)
    assert found.final is False


def test_opencode_header_when_another_header_is_configured() -> None:
    config = HeaderConfig(session_header="X-Agent-Session")
    found = ident({"x-session-id": "oc", "x-parent-session-id": "up"}, config)
    assert found is not None
    assert (found.session_id, found.parent_id, found.client) == ("oc", "up", SessionClient.OPENCODE)
    assert ident({"X-Agent-Session": "mine"}, config) == Identity(
        "mine", None, SessionClient.HEADER, False, "X-Agent-Session"
    )


def test_no_session_header_means_stateless() -> None:
    assert ident({"Authorization": "Bearer x"}) is None
    assert ident({"X-Session-Id": ""}) is None


@pytest.mark.parametrize("value", ["true", "1", "YES", " on "])
def test_final_marker(value: str) -> None:
    found = ident({"X-Session-Id": "a", "X-Session-Final": value})
    assert found is not None and found.final


def test_final_marker_false_and_invalid() -> None:
    found = ident({"X-Session-Id": "a", "X-Session-Final": "false"})
    assert found is not None and not found.final
    with pytest.raises(IdentityError, match="X-Session-Final: expected true or false"):
        ident({"X-Session-Id": "a", "X-Session-Final": "maybe"})


@pytest.mark.parametrize("bad", ["has space", "x" * 257, "caf\u00e9"])
def test_invalid_ids_are_refused(bad: str) -> None:
    with pytest.raises(IdentityError, match="printable ASCII"):
        ident({"X-Session-Id": bad})
    with pytest.raises(IdentityError, match="parent session"):
        ident({"X-Session-Id": "ok", "X-Parent-Session-Id": bad})


def test_a_session_is_not_its_own_parent() -> None:
    found = ident({"X-Session-Id": "a", "X-Parent-Session-Id": "a"})
    assert found is not None and found.parent_id is None


DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


@given(
    st.text(
        alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=256
    )
)
def test_names_are_dns_labels(session_id: str) -> None:
    name = session_object_name(session_id)
    assert DNS_LABEL.fullmatch(name) and len(name) <= 63


def test_names_are_stable_readable_and_distinct() -> None:
    assert session_object_name("Sess_42") == session_object_name("Sess_42")
    assert session_object_name("Sess_42").startswith("sess-42-")
    assert session_object_name("Sess_42") != session_object_name("sess-42")
    assert session_object_name("!!!").startswith("session-")
    # A fixed value: every replica, and every version of the router, must agree.
    assert session_object_name("abc") == "abc-ba7816bf8f01"
