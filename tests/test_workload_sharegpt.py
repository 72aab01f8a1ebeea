"""Loading sessions from a ShareGPT-style trace file (Inferact/codex_swebenchpro_traces)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sessionfleet.workload import (
    TraceFormatError,
    count_tokens,
    load_sharegpt,
    sessions_from_rows,
)

INSTRUCTIONS = "You are a coding agent. Use the tools to fix the issue. " * 20  # 1,120 chars


def trial(number: int, turns: int) -> dict[str, Any]:
    """One trial: a task, then alternating answers and tool results."""
    conversation = [{"from": "human", "value": INSTRUCTIONS + f"Task {number}: " + "x" * 400}]
    for turn in range(turns):
        conversation.append({"from": "gpt", "value": "y" * (80 + 8 * turn)})
        if turn < turns - 1:
            conversation.append({"from": "human", "value": "tool output " * (30 + turn)})
    return {"id": f"trial-{number}", "conversations": conversation}


@pytest.fixture
def rows() -> list[dict[str, Any]]:
    return [trial(n, turns) for n, turns in enumerate((3, 5, 1, 4))]


def write(path: Path, rows: list[dict[str, Any]], lines: bool) -> Path:
    if lines:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        path.write_text(json.dumps(rows))
    return path


@pytest.mark.parametrize("lines", [False, True], ids=["json", "jsonl"])
def test_load_trace_file(tmp_path: Path, rows: list[dict[str, Any]], lines: bool) -> None:
    path = write(tmp_path / ("trace.jsonl" if lines else "trace.json"), rows, lines)
    sessions = load_sharegpt(path, seed=3)
    assert [s.session_id for s in sessions] == [f"trace-trial-{n}" for n in range(4)]
    assert [s.turn_count for s in sessions] == [3, 5, 1, 4]

    first = sessions[0]
    messages = rows[0]["conversations"]
    # Turn 1's prompt is the task; turn 2 adds the answer and the tool result.
    assert first.new_tokens[0] == count_tokens(messages[0]["value"])
    assert first.new_tokens[1] == count_tokens(messages[1]["value"]) + count_tokens(
        messages[2]["value"]
    )
    assert first.output_tokens == tuple(count_tokens(m["value"]) for m in messages[1::2])
    # The instructions every trial starts with are the shared system prompt.
    assert first.system_prompt_tokens == len(INSTRUCTIONS + "Task ") // 4
    assert {s.prefix_group for s in sessions} == {"trace"}
    assert all(s.pauses[-1] == 0.0 and all(p > 0 for p in s.pauses[:-1]) for s in sessions)
    arrivals = [s.arrival for s in sessions]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0


def test_same_seed_same_pauses(rows: list[dict[str, Any]]) -> None:
    assert sessions_from_rows(rows, seed=1) == sessions_from_rows(rows, seed=1)
    assert sessions_from_rows(rows, seed=1) != sessions_from_rows(rows, seed=2)


def test_system_message_is_the_system_prompt() -> None:
    rows = [
        {
            "conversations": [
                {"from": "system", "value": "s" * 400},
                {"from": "human", "value": f"task {n} " * 50},
                {"from": "gpt", "value": "done"},
            ]
        }
        for n in range(2)
    ]
    sessions = sessions_from_rows(rows)
    assert [s.system_prompt_tokens for s in sessions] == [100, 100]
    assert sessions[0].new_tokens[0] == 100 + count_tokens("task 0 " * 50)


def test_rows_without_an_answer_are_skipped() -> None:
    rows = [{"conversations": [{"from": "human", "value": "hello"}]}, trial(1, 2)]
    assert len(sessions_from_rows(rows)) == 1


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[{", "not valid JSON"),
        ('{"conversations": []}\nnot json\n', ":2: not valid JSON"),
        ("[1, 2]", "expected a list"),
        ('[{"id": 1}]', "no 'conversations' list"),
        ('[{"conversations": [{"from": "robot", "value": "x"}]}]', "unknown role 'robot'"),
        ('[{"conversations": [{"from": "gpt", "value": 3}]}]', "not text"),
    ],
)
def test_format_errors_say_where(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(TraceFormatError, match=message):
        load_sharegpt(path)
