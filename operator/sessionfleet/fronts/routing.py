"""Where a bound session's turn goes: the decision shared by the router and the EPP.

Given the in-memory :class:`BindingTable` and a session's view, :func:`bound_worker`
returns the worker that serves the turn, or a sentence saying why the turn must wait
(the session is Migrating or Restoring, or its worker is missing or not serving). A
Finished session is refused (409 ``session_finished``); a Lost one continues on the
Ready worker its id hashes to (rendezvous hashing, the same on every replica). The
router holds a waiting turn (docs/router.md, step 5); the EPP answers it as docs/epp.md
says.

Pure: no I/O.
"""

from __future__ import annotations

from sessionfleet.api import SessionPhase
from sessionfleet.fronts.bindings import HELD_PHASES, BindingTable, SessionView, WorkerView
from sessionfleet.fronts.errors import RouterError


def bound_worker(table: BindingTable, session: SessionView) -> WorkerView | str:
    """Return the worker for a bound session's turn, or why the turn must wait.

    Raises :class:`RouterError` 409 ``session_finished`` for a Finished session.
    """
    if session.phase == SessionPhase.FINISHED:
        raise RouterError(
            409,
            "session_finished",
            f"session {session.session_id} is finished; start a new session id",
        )
    if session.phase in HELD_PHASES:
        return f"is {session.phase}"
    if session.phase == SessionPhase.LOST:
        # Its worker was deleted and the operator does not rebind it: the turns go
        # where the session id hashes among the Ready workers, the same on every
        # replica, so the session rebuilds its cache in one place.
        rebound = table.rendezvous(session.model, session.session_id)
        return rebound if rebound is not None else "is Lost and no worker is Ready"
    if session.worker is None:
        return "is not bound to a worker yet"
    worker = table.workers.get(session.worker)
    if worker is None:
        return f"is bound to worker {session.worker}, which does not exist"
    if not worker.serving:
        return f"is bound to worker {worker.name}, which is {worker.phase or 'not started'}"
    return worker
