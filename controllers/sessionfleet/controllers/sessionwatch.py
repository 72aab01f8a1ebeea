"""AgentSessions, watched by the operator itself rather than through kopf.

Sessions are the objects a fleet has by the tens of thousands, and kopf's way with
each object was what bounded the operator at that scale:

- a start (or a relist after a watch expired) read the whole list into memory, then
  queued every object's body to a task of its own: about 9 KB per session of parsed
  JSON held at once, so the resident memory peaked at start;
- each object kept about 1 KB of kopf's bookkeeping for as long as it existed, and each
  event went through kopf's per-object worker, causes and handler arguments.

Here the operator's own reflector (:mod:`sessionfleet.kube.reflector`, the router's)
lists in pages of 500 and turns each page into records as it comes, so what stays is
one :class:`SessionState` per session (:mod:`.sessioncache`); every later event
updates it and marks what it touched (:mod:`.work`), as kopf's handler did. Workers,
pods, nodes and the other kinds, hundreds at most, stay with kopf.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sessionfleet.controllers import loop
from sessionfleet.controllers.fleet import Fleet
from sessionfleet.controllers.kopfcompat import matches_namespace, select_specific_namespaces
from sessionfleet.controllers.records import Key, resource_version, session_record
from sessionfleet.controllers.sessions import reconcile_session
from sessionfleet.kube import SESSIONS, Kube
from sessionfleet.kube.reflector import reflect
from sessionfleet.policy.sessions import SessionState, next_check

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Source:
    """One watch of AgentSessions: a namespace (None: the cluster) and what it keeps."""

    namespace: str | None
    serves: Callable[[str], bool]


def sources(patterns: Iterable[str]) -> list[Source]:
    """Return the watches that cover the namespaces served (kopf's ``--namespace`` syntax).

    Plain names get a watch each, which a Role in each namespace allows; globs and
    exclusions (``team-*``, ``!kube-*``) need one watch of the whole cluster, filtered
    here, as kopf's own watches of every namespace need the cluster-wide ``list``.
    """
    patterns = list(patterns)
    if not patterns:
        return [Source(None, lambda _: True)]
    names = select_specific_namespaces(patterns)
    if len(names) == len(patterns):
        return [Source(name, lambda _: True) for name in sorted(names)]
    return [Source(None, lambda ns: matches_namespace(ns, patterns))]


async def follow(fleet: Fleet, source: Source, kube: Kube | None = None) -> None:
    """Keep ``fleet.sessions.cache`` in step with one watch; mark and bind as events arrive.

    A listing (the first, or a new one after the watch expired) replaces the source's
    sessions: those gone from it are handled as deleted, every listed one that changed
    as changed. The watch reads through ``kube`` (the fleet's own client if None).
    """
    reader = kube if kube is not None else fleet.kube

    def record(body: dict[str, Any]) -> SessionState:
        return known_record(fleet, body) or session_record(body)

    async for event in reflect(reader, SESSIONS, source.namespace, convert=record):
        if event.type == "SYNC":
            listed = {s.key: s for s in event.items if source.serves(s.namespace)}
            for key in fleet.sessions.cache.keys_in(source.namespace) - listed.keys():
                if source.serves(key[0]):
                    session_deleted(fleet, key)
            async for state in loop.paced(listed.values()):
                if fleet.sessions.cache.get(state.key) is not state:
                    session_changed(fleet, state, bind_new=False)
            del listed
            fleet.sessions.cache.listed.add(source.namespace)
            log.info(
                "listed %d AgentSession(s) in %s",
                len(event.items),
                source.namespace or "the cluster",
            )
            fleet.update_indexed()
        elif event.obj is not None:
            meta = event.obj.get("metadata") or {}
            key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
            if not source.serves(key[0]):
                continue
            if event.type == "DELETED":
                session_deleted(fleet, key)
            else:
                session_changed(fleet, session_record(event.obj), bind_new=True)
        fleet.wakeup.set()


def known_record(fleet: Fleet, body: Mapping[str, Any]) -> SessionState | None:
    """Return the kept record of this very version of a session, if there is one.

    A relist after a watch expired lists every session again, most of them as they
    were: a version the cache already holds (its resourceVersion, which every write
    changes) is neither parsed again nor handled as a change.
    """
    meta = body.get("metadata") or {}
    kept = fleet.sessions.cache.get((str(meta.get("namespace", "")), str(meta.get("name", ""))))
    if kept is None or not kept.resource_version:
        return None
    return kept if kept.resource_version == resource_version(body) else None


def session_changed(fleet: Fleet, state: SessionState, *, bind_new: bool) -> None:
    """Keep the record; mark the session and what its move touched; bind a new one now."""
    key = state.key
    fleet.sessions.cache.put(state)
    count(fleet, key, state)
    if state.worker is not None:
        fleet.work.waiting.discard(key)
    fleet.work.session(key)
    when = next_check(state, fleet.config.idle_timeout, fleet.config.lost_timeout)
    fleet.work.session_deadlines.schedule(key, when.timestamp() if when is not None else None)
    new = state.worker is None and state.phase is None and not state.finished
    if bind_new and new and fleet.leadership.leading and fleet.indexed.is_set():
        # Bound from its event, not on the loop's next pass: the bind latency is one
        # placement and one write. The loop would find it marked all the same; a
        # session being bound is busy, so the two never write it twice.
        fleet.spawner.spawn(
            f"bind {key[0]}/{key[1]}", reconcile_session(fleet, state, loop.utcnow())
        )


def session_deleted(fleet: Fleet, key: Key) -> None:
    """Forget a deleted session and uncount it."""
    fleet.sessions.cache.drop(key)
    count(fleet, key, None)
    fleet.work.forget_session(key)


def count(fleet: Fleet, key: Key, state: SessionState | None) -> None:
    """Count a session where it is bound now (``None``: deleted); mark what that moves.

    Placement's per-worker counts and the ledger of bindings written but not yet seen
    change in the same step, so a binding is counted once, there or here.
    """
    loads = fleet.sessions.worker_loads
    now_on = (key[0], state.worker) if state is not None and state.worker else None
    before = {w: loads.pinned.get(w, 0) for w in (loads.worker_of(key), now_on) if w}
    if state is None:
        fleet.sessions.ledger.settle(key)
        loads.remove(key)
    else:
        fleet.sessions.ledger.observe(key, state.worker)  # the cache shows this event now
        loads.update(state)
    due = time.monotonic() + fleet.counter_interval()
    for worker, pinned in before.items():
        fleet.work.worker_counted(worker, pinned, loads.pinned.get(worker, 0), due)
