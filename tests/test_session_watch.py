"""The operator's own AgentSession watch: the cache, the sources, and a watch's events."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from sessionfleet.api import SessionPhase
from sessionfleet.controllers.config import OperatorConfig
from sessionfleet.controllers.fleet import Fleet
from sessionfleet.controllers.sessioncache import SessionCache
from sessionfleet.controllers.sessionwatch import follow, sources
from sessionfleet.kube import Gone
from sessionfleet.policy.sessions import SessionState


def state(name: str, worker: str | None = None, **kw: Any) -> SessionState:
    phase = kw.pop("phase", SessionPhase.BOUND if worker else None)
    return SessionState(
        kw.pop("namespace", "ns"), name, f"id-{name}", "m", worker=worker, phase=phase, **kw
    )


def test_the_cache_follows_a_session_from_worker_to_worker_and_out() -> None:
    cache = SessionCache()
    cache.put(state("a"))
    assert cache.get(("ns", "a")) is not None and not cache.by_worker
    cache.put(state("a", "w1"))
    cache.put(state("b", "w1"))
    assert {s.name for s in cache.of_worker(("ns", "w1"))} == {"a", "b"}
    assert cache.pinned_with_id("ns", "id-a") == cache.get(("ns", "a"))

    cache.put(state("a", "w2"))  # moved
    assert [s.name for s in cache.of_worker(("ns", "w1"))] == ["b"]
    assert [s.name for s in cache.of_worker(("ns", "w2"))] == ["a"]

    cache.put(state("a", "w2", phase=SessionPhase.FINISHED))  # bound, no longer pinned
    assert cache.pinned_with_id("ns", "id-a") is None
    assert [s.name for s in cache.of_worker(("ns", "w2"))] == ["a"]

    assert cache.drop(("ns", "a")) is not None and cache.drop(("ns", "a")) is None
    assert ("ns", "w2") not in cache.by_worker and len(cache) == 1
    cache.put(state("c", namespace="other"))
    assert cache.keys_in("other") == {("other", "c")}
    assert cache.keys_in(None) == {("ns", "b"), ("other", "c")}


@pytest.mark.parametrize(
    ("patterns", "watches", "served", "not_served"),
    [
        ((), [None], ["any"], []),
        (("b", "a"), ["a", "b"], ["a"], []),
        (("team-*, !team-x",), [None], ["team-a"], ["team-x", "other"]),
        (("a", "team-*"), [None], ["a", "team-b"], ["b"]),
    ],
)
def test_plain_namespaces_get_a_watch_each_and_globs_one_of_the_cluster(
    patterns: tuple[str, ...], watches: list[str | None], served: list[str], not_served: list[str]
) -> None:
    found = sources(patterns)
    assert [s.namespace for s in found] == watches
    for namespace in served:
        assert any(s.serves(namespace) for s in found)
    for namespace in not_served:
        assert not any(s.serves(namespace) for s in found)


def body(name: str, version: int, worker: str | None = None, namespace: str = "ns") -> dict:
    status = {"phase": "Bound", "worker": worker, "pod": f"{worker}-1", "epoch": 1}
    return {
        "apiVersion": "sessionfleet.dev/v1alpha1",
        "kind": "AgentSession",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{name}",
            "resourceVersion": str(version),
        },
        "spec": {"sessionId": f"id-{name}", "model": "m"},
        "status": status if worker else {},
    }


class ScriptedKube:
    """Answers the reflector's lists and watches from a script; then the watch idles.

    A watch's script ending in ``Gone`` makes the reflector list again.
    """

    def __init__(self, lists: list[list[dict]], watches: list[list[Any]]) -> None:
        self.lists, self.watches = lists, watches

    async def pages(self, *_: Any, **__: Any) -> AsyncIterator[tuple[list[dict], str]]:
        items = self.lists.pop(0)
        yield items[:1], ""
        yield items[1:], "100"

    async def watch(self, *_: Any, **__: Any) -> AsyncIterator[tuple[str, dict]]:
        for step in self.watches.pop(0) if self.watches else []:
            if step is Gone:
                raise Gone(410, "too old resource version")
            yield step
        await asyncio.Event().wait()


async def until(check: Callable[[], bool]) -> None:
    for _ in range(200):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("never")


async def test_a_watch_lists_counts_marks_and_relists_after_it_expired() -> None:
    kube = ScriptedKube(
        lists=[
            [body("a", 1, "w1"), body("b", 2, "w1"), body("gone", 3, "w2")],
            [body("a", 6, "w2"), body("new", 7)],  # after the 410: b and gone were deleted
        ],
        watches=[
            [("MODIFIED", body("b", 4, "w2")), ("DELETED", body("gone", 5, "w2")), Gone],
        ],
    )
    fleet = Fleet(config=OperatorConfig(), kube=kube, http=None)  # type: ignore[arg-type]
    fleet.indexes.kopf_indexed = True
    task = asyncio.create_task(follow(fleet, sources(["ns"])[0]))
    try:
        await until(lambda: fleet.sessions.session("ns", "new") is not None)
    finally:
        task.cancel()
    assert fleet.indexed.is_set()
    assert {s.name for s in fleet.sessions.all_sessions()} == {"a", "new"}
    assert [s.name for s in fleet.sessions.sessions_of(("ns", "w2"))] == ["a"]
    assert fleet.sessions.sessions_of(("ns", "w1")) == []
    # Placement's counts moved with every event, the deletions included.
    assert dict(fleet.sessions.worker_loads.pinned) == {("ns", "w2"): 1}
    assert fleet.work.sessions >= {("ns", "a"), ("ns", "new")}
    assert ("ns", "b") not in fleet.work.sessions  # forgotten with its deletion


async def test_a_watch_of_the_cluster_keeps_only_the_namespaces_served() -> None:
    kube = ScriptedKube(
        lists=[[body("a", 1, "w1", namespace="team-a"), body("b", 2, "w1", namespace="kube")]],
        watches=[[("ADDED", body("c", 3, namespace="kube"))]],
    )
    fleet = Fleet(config=OperatorConfig(), kube=kube, http=None)  # type: ignore[arg-type]
    (source,) = sources(["team-*"])
    task = asyncio.create_task(follow(fleet, source))
    try:
        await until(lambda: None in fleet.sessions.cache.listed)
        await asyncio.sleep(0.05)
    finally:
        task.cancel()
    assert [s.key for s in fleet.sessions.all_sessions()] == [("team-a", "a")]
    assert not fleet.indexed.is_set()  # kopf has not filled its indexes yet


class GatedKube(ScriptedKube):
    """Expires its first watch only once ``expire`` is set."""

    def __init__(self, lists: list[list[dict]]) -> None:
        super().__init__(lists, [])
        self.expire = asyncio.Event()

    async def watch(self, *_: Any, **__: Any) -> AsyncIterator[tuple[str, dict]]:
        if not self.expire.is_set():
            await self.expire.wait()
            raise Gone(410, "too old resource version")
        async for step in super().watch():
            yield step


async def test_a_relist_neither_parses_nor_marks_a_session_at_a_version_already_held() -> None:
    kube = GatedKube(
        lists=[
            [body("same", 1, "w1"), body("moved", 2, "w1")],
            [body("same", 1, "w1"), body("moved", 5, "w2"), body("new", 6)],
        ]
    )
    fleet = Fleet(config=OperatorConfig(), kube=kube, http=None)  # type: ignore[arg-type]
    fleet.indexes.kopf_indexed = True
    task = asyncio.create_task(follow(fleet, sources(["ns"])[0]))
    try:
        await until(lambda: len(fleet.sessions.cache) == 2)
        kept = {s.name: s for s in fleet.sessions.all_sessions()}
        fleet.work.take(wall=0.0, mono=0.0)  # the first, full pass takes every mark
        kube.expire.set()
        await until(lambda: fleet.sessions.session("ns", "new") is not None)
    finally:
        task.cancel()
    # The unchanged session is the very record kept before the relist: not parsed again.
    assert fleet.sessions.session("ns", "same") is kept["same"]
    moved = fleet.sessions.session("ns", "moved")
    assert moved is not None and moved is not kept["moved"] and moved.worker == "w2"
    # Only what changed is marked for the next pass; the counts still add up.
    assert fleet.work.sessions == {("ns", "moved"), ("ns", "new")}
    assert dict(fleet.sessions.worker_loads.pinned) == {("ns", "w1"): 1, ("ns", "w2"): 1}
