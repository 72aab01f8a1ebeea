"""The demo report: which turn counts as the first after an engine was killed."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from demo.driver import TurnRecord  # noqa: E402
from demo.report import _recovery  # noqa: E402


def turn(
    index: int, started: float, finished: float, cached: int = 0, sid: str = "s"
) -> TurnRecord:
    return TurnRecord(sid, index, 200, 1, "w", 1000 * index, cached, started, finished)


def test_the_first_turn_after_a_kill_follows_a_turn_that_finished_before_it() -> None:
    runs: Any = {
        # In flight when the engine died at 10 s: served by the old process, or retried
        # on the new epoch, whose cache its next turn then hits. Neither says what the
        # new epoch restored: the session is left out.
        "in-flight": SimpleNamespace(
            turns=[
                turn(1, 0.0, 1.0, sid="in-flight"),
                turn(2, 9.0, 11.0, cached=1000, sid="in-flight"),
                turn(3, 12.0, 13.0, cached=1990, sid="in-flight"),
            ]
        ),
        "idle": SimpleNamespace(
            turns=[
                turn(1, 0.0, 1.0, sid="idle"),
                turn(2, 8.0, 9.0, cached=1000, sid="idle"),
                turn(3, 12.0, 13.0, sid="idle"),
                turn(4, 14.0, 15.0, cached=2990, sid="idle"),
            ]
        ),
    }
    report = _recovery(runs, {"worker": "w", "killed": 10.0, "ready": 11.5})
    (first,) = report["sessions"]
    assert (first["session"], first["turn"], first["prefix_tokens"]) == ("idle", 3, 2000)
    assert first["recomputed_tokens"] == 2000
    assert report["recovery_seconds"] == 1.5
