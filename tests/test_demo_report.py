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


def turn(index: int, started: float, finished: float, cached: int = 0) -> TurnRecord:
    return TurnRecord("s", index, 200, 1, "w", 1000 * index, cached, started, finished)


def test_the_first_turn_after_a_kill_is_the_first_that_started_after_it() -> None:
    runs: Any = {
        "s": SimpleNamespace(
            turns=[
                turn(1, 0.0, 1.0),
                # In flight when the engine died at 10 s: served by the old process.
                turn(2, 9.0, 11.0, cached=1000),
                turn(3, 12.0, 13.0, cached=1990),
            ]
        )
    }
    report = _recovery(runs, {"worker": "w", "killed": 10.0, "ready": 11.5})
    (first,) = report["sessions"]
    assert first["turn"] == 3 and first["prefix_tokens"] == 2000
    assert report["recovery_seconds"] == 1.5
