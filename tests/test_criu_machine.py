"""The criu driver's state machine: every path, as tables of outcomes."""

from __future__ import annotations

import pytest

from sessionfleet.agent.criu_machine import (
    OK,
    Action,
    Operation,
    Outcome,
    Phase,
    State,
    start,
    step,
)

A = Action
P = Phase
FAIL = Outcome(False, "boom")


def walk(
    operation: Operation, outcomes: list[Outcome], *, leave_running: bool = True
) -> tuple[State, list[tuple[Action, Phase]]]:
    """Feed one outcome per action; return the final state and (action, phase) pairs."""
    current = start(operation, leave_running=leave_running)
    trace: list[tuple[Action, Phase]] = []
    for outcome in outcomes:
        assert len(current.actions) == 1, current.actions
        action = current.actions[0]
        current = step(current.state, outcome)
        trace.append((action, current.state.phase))
    assert current.state.done, f"still in {current.state.phase} waiting for {current.actions}"
    assert current.actions == ()
    return current.state, trace


def test_a_checkpoint_starts_by_pausing_and_a_restore_by_criu() -> None:
    assert start(Operation.CHECKPOINT).actions == (A.PAUSE_ENGINE,)
    assert start(Operation.CHECKPOINT).state.phase is P.RUNNING
    assert start(Operation.RESTORE).actions == (A.CRIU_RESTORE,)
    assert start(Operation.RESTORE).state.phase is P.IMAGES


# Each row: outcomes fed in order, then the expected (action performed, phase reached)
# trace and the final phase. A checkpoint that leaves the process running.
CHECKPOINT_ROWS = [
    pytest.param(
        [OK] * 7,
        [
            (A.PAUSE_ENGINE, P.PAUSED),
            (A.LOCK, P.LOCKED),
            (A.CHECKPOINT_GPU, P.CHECKPOINTED),
            (A.DUMP, P.DUMPED),
            (A.RESTORE_GPU, P.GPU_RESTORED),
            (A.UNLOCK, P.UNLOCKED),
            (A.RESUME_ENGINE, P.RESUMED),
        ],
        id="success, left running",
    ),
    pytest.param(
        [FAIL, OK],
        [(A.PAUSE_ENGINE, P.RUNNING), (A.RESUME_ENGINE, P.FAILED)],
        id="pause fails: resume in case it landed",
    ),
    pytest.param(
        [OK, FAIL, OK, OK],
        [
            (A.PAUSE_ENGINE, P.PAUSED),
            (A.LOCK, P.PAUSED),
            (A.UNLOCK, P.UNLOCKED),
            (A.RESUME_ENGINE, P.FAILED),
        ],
        id="lock times out: unlock (a no-op if still running), resume",
    ),
    pytest.param(
        [OK, OK, FAIL, OK, OK, OK],
        [
            (A.PAUSE_ENGINE, P.PAUSED),
            (A.LOCK, P.LOCKED),
            (A.CHECKPOINT_GPU, P.LOCKED),
            (A.RESTORE_GPU, P.GPU_RESTORED),
            (A.UNLOCK, P.UNLOCKED),
            (A.RESUME_ENGINE, P.FAILED),
        ],
        id="GPU checkpoint fails: restore GPU memory, unlock, resume",
    ),
    pytest.param(
        [OK, OK, OK, FAIL, OK, OK, OK],
        [
            (A.PAUSE_ENGINE, P.PAUSED),
            (A.LOCK, P.LOCKED),
            (A.CHECKPOINT_GPU, P.CHECKPOINTED),
            (A.DUMP, P.CHECKPOINTED),
            (A.RESTORE_GPU, P.GPU_RESTORED),
            (A.UNLOCK, P.UNLOCKED),
            (A.RESUME_ENGINE, P.FAILED),
        ],
        id="CRIU dump fails: undo everything",
    ),
    pytest.param(
        [OK, OK, FAIL, FAIL, OK],
        [
            (A.PAUSE_ENGINE, P.PAUSED),
            (A.LOCK, P.LOCKED),
            (A.CHECKPOINT_GPU, P.LOCKED),
            (A.RESTORE_GPU, P.KILLING),
            (A.KILL, P.FATAL),
        ],
        id="undo fails: the process may be stuck, kill it",
    ),
    pytest.param(
        [OK, OK, FAIL, OK, FAIL, OK],
        [
            (A.PAUSE_ENGINE, P.PAUSED),
            (A.LOCK, P.LOCKED),
            (A.CHECKPOINT_GPU, P.LOCKED),
            (A.RESTORE_GPU, P.GPU_RESTORED),
            (A.UNLOCK, P.KILLING),
            (A.KILL, P.FATAL),
        ],
        id="unlock fails while undoing: kill",
    ),
    pytest.param(
        [FAIL, FAIL, OK],
        [(A.PAUSE_ENGINE, P.RUNNING), (A.RESUME_ENGINE, P.KILLING), (A.KILL, P.FATAL)],
        id="engine unreachable for pause and resume: kill",
    ),
    pytest.param(
        [OK, OK, OK, OK, FAIL, OK],
        [
            (A.PAUSE_ENGINE, P.PAUSED),
            (A.LOCK, P.LOCKED),
            (A.CHECKPOINT_GPU, P.CHECKPOINTED),
            (A.DUMP, P.DUMPED),
            (A.RESTORE_GPU, P.KILLING),
            (A.KILL, P.FATAL),
        ],
        id="GPU restore after the dump fails: fatal",
    ),
    pytest.param(
        [OK] * 6 + [FAIL, OK],
        [
            (A.PAUSE_ENGINE, P.PAUSED),
            (A.LOCK, P.LOCKED),
            (A.CHECKPOINT_GPU, P.CHECKPOINTED),
            (A.DUMP, P.DUMPED),
            (A.RESTORE_GPU, P.GPU_RESTORED),
            (A.UNLOCK, P.UNLOCKED),
            (A.RESUME_ENGINE, P.KILLING),
            (A.KILL, P.FATAL),
        ],
        id="resume after the dump fails: an engine paused for good is killed",
    ),
]


@pytest.mark.parametrize(("outcomes", "trace"), CHECKPOINT_ROWS)
def test_checkpoint_paths(outcomes: list[Outcome], trace: list[tuple[Action, Phase]]) -> None:
    state, walked = walk(Operation.CHECKPOINT, outcomes)
    assert walked == trace
    assert state.phase is trace[-1][1]


def test_a_migration_checkpoint_stops_after_the_dump() -> None:
    state, walked = walk(Operation.CHECKPOINT, [OK] * 4, leave_running=False)
    assert walked[-1] == (A.DUMP, P.STOPPED)
    assert state.phase is P.STOPPED and state.error == ""


RESTORE_ROWS = [
    pytest.param(
        [OK] * 4,
        [
            (A.CRIU_RESTORE, P.RESTORED),
            (A.RESTORE_GPU, P.GPU_RESTORED),
            (A.UNLOCK, P.UNLOCKED),
            (A.RESUME_ENGINE, P.RESUMED),
        ],
        id="success",
    ),
    pytest.param(
        [FAIL, OK],
        [(A.CRIU_RESTORE, P.KILLING), (A.KILL, P.FATAL)],
        id="CRIU restore fails: fatal, cold start",
    ),
    pytest.param(
        [OK, FAIL, OK],
        [(A.CRIU_RESTORE, P.RESTORED), (A.RESTORE_GPU, P.KILLING), (A.KILL, P.FATAL)],
        id="GPU restore fails: the process may be stuck, kill it",
    ),
    pytest.param(
        [OK, OK, FAIL, FAIL],
        [
            (A.CRIU_RESTORE, P.RESTORED),
            (A.RESTORE_GPU, P.GPU_RESTORED),
            (A.UNLOCK, P.KILLING),
            (A.KILL, P.FATAL),
        ],
        id="unlock fails and so does the kill",
    ),
    pytest.param(
        [OK, OK, OK, FAIL, OK],
        [
            (A.CRIU_RESTORE, P.RESTORED),
            (A.RESTORE_GPU, P.GPU_RESTORED),
            (A.UNLOCK, P.UNLOCKED),
            (A.RESUME_ENGINE, P.KILLING),
            (A.KILL, P.FATAL),
        ],
        id="resume fails: fatal",
    ),
]


@pytest.mark.parametrize(("outcomes", "trace"), RESTORE_ROWS)
def test_restore_paths(outcomes: list[Outcome], trace: list[tuple[Action, Phase]]) -> None:
    state, walked = walk(Operation.RESTORE, outcomes)
    assert walked == trace


def test_the_first_error_is_kept_and_later_ones_appended() -> None:
    outcomes = [OK, OK, Outcome(False, "out of host memory"), Outcome(False, "illegal state")]
    outcomes.append(Outcome(False, "no such process"))
    state, _ = walk(Operation.CHECKPOINT, outcomes)
    assert state.phase is P.FATAL
    assert state.error == (
        "CheckpointGpu failed: out of host memory; then RestoreGpu failed: illegal state"
        "; kill failed: no such process"
    )


def test_an_undone_checkpoint_reports_why_it_failed() -> None:
    state, _ = walk(Operation.CHECKPOINT, [OK, Outcome(False, "timeout"), OK, OK])
    assert (state.phase, state.error) == (P.FAILED, "Lock failed: timeout")
    assert state.undoing


def test_a_finished_machine_takes_no_more_outcomes() -> None:
    state, _ = walk(Operation.RESTORE, [OK] * 4)
    with pytest.raises(ValueError, match="finished in Resumed"):
        step(state, OK)
