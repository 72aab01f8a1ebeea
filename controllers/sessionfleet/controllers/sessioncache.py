"""Every AgentSession the operator serves, as the record its decisions read.

Kept by :mod:`.sessionwatch` from the operator's own watch; read by the fleet
(:class:`.fleet.Fleet`): by name, by the worker a session is bound to, and by the
client's session id (a child session is placed beside its parent).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Final

from sessionfleet.controllers.records import Key
from sessionfleet.policy.sessions import SessionState

NEW: Final = "New"
"""The phase gauge's name for sessions the operator has not handled yet."""


@dataclass
class SessionCache:
    """Every AgentSession served, as its latest record: by (namespace, name), by worker."""

    by_key: dict[Key, SessionState] = field(default_factory=dict)
    by_worker: dict[Key, dict[Key, SessionState]] = field(default_factory=dict)
    """Sessions whose status names a worker, by (namespace, worker)."""
    pinned_by_id: dict[tuple[str, str], Key] = field(default_factory=dict)
    """Pinned sessions by (namespace, client session id): a child is placed beside its
    parent, whose worker its bind looks up here."""
    listed: set[str | None] = field(default_factory=set)
    """The sources (a namespace, or None for the cluster) whose first list arrived."""
    phases: Counter[str] = field(default_factory=Counter)
    """Sessions by phase (``New``: not handled yet), kept for the gauges: counting
    100,000 sessions every few seconds held the event loop for a third of a second."""
    recomputed_pinned: int = 0
    """Tokens recomputed so far by the sessions still pinned (a gauge)."""

    def __len__(self) -> int:
        return len(self.by_key)

    def get(self, key: Key) -> SessionState | None:
        """Return the session's record, if it exists."""
        return self.by_key.get(key)

    def all(self) -> list[SessionState]:
        """Return every session's record."""
        return list(self.by_key.values())

    def of_worker(self, worker: Key) -> list[SessionState]:
        """Return the sessions whose status binds them to the worker."""
        bound = self.by_worker.get(worker)
        return list(bound.values()) if bound else []

    def pinned_with_id(self, namespace: str, session_id: str) -> SessionState | None:
        """Return the pinned session that carries a client session id, if there is one."""
        key = self.pinned_by_id.get((namespace, session_id))
        return self.by_key.get(key) if key is not None else None

    def keys_in(self, namespace: str | None) -> set[Key]:
        """Return the keys of one namespace's sessions (every session's for None)."""
        if namespace is None:
            return set(self.by_key)
        return {key for key in self.by_key if key[0] == namespace}

    def put(self, state: SessionState) -> None:
        """Keep this record of the session, replacing the last."""
        self._unlink(self.by_key.get(state.key))
        self.by_key[state.key] = state
        self._count(state, 1)
        if state.worker:
            self.by_worker.setdefault((state.namespace, state.worker), {})[state.key] = state
        if state.pinned and state.worker:
            self.pinned_by_id[(state.namespace, state.session_id)] = state.key

    def drop(self, key: Key) -> SessionState | None:
        """Forget a deleted session; return its last record."""
        state = self.by_key.pop(key, None)
        self._unlink(state)
        return state

    def _count(self, state: SessionState, sign: int) -> None:
        self.phases[state.phase.value if state.phase else NEW] += sign
        if state.pinned:
            self.recomputed_pinned += sign * state.recomputed_tokens

    def _unlink(self, state: SessionState | None) -> None:
        if state is None:
            return
        self._count(state, -1)
        if state.worker:
            worker = (state.namespace, state.worker)
            bound = self.by_worker.get(worker)
            if bound is not None:
                bound.pop(state.key, None)
                if not bound:
                    del self.by_worker[worker]
        with_id = (state.namespace, state.session_id)
        if self.pinned_by_id.get(with_id) == state.key:
            del self.pinned_by_id[with_id]
