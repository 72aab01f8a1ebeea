"""The counting rules every view of the fleet shares (policy.holds)."""

from __future__ import annotations

import pytest

from sessionfleet.api import SessionPhase, WorkerPhase
from sessionfleet.policy.holds import context_tokens, holds_worker, takes_new_sessions


@pytest.mark.parametrize("phase", [*WorkerPhase, None])
@pytest.mark.parametrize("drain", [False, True])
def test_only_a_ready_worker_not_asked_to_drain_takes_new_sessions(
    phase: WorkerPhase | None, drain: bool
) -> None:
    expected = phase is WorkerPhase.READY and not drain
    assert takes_new_sessions(phase, drain) is expected
    # the router reads phases as plain strings from the API server's JSON
    assert takes_new_sessions(None if phase is None else phase.value, drain) is expected


@pytest.mark.parametrize("phase", [*SessionPhase, None])
def test_a_bound_session_holds_its_worker_until_finished_or_lost(
    phase: SessionPhase | None,
) -> None:
    released = phase in (SessionPhase.FINISHED, SessionPhase.LOST)
    assert holds_worker("w1", phase) is not released
    assert holds_worker("w1", None if phase is None else phase.value) is not released
    assert holds_worker(None, phase) is False


def test_context_tokens_is_the_mean_prompt_and_zero_before_a_turn() -> None:
    assert context_tokens(0, 0) == 0
    assert context_tokens(None, None) == 0
    assert context_tokens(3000, 3) == 1000
    assert context_tokens(10, 3) == 3
