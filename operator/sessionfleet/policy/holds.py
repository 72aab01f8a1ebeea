"""What holds what: the three rules every component counts sessions and workers by.

The operator, the router, the Endpoint Picker, the kubectl plugin and the simulator
each keep their own view of the fleet (typed models, raw API objects, simulated
state), but they must agree on who is full and who may take a session. So each view
calls these functions with the fields it holds instead of writing the rule again.

Phases are compared as strings: every phase enum is a ``StrEnum``, and the router
reads phases straight from the API server's JSON.
"""

from __future__ import annotations

from typing import Final

from sessionfleet.api import SessionPhase, WorkerPhase

_RELEASED_PHASES: Final = frozenset({SessionPhase.FINISHED.value, SessionPhase.LOST.value})


def takes_new_sessions(phase: str | None, drain_requested: bool) -> bool:
    """Whether a worker may be given a new session (or a stateless request).

    Ready and not asked to drain: a drain asked for in ``spec.drain`` but not yet
    written to the status by the operator already closes the worker to new sessions,
    or a router could place one on it in the window between the two writes.
    """
    return phase == WorkerPhase.READY.value and not drain_requested


def holds_worker(worker: str | None, phase: str | None) -> bool:
    """Whether a session counts against its worker's capacity: bound and not over.

    A Finished session has let its worker go, and a Lost one's worker is gone: neither
    holds a place. Every other phase with a worker does, Migrating included (it holds
    its source until the move is done).
    """
    return worker is not None and phase not in _RELEASED_PHASES


def context_tokens(prompt_tokens: int | None, turns: int | None) -> int:
    """Estimate a session's prefix, in tokens: the mean prompt of its turns so far.

    Placement weighs it against a worker's KV capacity; 0 before the first turn.
    """
    return (prompt_tokens or 0) // turns if turns else 0
