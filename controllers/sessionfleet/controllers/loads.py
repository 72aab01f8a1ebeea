"""Pinned sessions and their tokens per worker, kept up to date as session events arrive.

Placing a session weighs every worker of its namespace by the sessions pinned to it
and the tokens they hold. Counting them from the index for each placement cost one
look at every live session per bind: 100,000 of them at 100,000 live. Here each
session event moves one session's share from the worker it was on to the one it is on
now, so a placement costs one look per worker.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from sessionfleet.controllers.records import Key
from sessionfleet.policy.sessions import SessionState


@dataclass
class WorkerLoads:
    """Each worker's pinned sessions and their context tokens, by (namespace, worker)."""

    pinned: Counter[Key] = field(default_factory=Counter)
    tokens: Counter[Key] = field(default_factory=Counter)
    _share: dict[Key, tuple[Key, int]] = field(default_factory=dict)
    """Each pinned session's worker and tokens, as last counted."""

    def __len__(self) -> int:
        return len(self._share)

    def update(self, session: SessionState) -> Key | None:
        """Count the session as it is now; return the worker it left, if it moved off one."""
        if session.worker is None or not session.pinned:
            return self.remove(session.key)
        share = ((session.namespace, session.worker), session.context_tokens)
        before = self._share.get(session.key)
        if before == share:
            return None
        left = self.remove(session.key)
        worker, tokens = share
        self._share[session.key] = share
        self.pinned[worker] += 1
        self.tokens[worker] += tokens
        return left if left != worker else None

    def worker_of(self, session: Key) -> Key | None:
        """Return the worker a session is counted on, if it is counted."""
        share = self._share.get(session)
        return share[0] if share is not None else None

    def remove(self, session: Key) -> Key | None:
        """Stop counting a session (deleted, finished, lost); return its worker, if any."""
        share = self._share.pop(session, None)
        if share is None:
            return None
        worker, tokens = share
        self.pinned[worker] -= 1
        self.tokens[worker] -= tokens
        if self.pinned[worker] <= 0:
            del self.pinned[worker]
            del self.tokens[worker]
        return worker

    def rebuild(self, sessions: Iterable[SessionState]) -> int:
        """Count every session again from the index; return how many shares were wrong.

        The full pass's safety net: a share can only go wrong if an event was missed.
        """
        before = dict(self._share)
        self.pinned.clear()
        self.tokens.clear()
        self._share.clear()
        for session in sessions:
            if session.pinned:
                self.update(session)
        keys = before.keys() | self._share.keys()
        return sum(1 for key in keys if before.get(key) != self._share.get(key))
