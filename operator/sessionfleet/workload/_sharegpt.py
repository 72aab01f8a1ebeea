"""Load agent sessions from a ShareGPT-style trace file.

The format is that of ``Inferact/codex_swebenchpro_traces``: one row per trial, each
with ``conversations: [{"from": "human" | "gpt", "value": "..."}]`` (a ``system``
or ``tool`` entry is read too). Every ``gpt`` message is one model call; its prompt
is everything before it. The assistant text in that set is length-preserving
filler, and the traces carry no timestamps, so:

- tokens are counted with :func:`~sessionfleet.workload.count_tokens` (four
  characters per token);
- tool pauses and arrivals are drawn from the synthetic workload's distributions,
  seeded;
- the shared system prompt is a ``system`` message when the rows have one, and
  otherwise the longest leading text that the first messages of all rows share.

The file is a JSON array of rows or JSON Lines (one row per line).
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sessionfleet.api import SessionClient
from sessionfleet.workload._session import Session
from sessionfleet.workload._synthetic import lognormal_sigma
from sessionfleet.workload._tokens import CHARS_PER_TOKEN, count_tokens

ASSISTANT_ROLES = frozenset({"gpt", "assistant", "model"})
KNOWN_ROLES = ASSISTANT_ROLES | {"human", "user", "system", "tool", "function", "observation"}


class TraceFormatError(ValueError):
    """The trace file is not in the ShareGPT format; the message says where."""


def read_rows(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read the rows of a ShareGPT trace file (a JSON array or JSON Lines)."""
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            rows = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"{path}: not valid JSON: {exc}") from exc
    else:
        rows = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise TraceFormatError(f"{path}:{number}: not valid JSON: {exc}") from exc
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise TraceFormatError(f"{path}: expected a list of objects, one per trial")
    return rows


def sessions_from_rows(
    rows: Sequence[Mapping[str, Any]],
    *,
    seed: int = 0,
    arrival_rate: float = 0.5,
    pause_median: float = 5.2,
    pause_p99: float = 81.4,
    client: SessionClient = SessionClient.CODEX,
    model: str = "agent-model",
) -> list[Session]:
    """Turn ShareGPT rows into sessions, one per row with at least one assistant message."""
    conversations = [_conversation(row, number) for number, row in enumerate(rows)]
    system = _shared_system_tokens(conversations)
    rng = random.Random(seed)
    pause_mu, pause_sigma = math.log(pause_median), lognormal_sigma(pause_median, pause_p99)
    sessions: list[Session] = []
    clock = 0.0
    for number, (row, messages) in enumerate(zip(rows, conversations, strict=True)):
        new_tokens: list[int] = []
        output_tokens: list[int] = []
        pending = 0
        for role, text in messages:
            tokens = count_tokens(text)
            if role in ASSISTANT_ROLES:
                if pending == 0 and not new_tokens:
                    continue  # an assistant message before any prompt is not a model call
                new_tokens.append(max(pending, 1))
                output_tokens.append(tokens)
                # The answer goes back into the next prompt with the tool results.
                pending = tokens
            else:
                pending += tokens
        if not new_tokens:
            continue
        clock += rng.expovariate(arrival_rate)
        pauses = [math.exp(pause_mu + pause_sigma * rng.gauss(0.0, 1.0)) for _ in new_tokens]
        pauses[-1] = 0.0
        row_id = row.get("id", row.get("trial_id", row.get("instance_id", number)))
        sessions.append(
            Session(
                session_id=f"trace-{row_id}",
                arrival=clock,
                new_tokens=tuple(new_tokens),
                output_tokens=tuple(output_tokens),
                pauses=tuple(pauses),
                system_prompt_tokens=min(system, new_tokens[0]),
                client=client,
                model=model,
                prefix_group="trace",
            )
        )
    return sessions


def load_sharegpt(path: str | os.PathLike[str], **options: Any) -> list[Session]:
    """Read a ShareGPT trace file and return its sessions (see :func:`sessions_from_rows`)."""
    return sessions_from_rows(read_rows(path), **options)


def _conversation(row: Mapping[str, Any], number: int) -> list[tuple[str, str]]:
    messages = row.get("conversations", row.get("conversation"))
    if not isinstance(messages, list):
        raise TraceFormatError(f"row {number}: no 'conversations' list")
    out: list[tuple[str, str]] = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TraceFormatError(f"row {number}, message {index}: not an object")
        role = message.get("from", message.get("role"))
        value = message.get("value", message.get("content"))
        if role not in KNOWN_ROLES:
            raise TraceFormatError(f"row {number}, message {index}: unknown role {role!r}")
        if not isinstance(value, str):
            raise TraceFormatError(f"row {number}, message {index}: 'value' is not text")
        out.append((str(role), value))
    return out


def _shared_system_tokens(conversations: Iterable[list[tuple[str, str]]]) -> int:
    """Tokens of the system prompt the rows share.

    A ``system`` message is the system prompt; without one, the longest text that
    begins the first message of every row is (the instructions before the task).
    Only whole four-character tokens of a shared text count.
    """
    firsts = [messages[0] for messages in conversations if messages]
    if not firsts:
        return 0
    system = [text for role, text in firsts if role == "system"]
    if system:
        return min(count_tokens(text) for text in system)
    texts = [text for _, text in firsts]
    if len(texts) < 2:
        return 0  # one row: nothing tells its system prompt from its task
    # commonprefix compares only the smallest and largest text, so this is linear.
    return len(os.path.commonprefix(texts)) // CHARS_PER_TOKEN
