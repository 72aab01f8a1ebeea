"""The ``criu`` driver's state machine for one checkpoint or one restore; pure.

A checkpoint walks the engine's process down, one confirmed step at a time::

    Running ─pause─▶ Paused ─lock─▶ Locked ─checkpoint─▶ Checkpointed ─dump─▶ Dumped
       (POST /pause?mode=keep)  (cuCheckpointProcessLock)  (GPU memory → host)  (CRIU)

then either stops there (``Stopped``: CRIU ended the process, as a migration wants) or,
leaving it running (a periodic checkpoint), walks back up::

    Dumped ─restore GPU─▶ GpuRestored ─unlock─▶ Unlocked ─resume─▶ Resumed

A restore starts from the images and takes the same way up::

    Images ─CRIU restore─▶ Restored ─restore GPU─▶ GpuRestored ─unlock─▶ Unlocked ─resume─▶ Resumed

Failures (docs/background.md, "Checkpointing a GPU process"):

- a failed checkpoint step undoes what was done — restore GPU memory if it left, unlock,
  resume the engine — and ends ``Failed`` with the engine serving as before;
- a failed restore step, or any failure while undoing, is fatal: the process may be
  stuck with its CUDA calls locked, so it is killed (``Killing``) and ends ``Fatal``;
  the worker then recovers with a cold start plus the KV store.

:func:`start` and :func:`step` are the whole machine: ``step(state, outcome)`` takes the
outcome of the action in flight and returns the next state and the actions to perform.
The undo actions are meant to be idempotent (restoring GPU memory that never left, or
unlocking a process a lock timeout left running, does nothing), so one undo chain
serves every failure point.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from sessionfleet.checkpoint.agent_api import FATAL_PHASE


class Operation(enum.StrEnum):
    """What the machine does."""

    CHECKPOINT = "checkpoint"
    RESTORE = "restore"


class Phase(enum.StrEnum):
    """The last state the process was confirmed in."""

    RUNNING = "Running"
    """The engine serves; CUDA calls run."""
    PAUSED = "Paused"
    """The engine holds its requests (``POST /pause?mode=keep``) and keeps its cache."""
    LOCKED = "Locked"
    """CUDA calls block (``cuCheckpointProcessLock``)."""
    CHECKPOINTED = "Checkpointed"
    """GPU memory is in host memory and no device is held (``cuCheckpointProcessCheckpoint``)."""
    DUMPED = "Dumped"
    """CRIU wrote the process's images."""
    IMAGES = "Images"
    """A restore's start: images on storage, no process yet."""
    RESTORED = "Restored"
    """CRIU recreated the process; its GPU memory is still in host memory."""
    GPU_RESTORED = "GpuRestored"
    """GPU memory is back on a device (``cuCheckpointProcessRestore``); still locked."""
    UNLOCKED = "Unlocked"
    """CUDA calls run again (``cuCheckpointProcessUnlock``); the engine is still paused."""
    RESUMED = "Resumed"
    """Done: the engine serves again (``POST /resume``)."""
    STOPPED = "Stopped"
    """Done: the process is dumped and CRIU ended it (a migration's checkpoint)."""
    FAILED = "Failed"
    """Done: the checkpoint failed and was undone; the engine serves as before."""
    KILLING = "Killing"
    """The process is being killed after a fatal failure."""
    FATAL = FATAL_PHASE
    """Done: the process was killed (or is gone); recover with a cold start plus the KV store."""


class Action(enum.StrEnum):
    """What the executor does for the machine; each reports one :class:`Outcome`."""

    PAUSE_ENGINE = "PauseEngine"
    LOCK = "Lock"
    CHECKPOINT_GPU = "CheckpointGpu"
    DUMP = "Dump"
    CRIU_RESTORE = "CriuRestore"
    RESTORE_GPU = "RestoreGpu"
    UNLOCK = "Unlock"
    RESUME_ENGINE = "ResumeEngine"
    KILL = "Kill"


TERMINAL = frozenset({Phase.RESUMED, Phase.STOPPED, Phase.FAILED, Phase.FATAL})
SUCCEEDED = frozenset({Phase.RESUMED, Phase.STOPPED})

# Where each action, when it succeeds, leaves the process.
_REACHES: dict[Action, Phase] = {
    Action.PAUSE_ENGINE: Phase.PAUSED,
    Action.LOCK: Phase.LOCKED,
    Action.CHECKPOINT_GPU: Phase.CHECKPOINTED,
    Action.DUMP: Phase.DUMPED,
    Action.CRIU_RESTORE: Phase.RESTORED,
    Action.RESTORE_GPU: Phase.GPU_RESTORED,
    Action.UNLOCK: Phase.UNLOCKED,
    Action.RESUME_ENGINE: Phase.RESUMED,
    Action.KILL: Phase.FATAL,
}

# The next action from each confirmed phase on the way forward.
_NEXT: dict[Phase, Action] = {
    Phase.RUNNING: Action.PAUSE_ENGINE,
    Phase.PAUSED: Action.LOCK,
    Phase.LOCKED: Action.CHECKPOINT_GPU,
    Phase.CHECKPOINTED: Action.DUMP,
    Phase.DUMPED: Action.RESTORE_GPU,
    Phase.IMAGES: Action.CRIU_RESTORE,
    Phase.RESTORED: Action.RESTORE_GPU,
    Phase.GPU_RESTORED: Action.UNLOCK,
    Phase.UNLOCKED: Action.RESUME_ENGINE,
}

# The first undo action when a checkpoint step fails; the rest of the chain follows
# from _NEXT (GpuRestored → unlock → Unlocked → resume).
_UNDO: dict[Action, Action] = {
    Action.PAUSE_ENGINE: Action.RESUME_ENGINE,  # a pause that timed out may have landed
    Action.LOCK: Action.UNLOCK,  # a failed lock may still have locked
    Action.CHECKPOINT_GPU: Action.RESTORE_GPU,  # memory may have left the device
    Action.DUMP: Action.RESTORE_GPU,
}


@dataclass(frozen=True, slots=True)
class State:
    """Where one checkpoint or restore stands."""

    operation: Operation
    phase: Phase
    pending: Action | None
    """The action in flight; the next :class:`Outcome` reports on it."""
    leave_running: bool = True
    """Checkpoint only: bring the process back after the dump instead of ending it."""
    undoing: bool = False
    """A checkpoint step failed and the machine is undoing what was done."""
    error: str = ""
    """The first failure, kept through undo and kill."""

    @property
    def done(self) -> bool:
        """Whether the machine has finished."""
        return self.phase in TERMINAL


@dataclass(frozen=True, slots=True)
class Outcome:
    """The result of the action in flight."""

    ok: bool
    detail: str = ""


OK = Outcome(True)


@dataclass(frozen=True, slots=True)
class Step:
    """The machine's answer: the new state and the actions to perform, in order."""

    state: State
    actions: tuple[Action, ...]


def start(operation: Operation, *, leave_running: bool = True) -> Step:
    """Return the first step of a checkpoint (from Running) or a restore (from Images)."""
    phase = Phase.RUNNING if operation is Operation.CHECKPOINT else Phase.IMAGES
    action = _NEXT[phase]
    state = State(operation, phase, action, leave_running=leave_running)
    return Step(state, (action,))


def _go(state: State, action: Action | None) -> Step:
    return Step(replace(state, pending=action), (action,) if action else ())


def _kill(state: State, error: str) -> Step:
    return _go(replace(state, phase=Phase.KILLING, error=error), Action.KILL)


def step(state: State, outcome: Outcome) -> Step:
    """Return the next state and actions, given the outcome of ``state.pending``."""
    action = state.pending
    if state.done or action is None:
        raise ValueError(f"the machine has finished in {state.phase}")
    if action is Action.KILL:
        # Killing is the last resort: its own failure is reported, not retried.
        error = state.error if outcome.ok else f"{state.error}; kill failed: {outcome.detail}"
        return Step(replace(state, phase=Phase.FATAL, pending=None, error=error), ())
    if not outcome.ok:
        failure = f"{action.value} failed: {outcome.detail or 'no detail'}"
        first_undo = _UNDO.get(action)
        if state.operation is Operation.CHECKPOINT and not state.undoing and first_undo:
            return _go(replace(state, undoing=True, error=failure), first_undo)
        # A restore step, a step after the dump, or an undo step: the process may be
        # stuck with its CUDA calls locked. Nothing safe is left but to end it.
        return _kill(state, f"{state.error}; then {failure}" if state.error else failure)
    reached = _REACHES[action]
    if reached is Phase.RESUMED and state.undoing:
        return Step(replace(state, phase=Phase.FAILED, pending=None), ())
    if reached is Phase.DUMPED and not state.leave_running:
        return Step(replace(state, phase=Phase.STOPPED, pending=None), ())
    if reached in TERMINAL:
        return Step(replace(state, phase=reached, pending=None), ())
    return _go(replace(state, phase=reached), _NEXT[reached])


__all__ = [
    "OK",
    "SUCCEEDED",
    "TERMINAL",
    "Action",
    "Operation",
    "Outcome",
    "Phase",
    "State",
    "Step",
    "start",
    "step",
]
