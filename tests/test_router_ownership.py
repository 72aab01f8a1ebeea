"""Who may end or steer a session, and which replica may delete one (issue 29, items 8, 11).

With API keys on, a session belongs to the client whose key created it: another client
sending the same id (turns, or the final marker) reaches a session of its own, never the
owner's. A replica deletes a session whose first turn failed only while nothing shows
that another replica served it; a replica about to serve a session another created,
that no usage write shows served yet, claims it first.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import aiohttp.web
from router_fleet import MODEL, Fleet, chat, opening, post, until, worker_object
from test_router_hardening import authenticated_router

from sessionfleet.api.labels import CREATED_BY_ANNOTATION, SERVED_BY_ANNOTATION
from sessionfleet.fronts.bindings import SessionView
from sessionfleet.fronts.identity import session_object_name
from sessionfleet.fronts.kubesync import may_discard, must_claim
from sessionfleet.fronts.ledger import Totals
from sessionfleet.kube import SESSIONS, WORKERS
from sessionfleet.router.server import Router

ANSWER: dict[str, Any] = {
    "object": "chat.completion",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
    "usage": {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42},
}


def outcome(router: Router, name: str) -> float:
    return float(router.metrics.sessions_created.labels(name)._value.get())


# --- item 11: a replica never deletes a session another replica serves -----------------


def view(**fields: Any) -> SessionView:
    base: dict[str, Any] = {
        "name": "s-1",
        "session_id": "s",
        "model": MODEL,
        "phase": "Bound",
        "worker": "w1",
        "finished": False,
        "resource_version": "7",
        "created_by": "ra",
    }
    return SessionView(**(base | fields))


def test_who_claims_and_what_may_be_discarded() -> None:
    fresh = view()
    assert must_claim(fresh, "rb")
    assert not must_claim(fresh, "ra")  # its creator decides about it itself
    assert not must_claim(view(created_by=None), "rb")  # made with kubectl: never deleted
    assert not must_claim(view(served_by="rc"), "rb")  # claimed already: it is kept
    assert not must_claim(view(usage=Totals(turns=1)), "rb")
    assert not must_claim(view(usage_writes={"rc": 3}), "rb")
    assert may_discard(fresh)
    assert not may_discard(view(served_by="rb"))
    assert not may_discard(view(usage=Totals(turns=1)))
    assert not may_discard(view(usage_writes={"rb": 1}))


async def test_a_session_another_replica_serves_survives_a_failed_first_turn(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    release = asyncio.Event()

    async def engine(request: aiohttp.web.Request) -> aiohttp.web.Response:
        body = await request.json()
        if body["messages"][-1]["content"] == "never answered":
            await release.wait()
            return aiohttp.web.json_response({"error": {"message": "engine died"}}, status=500)
        return aiohttp.web.json_response(ANSWER)

    await fleet.fake_engine("w1", engine)
    url_a, replica_a = await fleet.router()
    url_b, replica_b = await fleet.router()
    name = session_object_name("shared")
    # Replica A creates the session; its first turn hangs at the engine.
    first = asyncio.create_task(
        post(http, url_a, chat(opening("never answered")), {"X-Session-Id": "shared"})
    )
    await until(lambda: replica_b.table.session_named(name) is not None)
    uid = fleet.kube.obj(SESSIONS.plural, name)["metadata"]["uid"]
    # Replica B serves a turn of it; its usage is not written yet (no flush before the end).
    status, _, headers = await post(http, url_b, chat(opening("go on")), {"X-Session-Id": "shared"})
    assert status == 200 and headers["X-Sessionfleet-Session"] == name
    annotations = fleet.kube.obj(SESSIONS.plural, name)["metadata"]["annotations"]
    assert annotations[SERVED_BY_ANNOTATION] == "r1"
    # A's first turn fails: A would discard the session, but B served it.
    release.set()
    assert (await first)[0] == 500
    await until(lambda: fleet.kube.deletes > 0 or outcome(replica_a, "kept") == 1)
    assert fleet.kube.names(SESSIONS.plural) == [name]
    assert fleet.kube.obj(SESSIONS.plural, name)["metadata"]["uid"] == uid
    await replica_b.flusher.flush_all()
    assert fleet.kube.obj(SESSIONS.plural, name)["status"]["turns"] == 1
    assert outcome(replica_a, "discarded") == 0


async def test_a_discard_decided_on_a_stale_view_is_refused_and_decided_again(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    """B's claim landed, A's table does not show it yet: the delete's precondition fails."""
    fleet.kube.put(WORKERS.plural, worker_object("w1", "http://127.0.0.1:9"))
    _, replica_a = await fleet.router()
    await until(lambda: replica_a.table.synced)
    name = session_object_name("stale")
    created = await fleet.kube.create(
        SESSIONS,
        {
            "metadata": {"name": name, "annotations": {CREATED_BY_ANNOTATION: "r0"}},
            "spec": {"sessionId": "stale", "model": MODEL, "workerHint": "w1"},
        },
    )
    await until(lambda: replica_a.table.session_named(name) is not None)
    stale = replica_a.table.session_named(name)
    assert stale is not None
    # The claim lands in the API server; A decides on the view from before it.
    await fleet.kube.patch(
        SESSIONS, name, {"metadata": {"annotations": {SERVED_BY_ANNOTATION: "r9"}}}
    )
    replica_a.creator.discard(stale, busy={})
    await until(lambda: outcome(replica_a, "kept") == 1 or fleet.kube.deletes > 0)
    assert fleet.kube.deletes == 0
    assert fleet.kube.obj(SESSIONS.plural, name)["metadata"]["uid"] == created["metadata"]["uid"]


async def test_a_session_deleted_before_the_claim_is_started_anew(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    async def engine(_: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response(ANSWER)

    await fleet.fake_engine("w1", engine)
    url, replica = await fleet.router()
    name = session_object_name("gone")
    await fleet.kube.create(
        SESSIONS,
        {
            "metadata": {"name": name, "annotations": {CREATED_BY_ANNOTATION: "elsewhere"}},
            "spec": {"sessionId": "gone", "model": MODEL, "workerHint": "w1"},
        },
    )
    await until(lambda: replica.table.session_named(name) is not None)
    # Its creator's delete lands, and this replica has not heard of it yet.
    del fleet.kube.objects[(SESSIONS.plural, name)]
    status, _, _ = await post(http, url, chat(opening()), {"X-Session-Id": "gone"})
    assert status == 200
    recreated = fleet.kube.obj(SESSIONS.plural, name)
    assert recreated["metadata"]["annotations"][CREATED_BY_ANNOTATION] == "r0"


# --- item 8: with API keys, only the owner ends or steers a session ----------------------


async def test_another_client_can_neither_end_nor_steer_a_session(
    fleet: Fleet, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    served: list[str] = []

    async def engine(request: aiohttp.web.Request) -> aiohttp.web.Response:
        served.append(request.headers["X-Session-ID"])
        return aiohttp.web.json_response(ANSWER)

    await fleet.fake_engine("w1", engine)
    url, router = await authenticated_router(fleet, tmp_path)
    alice = {"X-Session-Id": "build-7", "Authorization": "Bearer k-alice"}
    bob = {"X-Session-Id": "build-7", "Authorization": "Bearer k-bob"}
    status, _, headers = await post(http, url, chat(opening()), alice)
    assert status == 200
    owned = headers["X-Sessionfleet-Session"]
    # Bob knows the id: a turn and the final marker under it.
    for extra in ({}, {"X-Session-Final": "true"}):
        status, _, headers = await post(http, url, chat(opening()), bob | extra)
        assert status == 200 and headers["X-Sessionfleet-Session"] != owned
    await router.flusher.idle()
    await router.flusher.flush_all()
    session = fleet.kube.obj(SESSIONS.plural, owned)
    assert not session["spec"].get("finished")
    assert session["status"]["turns"] == 1  # bob's turns counted elsewhere
    assert served.count(owned) == 1  # and never reached alice's session on the engine
    # Alice still steers and ends her own.
    status, _, headers = await post(http, url, chat(opening()), alice | {"X-Session-Final": "1"})
    assert status == 200 and headers["X-Sessionfleet-Session"] == owned
    await until(lambda: bool(fleet.kube.obj(SESSIONS.plural, owned)["spec"].get("finished")))
