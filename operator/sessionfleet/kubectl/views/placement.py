"""Where a session would go now: the operator's own placement, over loads built as it does.

:func:`~sessionfleet.policy.placement.place` decides; this module only builds its inputs
from a :class:`~sessionfleet.kubectl.views.snapshot.Snapshot`. A worker takes new
sessions by the operator's rule (:func:`~sessionfleet.policy.holds.takes_new_sessions`).
"""

from __future__ import annotations

from sessionfleet.api import (
    AgentSession,
    InferenceWorker,
)
from sessionfleet.kubectl.views.sessions import context_tokens
from sessionfleet.kubectl.views.snapshot import Snapshot, pinned
from sessionfleet.policy.holds import takes_new_sessions
from sessionfleet.policy.placement import Placement, PlacementRequest, WorkerLoad, admit_or_place


def loads(snap: Snapshot, namespace: str) -> list[WorkerLoad]:
    """Return placement's view of a namespace's workers, as the operator builds it.

    Pinned sessions and their prefixes are counted from the sessions read, and KV usage
    is the engine's figure from the worker's status; a worker is a candidate only when
    it is Ready and not asked to drain.
    """
    out = []
    for worker in snap.workers:
        if worker.metadata.namespace != namespace:
            continue
        held = snap.sessions_of(worker)
        usage = worker.status.kv_cache_usage_percent
        out.append(
            WorkerLoad(
                name=worker.metadata.name,
                model=worker.spec.model,
                ready=takes_new_sessions(worker.status.phase, worker.spec.drain),
                pinned_sessions=len(held),
                max_sessions=worker.spec.capacity.max_sessions,
                kv_tokens_capacity=worker.spec.capacity.kv_tokens,
                kv_tokens_pinned=sum(context_tokens(s) for s in held),
                kv_usage=usage / 100 if usage is not None else 0.0,
            )
        )
    return out


def placement_now(snap: Snapshot, session: AgentSession) -> Placement:
    """Return where the operator would bind ``session`` now: its pin, hint and parent honoured."""
    parent = None
    if session.spec.parent_session_id is not None:
        parent = next(
            (
                s.status.worker
                for s in snap.sessions
                if s.metadata.namespace == session.metadata.namespace
                and s.spec.session_id == session.spec.parent_session_id
                and pinned(s)
            ),
            None,
        )
    request = PlacementRequest(
        model=session.spec.model,
        pin=session.spec.worker_pin,
        parent_worker=parent,
        expected_tokens=context_tokens(session),
    )
    workers = loads(snap, session.metadata.namespace)
    return admit_or_place(request, workers, hint=session.spec.worker_hint)


def serving(snap: Snapshot, namespace: str, model: str) -> list[InferenceWorker]:
    """Return a namespace's workers serving ``model``."""
    return [w for w in snap.workers if w.metadata.namespace == namespace and w.spec.model == model]
