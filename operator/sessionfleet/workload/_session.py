"""One agent session: its turns, its parent, its arrival and the client that runs it.

A session is stored column-wise (one tuple per per-turn figure) rather than as a
list of turn objects: a simulation of 100,000 sessions of 33 turns would otherwise
create millions of small objects. :attr:`Session.turns` gives the row view when
that reads better.
"""

from __future__ import annotations

from dataclasses import dataclass

from sessionfleet.api import SessionClient


@dataclass(frozen=True, slots=True)
class Turn:
    """One model call of a session, as a row.

    ``new_tokens`` is how much the prompt grew since the previous turn's prompt (for
    the first turn, the whole prompt): the previous answer as the agent sends it back
    (reasoning is often dropped, so it may be shorter than ``output_tokens`` of the
    previous turn) and the tool results.
    """

    index: int
    prompt_tokens: int
    new_tokens: int
    output_tokens: int
    pause_after: float
    """Seconds of tool work after this turn before the next one is sent (0 after the last)."""


@dataclass(frozen=True, slots=True)
class Session:
    """One agent session, as a workload generator or a trace file describes it.

    The prompt of turn ``k`` is the prompt of turn ``k - 1`` followed by
    ``new_tokens[k]`` tokens, except at a *compaction* (``k`` in ``compactions``),
    where the agent replaced its history by a summary and the prompt restarts as the
    system prompt followed by ``new_tokens[k]`` tokens.

    ``system_prompt_tokens`` leading tokens of the first prompt are the same for
    every session of the same ``prefix_group`` (the agent harness's system prompt and
    tool definitions); a child session's first ``parent_prefix_tokens`` tokens are
    its parent's prompt at ``spawn_after_turn``.
    """

    session_id: str
    arrival: float
    """Seconds since the start of the workload when the first turn is sent."""
    new_tokens: tuple[int, ...]
    output_tokens: tuple[int, ...]
    pauses: tuple[float, ...]
    """Tool time after each turn, in seconds; the last entry is 0."""
    system_prompt_tokens: int
    client: SessionClient = SessionClient.HEADER
    """Which client convention sends the session id (headers in :func:`session_headers`)."""
    model: str = "agent-model"
    prefix_group: str = ""
    """Sessions with the same group share the first ``system_prompt_tokens`` tokens."""
    parent_id: str | None = None
    spawn_after_turn: int = 0
    """For a child: the parent's turn (1-based) after whose end the child starts."""
    parent_prefix_tokens: int = 0
    """For a child: leading tokens of its first prompt identical to its parent's prompt."""
    compactions: tuple[int, ...] = ()
    """0-based turn indices where the context restarts from the system prompt."""

    def __post_init__(self) -> None:
        turns = len(self.new_tokens)
        if turns == 0:
            raise ValueError(f"session {self.session_id}: no turns")
        if len(self.output_tokens) != turns or len(self.pauses) != turns:
            raise ValueError(
                f"session {self.session_id}: new_tokens, output_tokens and pauses "
                f"must have one entry per turn ({turns})"
            )
        if self.new_tokens[0] < self.system_prompt_tokens:
            raise ValueError(
                f"session {self.session_id}: the first prompt ({self.new_tokens[0]} tokens) "
                f"is shorter than the system prompt ({self.system_prompt_tokens})"
            )
        if self.parent_prefix_tokens > self.new_tokens[0]:
            raise ValueError(
                f"session {self.session_id}: parent_prefix_tokens exceeds the first prompt"
            )
        if self.parent_prefix_tokens and self.parent_id is None:
            raise ValueError(f"session {self.session_id}: parent_prefix_tokens without a parent")
        if any(k <= 0 or k >= turns for k in self.compactions):
            raise ValueError(f"session {self.session_id}: compaction outside turns 2..{turns}")

    @property
    def turn_count(self) -> int:
        """The number of turns (model calls)."""
        return len(self.new_tokens)

    def prompt_tokens(self) -> list[int]:
        """Return the prompt length of every turn."""
        prompts: list[int] = []
        prompt = 0
        compactions = set(self.compactions)
        for k, new in enumerate(self.new_tokens):
            prompt = (self.system_prompt_tokens if k in compactions else prompt) + new
            prompts.append(prompt)
        return prompts

    @property
    def turns(self) -> tuple[Turn, ...]:
        """The turns as rows (built on each access; prefer the columns in hot loops)."""
        return tuple(
            Turn(k, prompt, new, out, pause)
            for k, (prompt, new, out, pause) in enumerate(
                zip(
                    self.prompt_tokens(),
                    self.new_tokens,
                    self.output_tokens,
                    self.pauses,
                    strict=True,
                )
            )
        )

    @property
    def input_tokens(self) -> int:
        """Prompt tokens summed over all turns: what the engine is asked to process."""
        return sum(self.prompt_tokens())

    @property
    def total_output_tokens(self) -> int:
        """Output tokens summed over all turns."""
        return sum(self.output_tokens)


def session_headers(session: Session, *, generic_header: str = "X-Session-Id") -> dict[str, str]:
    """Return the HTTP headers the session's client sends to identify it (docs/background.md).

    Claude Code sends a child's own id as ``x-claude-code-agent-id`` with its parent
    in ``x-claude-code-parent-agent-id``; OpenCode sends ``x-parent-session-id`` for
    subtasks; Codex sends ``session-id`` only; other harnesses use one configurable
    header.
    """
    sid, parent = session.session_id, session.parent_id
    match session.client:
        case SessionClient.CLAUDE_CODE:
            if parent is None:
                return {"x-claude-code-session-id": sid}
            return {"x-claude-code-agent-id": sid, "x-claude-code-parent-agent-id": parent}
        case SessionClient.CODEX:
            return {"session-id": sid}
        case SessionClient.OPENCODE:
            headers = {"x-session-id": sid}
            if parent is not None:
                headers["x-parent-session-id"] = parent
            return headers
        case _:
            return {generic_header: sid}
