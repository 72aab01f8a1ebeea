"""A chunked LIST, page by page, and a relist that keeps views, not objects."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from router_fakes import FakeKube

from sessionfleet.fronts.bindings import BindingTable, SessionView
from sessionfleet.fronts.kubesync import watch_sessions
from sessionfleet.fronts.ledger import UsageLedger
from sessionfleet.kube import SESSIONS, Gone
from sessionfleet.kube.client import Kube
from sessionfleet.kube.config import KubeConfig
from sessionfleet.kube.reflector import reflect

OBJECTS = [{"metadata": {"name": f"s{i}", "resourceVersion": str(i)}} for i in range(7)]


@pytest.fixture
async def lister() -> AsyncIterator[tuple[Kube, list[dict[str, Any]]]]:
    """An API server that answers a LIST of sessions three at a time, with continue tokens."""
    asked: list[dict[str, Any]] = []

    async def list_sessions(request: web.Request) -> web.Response:
        asked.append(dict(request.query))
        limit = int(request.query["limit"])
        start = int(request.query.get("continue", "0"))
        page = OBJECTS[start : start + limit]
        meta: dict[str, Any] = {"resourceVersion": "99"}
        if start + limit < len(OBJECTS):
            meta["continue"] = str(start + limit)
        return web.json_response({"items": page, "metadata": meta})

    app = web.Application()
    app.router.add_get(SESSIONS.path("ns"), list_sessions)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    kube = Kube(KubeConfig(server=str(server.make_url("")).rstrip("/")))
    async with kube:
        yield kube, asked
    await server.close()


async def test_pages_come_in_chunks_and_only_the_last_carries_the_version(
    lister: tuple[Kube, list[dict[str, Any]]],
) -> None:
    kube, asked = lister
    pages = [(page, version) async for page, version in kube.pages(SESSIONS, "ns", chunk=3)]
    assert [len(page) for page, _ in pages] == [3, 3, 1]
    assert [version for _, version in pages] == [None, None, "99"]
    assert [q.get("continue") for q in asked] == [None, "3", "6"]
    items, version = await kube.list(SESSIONS, "ns", chunk=3)
    assert items == OBJECTS and version == "99"


async def test_a_relist_hands_over_views_not_objects() -> None:
    kube = FakeKube()
    for i in range(5):
        kube.put(SESSIONS.plural, session_object(f"s{i}", worker="w1"))
    events = reflect(kube, SESSIONS, "ns", convert=SessionView.from_object)  # type: ignore[arg-type]
    sync = await anext(events)
    assert sync.type == "SYNC" and len(sync.items) == 5
    assert all(isinstance(item, SessionView) for item in sync.items)
    table = BindingTable()
    task = asyncio.create_task(watch_sessions(kube, "ns", table, UsageLedger(10.0)))  # type: ignore[arg-type]
    try:
        for _ in range(100):
            if table.sessions_synced:
                break
            await asyncio.sleep(0.01)
        assert sorted(v.name for v in table.sessions()) == [f"s{i}" for i in range(5)]
    finally:
        task.cancel()
        await events.aclose()


async def test_a_list_cut_midway_leaves_no_version_to_resume_from() -> None:
    # A continue token that expires (410) mid-list must not leave the reflector resuming a
    # watch from a version it never fully listed: it lists again from the start.
    class Expiring(FakeKube):
        calls = 0

        async def pages(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            Expiring.calls += 1
            if Expiring.calls == 1:
                yield [session_object("early", worker="w1")], None
                raise Gone(410, "continue token expired", {})
            async for page in super().pages(*args, **kwargs):
                yield page

    kube = Expiring()
    kube.put(SESSIONS.plural, session_object("s0", worker="w1"))
    events = reflect(kube, SESSIONS, "ns", retry_delay=0)  # type: ignore[arg-type]
    sync = await anext(events)
    assert Expiring.calls == 2 and [o["metadata"]["name"] for o in sync.items] == ["s0"]
    await events.aclose()


def session_object(name: str, *, worker: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "uid": f"u-{name}"},
        "spec": {"sessionId": f"id-{name}", "model": "m"},
        "status": {"phase": "Bound", "worker": worker},
    }
