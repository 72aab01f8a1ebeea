"""The API client's requests over a real socket: what the server receives and what comes back.

Requests go straight to the connection pool (not through an httpx client), so the URL,
query, headers and decoding the client used to do are the client's own: checked here
against an aiohttp server, and against the real API server throughout e2e/.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from sessionfleet.kube import PODS, SESSIONS, ApiUnavailable, Conflict, NotFound, NotLeading
from sessionfleet.kube.client import Kube, environment_proxy
from sessionfleet.kube.config import KubeConfig


@pytest.fixture
async def server() -> AsyncIterator[tuple[TestServer, list[dict[str, Any]]]]:
    """Record every request; answer a status PATCH (gzip), a pod list, a 409 and a 404."""
    seen: list[dict[str, Any]] = []

    async def record(request: web.Request) -> dict[str, Any]:
        entry = {
            "method": request.method,
            "path": request.path,
            "query": dict(request.query),
            "headers": dict(request.headers),
            "body": await request.read(),
        }
        seen.append(entry)
        return entry

    async def patch_status(request: web.Request) -> web.Response:
        entry = await record(request)
        patch = json.loads(entry["body"])
        if patch["metadata"]["resourceVersion"] != "7":
            return web.json_response(
                {"kind": "Status", "code": 409, "reason": "Conflict", "message": "changed"},
                status=409,
            )
        answer = {"metadata": {"name": "s1", "resourceVersion": "8"}, "status": patch["status"]}
        response = web.json_response(answer)
        response.enable_compression(web.ContentCoding.gzip)
        return response

    async def list_pods(request: web.Request) -> web.Response:
        await record(request)
        return web.json_response({"items": [], "metadata": {"resourceVersion": "5"}})

    async def missing(request: web.Request) -> web.Response:
        await record(request)
        return web.json_response(
            {"kind": "Status", "code": 404, "reason": "NotFound", "message": "no such pod"},
            status=404,
        )

    app = web.Application()
    app.router.add_patch(SESSIONS.path("ns", "s1") + "/status", patch_status)
    app.router.add_get(PODS.path("ns"), list_pods)
    app.router.add_get(PODS.path("ns", "gone"), missing)
    test_server = TestServer(app, host="127.0.0.1")
    await test_server.start_server()
    yield test_server, seen
    await test_server.close()


def client(server: TestServer, **kw: Any) -> Kube:
    config = KubeConfig(server=str(server.make_url("")).rstrip("/") + "/", token="t0k3n")
    return Kube(config, user_agent="sessionfleet-test", **kw)


async def test_a_status_patch_arrives_whole_and_its_gzipped_answer_is_read(
    server: tuple[TestServer, list[dict[str, Any]]],
) -> None:
    test_server, seen = server
    async with client(test_server) as kube:
        answer = await kube.patch(
            SESSIONS, "s1", {"status": {"phase": "Bound"}}, "ns", status=True, resource_version=7
        )
    assert answer == {
        "metadata": {"name": "s1", "resourceVersion": "8"},
        "status": {"phase": "Bound"},
    }
    sent = seen[0]
    assert sent["method"] == "PATCH"
    assert sent["path"] == "/apis/sessionfleet.dev/v1alpha1/namespaces/ns/agentsessions/s1/status"
    assert sent["query"] == {"fieldManager": "sessionfleet"}
    headers = sent["headers"]
    assert headers["Content-Type"] == "application/merge-patch+json"
    assert headers["Authorization"] == "Bearer t0k3n"
    assert headers["User-Agent"] == "sessionfleet-test"
    assert headers["Accept"] == "application/json" and "gzip" in headers["Accept-Encoding"]
    assert headers["Host"] == f"127.0.0.1:{test_server.port}"
    assert json.loads(sent["body"]) == {
        "status": {"phase": "Bound"},
        "metadata": {"resourceVersion": "7"},
    }


async def test_selectors_and_continue_tokens_reach_the_server_as_written(
    server: tuple[TestServer, list[dict[str, Any]]],
) -> None:
    test_server, seen = server
    async with client(test_server) as kube:
        items, version = await kube.list(
            PODS, "ns", label_selector="sessionfleet.dev/worker,app!=x", field_selector="a=b"
        )
    assert (items, version) == ([], "5")
    assert seen[0]["query"] == {
        "limit": "500",
        "labelSelector": "sessionfleet.dev/worker,app!=x",
        "fieldSelector": "a=b",
    }


async def test_refusals_become_the_errors_callers_handle(
    server: tuple[TestServer, list[dict[str, Any]]],
) -> None:
    test_server, _ = server
    async with client(test_server) as kube:
        with pytest.raises(Conflict, match="changed"):
            await kube.patch(SESSIONS, "s1", {"status": {}}, "ns", status=True, resource_version=6)
        with pytest.raises(NotFound, match="no such pod"):
            await kube.get(PODS, "gone", "ns")
    async with client(test_server, write_gate=lambda: False) as kube:
        with pytest.raises(NotLeading):
            await kube.patch(SESSIONS, "s1", {"status": {}}, "ns", status=True)
        assert (await kube.list(PODS, "ns"))[1] == "5"  # reads pass the gate


async def test_a_server_that_is_gone_is_unavailable(
    server: tuple[TestServer, list[dict[str, Any]]],
) -> None:
    test_server, _ = server
    kube = client(test_server)
    await test_server.close()
    async with kube:
        with pytest.raises(ApiUnavailable, match="GET /api/v1/namespaces/ns/pods"):
            await kube.list(PODS, "ns")


def test_the_environment_names_the_proxy_and_no_proxy_bypasses_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("HTTPS_PROXY", "https_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    assert environment_proxy("https://127.0.0.1:6443") is None
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.corp:3128")
    assert environment_proxy("https://127.0.0.1:6443") == "http://proxy.corp:3128"
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,.svc")
    assert environment_proxy("https://127.0.0.1:6443") is None
    assert environment_proxy("https://kubernetes.default.svc") is None
    assert environment_proxy("https://api.example.com:6443") == "http://proxy.corp:3128"


async def test_requests_beyond_the_limit_wait_their_turn_and_watches_never_wait_behind_them() -> (
    None
):
    """At most ``max_in_flight`` requests are open at the server; watches have a pool apart."""
    open_now = 0
    most_open = 0
    release = asyncio.Event()

    async def slow_get(request: web.Request) -> web.Response:
        nonlocal open_now, most_open
        open_now += 1
        most_open = max(most_open, open_now)
        await release.wait()
        open_now -= 1
        return web.json_response({"metadata": {"name": request.match_info["name"]}})

    async def watch(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        event = {"type": "ADDED", "object": {"metadata": {"name": "w"}}}
        await response.write(json.dumps(event).encode() + b"\n")
        await asyncio.sleep(30)  # a watch stays open
        return response

    app = web.Application()
    app.router.add_get(PODS.path("ns") + "/{name}", slow_get)
    app.router.add_get(SESSIONS.path("ns"), watch)
    test_server = TestServer(app, host="127.0.0.1")
    await test_server.start_server()
    try:
        async with client(test_server, max_in_flight=3) as kube:
            watches = [kube.watch(SESSIONS, "ns") for _ in range(5)]
            for events in watches:  # five watches open: more than the requests' limit
                event = await asyncio.wait_for(anext(events), 5)
                assert event == ("ADDED", {"metadata": {"name": "w"}})
            gets = [asyncio.create_task(kube.get(PODS, f"p{i}", "ns")) for i in range(12)]
            await asyncio.sleep(0.3)
            assert (open_now, most_open) == (3, 3)
            release.set()
            answers = await asyncio.wait_for(asyncio.gather(*gets), 10)
            assert [a["metadata"]["name"] for a in answers] == [f"p{i}" for i in range(12)]
            assert most_open == 3
            for events in watches:
                await events.aclose()
    finally:
        await test_server.close()


@pytest.fixture
async def held_writes() -> AsyncIterator[tuple[TestServer, list[str], asyncio.Event]]:
    """A server whose pod PATCHes wait until the event is set; it records their names."""
    landed: list[str] = []
    release = asyncio.Event()

    async def patch(request: web.Request) -> web.Response:
        landed.append(request.match_info["name"])
        await release.wait()
        return web.json_response({"metadata": {"name": request.match_info["name"]}})

    app = web.Application()
    app.router.add_patch(PODS.path("ns") + "/{name}", patch)
    test_server = TestServer(app, host="127.0.0.1")
    await test_server.start_server()
    yield test_server, landed, release
    release.set()
    await test_server.close()


async def test_a_write_that_waited_in_the_queue_is_not_sent_once_the_gate_has_closed(
    held_writes: tuple[TestServer, list[str], asyncio.Event],
) -> None:
    """The gate is asked again when a write has its turn: admission alone is not enough."""
    test_server, landed, release = held_writes
    leading = True
    async with client(test_server, max_in_flight=1, write_gate=lambda: leading) as kube:
        first = asyncio.create_task(kube.patch(PODS, "first", {"metadata": {}}, "ns"))
        while not landed:
            await asyncio.sleep(0.01)
        queued = asyncio.create_task(kube.patch(PODS, "queued", {"metadata": {}}, "ns"))
        await asyncio.sleep(0.1)  # admitted (the gate was open), waiting for the one slot
        leading = False
        release.set()
        assert (await first)["metadata"]["name"] == "first"
        with pytest.raises(NotLeading):
            await queued
    assert landed == ["first"]


async def test_a_write_lives_no_longer_than_its_bound_and_the_server_is_told_the_deadline(
    held_writes: tuple[TestServer, list[str], asyncio.Event],
) -> None:
    """``write_timeout`` bounds queue, connection, sending and answer; reads keep theirs."""
    test_server, landed, _ = held_writes
    async with client(test_server, write_gate=lambda: True, write_timeout=0.5) as kube:
        with pytest.raises(ApiUnavailable, match="no answer within 0.5 s"):
            await asyncio.wait_for(kube.patch(PODS, "slow", {"metadata": {}}, "ns"), 5)
    assert landed == ["slow"]


async def test_the_api_server_is_given_the_writes_deadline(
    server: tuple[TestServer, list[dict[str, Any]]],
) -> None:
    """A write waiting in the API server's own queues past the bound is not done there."""
    test_server, seen = server
    async with client(test_server, write_gate=lambda: True, write_timeout=4.0) as kube:
        await kube.patch(
            SESSIONS, "s1", {"status": {"phase": "Active"}}, "ns", status=True, resource_version=7
        )
        await kube.list(PODS, "ns")
    assert seen[0]["query"]["timeout"] == "4s"
    assert "timeout" not in seen[1]["query"]  # reads: a LIST may take long, and writes nothing
