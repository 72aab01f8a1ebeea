"""Placement's inputs, kept up to date as events arrive instead of counted per placement.

Placing a session weighs every worker of its namespace by the sessions pinned to it
and the tokens they hold. Counting them from the index for each placement cost one
look at every live session per bind: 100,000 of them at 100,000 live. Here each
session event moves one session's share from the worker it was on to the one it is on
now (:class:`WorkerLoads`), and placement's view of the workers is rebuilt only where it
changed (:class:`PlacementViews`).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import Counter
from collections.abc import Callable, KeysView
from dataclasses import dataclass, field

from sessionfleet.controllers.records import Key, WorkerRecord
from sessionfleet.policy.holds import takes_new_sessions
from sessionfleet.policy.placement import RANK, WorkerLoad
from sessionfleet.policy.sessions import SessionState


@dataclass
class WorkerLoads:
    """Each worker's pinned sessions and their context tokens, by (namespace, worker)."""

    pinned: Counter[Key] = field(default_factory=Counter)
    tokens: Counter[Key] = field(default_factory=Counter)
    _share: dict[Key, tuple[Key, int]] = field(default_factory=dict)
    """Each pinned session's worker and tokens, as last counted."""
    touched: set[Key] = field(default_factory=set)
    """Workers whose counts changed since placement last read them (it clears this)."""

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
        self.touched.add(worker)
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
        self.touched.add(worker)
        if self.pinned[worker] <= 0:
            del self.pinned[worker]
            del self.tokens[worker]
        return worker

    def check(self, key: Key, session: SessionState | None) -> bool:
        """Count one session as the index shows it now; return whether its share was wrong.

        ``session`` is None for one the index no longer has. The full pass's safety
        net, one session at a time so that the pass can let events in between: a share
        can only go wrong if an event was missed.
        """
        right = (
            ((session.namespace, session.worker), session.context_tokens)
            if session is not None and session.worker is not None and session.pinned
            else None
        )
        if self._share.get(key) == right:
            return False
        if session is None or right is None:
            self.remove(key)
        else:
            self.update(session)
        return True

    def counted(self) -> KeysView[Key]:
        """Return the sessions counted on a worker (a live view)."""
        return self._share.keys()


def placement_identity(record: WorkerRecord) -> tuple[str, bool, int, int] | None:
    """Return what placement reads of a worker besides its counts.

    Its model, whether it is Ready and not draining, its capacity; None for an invalid
    worker, which placement does not see.
    """
    worker = record.worker
    if worker is None:
        return None
    spec = worker.spec
    ready = takes_new_sessions(worker.status.phase, spec.drain)
    return (spec.model, ready, spec.capacity.max_sessions, spec.capacity.kv_tokens)


@dataclass
class PlacementViews:
    """Placement's view of each namespace's workers, kept between placements.

    Kept in :data:`~sessionfleet.policy.placement.RANK` order: a placement takes the
    first candidate with room, and a changed worker moves to its place in the order
    (a bisection). Building the view of 500 workers anew took most of a placement's time, and every
    bind, and every pass's retry of a session waiting for room, placed one. A namespace's
    view is built once; then only the entries of workers named in :attr:`touched`
    (counts, bindings in flight or engine figures changed) are rebuilt, and a change of
    what a worker is (:func:`placement_identity`; added, removed) drops the namespace's
    view, built again at the next placement. The full pass drops them all.
    """

    touched: set[Key] = field(default_factory=set)
    """Workers whose entries are out of date (their namespace's view, if it is built)."""
    identities: dict[Key, tuple[str, bool, int, int] | None] = field(default_factory=dict)
    _views: dict[str, tuple[list[WorkerLoad], dict[str, WorkerLoad]]] = field(default_factory=dict)

    def worker_seen(self, key: Key, record: WorkerRecord | None) -> None:
        """Note a worker's event (``None``: deleted).

        Its namespace's view goes if what placement reads of the worker, other than its
        counts, changed, or if the worker came or went.
        """
        if record is None:
            changed = self.identities.pop(key, False) is not False
        else:
            identity = placement_identity(record)
            changed = key not in self.identities or self.identities[key] != identity
            self.identities[key] = identity
        if changed:
            self.drop(key[0])

    def drop(self, namespace: str | None = None) -> None:
        """Forget one namespace's view (every view for None)."""
        if namespace is None:
            self._views.clear()
        else:
            self._views.pop(namespace, None)

    def view(
        self,
        namespace: str,
        build: Callable[[], list[WorkerLoad]],
        entry: Callable[[Key], WorkerLoad | None],
    ) -> list[WorkerLoad]:
        """Return the namespace's view; ``build`` makes it whole, ``entry`` one worker's.

        The list is shared between placements: callers read it, never change it.
        """
        mine = {key for key in self.touched if key[0] == namespace}
        self.touched -= mine
        built = self._views.get(namespace)
        if built is not None:
            loads, by_name = built
            for key in mine:
                old = by_name.get(key[1])
                if old is None:
                    continue  # not a worker placement sees (invalid): nothing to update
                fresh = entry(key)
                index = bisect_left(loads, RANK(old), key=RANK)
                if fresh is None or index == len(loads) or loads[index] is not old:
                    built = None  # gone from the index before its event came
                    break
                del loads[index]
                insort(loads, fresh, key=RANK)
                by_name[key[1]] = fresh
        if built is None:
            loads = sorted(build(), key=RANK)
            self._views[namespace] = (loads, {w.name: w for w in loads})
        return loads
