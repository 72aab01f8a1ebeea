"""The router under hostile and broken clients: every answer a 4xx of its own with the
documented body, memory bounded, new sessions limited, ownership kept, usage exact.

Real HTTP on 127.0.0.1 to a router in front of real simulated engines; the Kubernetes
API is the in-memory fake (e2e/test_router_limits.py runs the same against the real one).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from router_fleet import (
    MODEL,
    Fleet,
    chat,
    dies_mid_stream,
    opening,
    post,
    until,
    worker_object,
)

from sessionfleet.fronts.admission import (
    ApiKeys,
    AuthError,
    NewSessionLimiter,
    SessionRates,
)
from sessionfleet.fronts.identity import session_object_name
from sessionfleet.fronts.requester import TrustedProxies, parse_networks
from sessionfleet.kube import SESSIONS
from sessionfleet.router.limits import IntakeLimits
from sessionfleet.router.server import Router, RouterSettings, serve
from sessionfleet.simengine.cost import CostModel

NO_LIMITS = SessionRates(0, 0, 0, 0)


def keys_folder(tmp_path: Path, **clients: str) -> Path:
    folder = tmp_path / "keys"
    folder.mkdir(exist_ok=True)
    for client, key in clients.items():
        (folder / client).write_text(key + "\n")
    return folder


# --- bodies ---------------------------------------------------------------------------


async def test_compressed_bodies_are_refused_unread(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    await fleet.engine("w1")
    url, router = await fleet.router()
    bomb = gzip.compress(b'{"model": "' + MODEL.encode() + b'", "x": "' + b"a" * (50 << 20) + b'"}')
    async with http.post(
        url + "/v1/chat/completions",
        data=bomb,
        headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
    ) as r:
        body = await r.json()
        assert r.status == 415 and body["error"]["code"] == "unsupported_content_encoding"
    assert router.proxy.intake.budget.used == 0


@pytest.mark.parametrize(
    ("headers", "status", "code"),
    [
        ({"Content-Type": "multipart/form-data; boundary=x"}, 415, "unsupported_content_type"),
        ({"Content-Encoding": "br"}, 415, "unsupported_content_encoding"),
        ({"Content-Type": "application/json; charset=utf-8"}, 200, None),
        ({"Content-Type": "application/vnd.api+json"}, 200, None),
    ],
)
async def test_content_types_and_encodings(
    fleet: Fleet,
    http: aiohttp.ClientSession,
    headers: dict[str, str],
    status: int,
    code: str | None,
) -> None:
    await fleet.engine("w1")
    url, _ = await fleet.router()
    got, body, _ = await post(http, url, chat(opening()), headers)
    assert got == status and body.get("error", {}).get("code") == code


async def test_an_unannounced_body_over_the_limit_is_413(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    await fleet.engine("w1")
    url, router = await fleet.router(intake=IntakeLimits(max_body_bytes=10_000))

    async def chunks() -> Any:
        for _ in range(10):
            yield b" " * 4096

    async with http.post(url + "/v1/chat/completions", data=chunks()) as r:
        assert r.status == 413 and (await r.json())["error"]["code"] == "body_too_large"
    assert router.proxy.intake.budget.used == 0


async def test_bodies_in_flight_are_capped(fleet: Fleet) -> None:
    await fleet.engine("w1")
    limits = IntakeLimits(max_body_bytes=1000, max_inflight_body_bytes=2500, body_timeout=5)
    url, router = await fleet.router(intake=limits)
    host, port = url.removeprefix("http://").split(":")
    # Two slow clients announce 1,000-byte bodies and send none of them yet.
    slow = []
    for _ in range(2):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
        )
        await writer.drain()
        slow.append((reader, writer))
    await until(lambda: router.proxy.intake.budget.used == 2000)
    async with aiohttp.ClientSession() as http:
        big = chat([{"role": "user", "content": "x" * 600}])
        status, body, headers = await post(http, url, big)
    assert status == 503 and body["error"]["code"] == "router_busy"
    assert headers["Retry-After"] == "1"
    for _, writer in slow:
        writer.close()
    await until(lambda: router.proxy.intake.budget.used == 0)


async def test_a_slow_body_is_cut_off(fleet: Fleet) -> None:
    await fleet.engine("w1")
    url, router = await fleet.router(intake=IntakeLimits(body_timeout=0.3))
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    await writer.drain()
    started = time.monotonic()
    answer = await asyncio.wait_for(reader.read(4096), 5)
    assert answer.startswith(b"HTTP/1.1 408")
    assert b'"code": "body_timeout"' in answer
    assert time.monotonic() - started < 2
    writer.close()
    assert router.proxy.intake.budget.used == 0


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b'{"model":"\\q"}', "invalid_body"),
        (b'{"model":"\xff\xfe"}', "invalid_body"),
        (b"[" * 100_000 + b"]" * 100_000, "invalid_body"),
        (
            b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b', "model": 1, "model": 2}',
            "invalid_body",
        ),
        (b'{"a": {"model": "x"}, "b": {"model": "y"}}', "invalid_body"),
        (b"null", "invalid_body"),
        (b'"just a string"', "invalid_body"),
        (b'{"model": {"nested": true}}', "invalid_body"),
        (b'{"model": "' + b"m" * 300 + b'"}', "invalid_body"),
    ],
)
async def test_malformed_bodies_are_400(
    fleet: Fleet, http: aiohttp.ClientSession, body: bytes, code: str
) -> None:
    await fleet.engine("w1")
    url, _ = await fleet.router()
    status, answer, headers = await post(http, url, body, {"X-Session-Id": "m"})
    assert status == 400 and answer["error"]["code"] == code, answer
    assert headers["X-Sessionfleet-Reason"] == code


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        ({"X-Session-Id": "has space"}, "invalid_session_id"),
        ({"X-Session-Id": "x" * 300}, "invalid_session_id"),
        ({"X-Session-Id": "é"}, "invalid_session_id"),
        ({"X-Session-Final": "maybe", "X-Session-Id": "ok"}, "invalid_session_id"),
    ],
)
async def test_bad_session_headers_are_400(
    fleet: Fleet, http: aiohttp.ClientSession, headers: dict[str, str], code: str
) -> None:
    await fleet.engine("w1")
    url, _ = await fleet.router()
    status, answer, _ = await post(http, url, chat(opening()), headers)
    assert status == 400 and answer["error"]["code"] == code


async def test_a_header_that_is_not_utf8_is_400(fleet: Fleet) -> None:
    await fleet.engine("w1")
    url, _ = await fleet.router()
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(chat(opening())).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Note: \xff\xfe\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    answer = await asyncio.wait_for(reader.read(4096), 5)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    writer.close()


# --- new sessions ---------------------------------------------------------------------


def test_token_buckets() -> None:
    limiter = NewSessionLimiter(SessionRates(1, 2, 10, 3), now=0)
    assert [limiter.admit("a", 0) for _ in range(3)] == [0, 0, 1]
    assert limiter.admit("b", 0) == 0  # a's burst is spent, b has its own
    assert limiter.admit("c", 0) == 1  # the global burst of 3 is spent
    assert limiter.admit("a", 1.0) == 0  # one token a second
    unlimited = NewSessionLimiter(NO_LIMITS)
    assert all(unlimited.admit("a", 0) == 0 for _ in range(1000))
    with pytest.raises(ValueError):
        SessionRates(-1)


async def test_a_flood_of_new_sessions_is_limited_and_established_ones_are_not(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    await fleet.engine("w1")
    url, router = await fleet.router(session_rates=SessionRates(1, 5, 100, 100))
    status, _, _ = await post(http, url, chat(opening()), {"X-Session-Id": "established"})
    assert status == 200
    answers = await asyncio.gather(
        *(post(http, url, chat(opening()), {"X-Session-Id": f"flood-{n}"}) for n in range(30))
    )
    statuses = sorted(status for status, _, _ in answers)
    assert statuses.count(200) == 4 and statuses.count(429) == 26
    limited = next(a for a in answers if a[0] == 429)
    assert limited[1]["error"]["code"] == "too_many_new_sessions"
    assert int(limited[2]["Retry-After"]) >= 1
    assert len(fleet.kube.names(SESSIONS.plural)) == 5
    for _ in range(10):
        status, _, _ = await post(http, url, chat(opening()), {"X-Session-Id": "established"})
        assert status == 200


@pytest.mark.parametrize(
    ("trusted", "other_served"),
    [
        # Behind a trusted gateway each forwarded client has its own bucket.
        ("127.0.0.0/8", True),
        # The same X-Forwarded-For from a peer that is not a trusted proxy is ignored
        # (a client cannot choose its bucket): both count against the peer.
        ("10.9.9.0/24", False),
    ],
)
async def test_one_client_at_the_limit_does_not_stop_another_behind_a_gateway(
    fleet: Fleet, http: aiohttp.ClientSession, trusted: str, other_served: bool
) -> None:
    await fleet.engine("w1")
    proxies = TrustedProxies(parse_networks([trusted]))
    url, _ = await fleet.router(
        session_rates=SessionRates(0.001, 3, 100, 100), trusted_proxies=proxies
    )

    async def new_session(client: str, n: int) -> int:
        headers = {"X-Session-Id": f"{client}-{n}", "X-Forwarded-For": f"{client}, 127.0.0.1"}
        status, _, _ = await post(http, url, chat(opening()), headers)
        return status

    # One client opens new sessions as fast as it can: beyond its burst, 429.
    assert [await new_session("203.0.113.7", n) for n in range(6)] == [200] * 3 + [429] * 3
    other = await new_session("198.51.100.9", 0)
    assert other == (200 if other_served else 429)


async def test_a_session_whose_first_turn_failed_is_removed(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    from sessionfleet.kube import WORKERS

    fleet.kube.put(WORKERS.plural, worker_object("w1", "http://127.0.0.1:9"))
    url, router = await fleet.router()
    status, body, _ = await post(http, url, chat(opening()), {"X-Session-Id": "doomed"})
    assert status == 502
    await until(lambda: fleet.kube.deletes == 1)
    assert fleet.kube.names(SESSIONS.plural) == []
    assert router.metrics.sessions_created.labels("discarded")._value.get() == 1


# --- authentication and ownership -------------------------------------------------------


def test_api_keys_load_reload_and_refuse(tmp_path: Path) -> None:
    folder = keys_folder(tmp_path, alice="k-alice", bob="k-bob")
    (folder / "..data").mkdir()  # what a mounted Secret also holds
    keys = ApiKeys(folder)
    assert len(keys) == 2
    assert keys.client_of({"Authorization": "Bearer k-alice"}) == "alice"
    assert keys.client_of({"x-api-key": "k-bob"}) == "bob"
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic k-alice"}):
        with pytest.raises(AuthError):
            keys.client_of(headers)
    (folder / "bob").write_text("k-bob-2")
    import os

    os.utime(folder / "bob", (time.time() + 5, time.time() + 5))
    assert keys.reload() is True
    with pytest.raises(AuthError):
        keys.client_of({"x-api-key": "k-bob"})
    assert keys.client_of({"x-api-key": "k-bob-2"}) == "bob"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no API key"):
        ApiKeys(empty)


async def authenticated_router(fleet: Fleet, tmp_path: Path) -> tuple[str, Router]:
    folder = keys_folder(tmp_path, alice="k-alice", bob="k-bob")
    settings = RouterSettings(
        namespace="default", replica="auth", api_keys_dir=folder, flush_tick=3600
    )
    router = Router(fleet.kube, settings)  # type: ignore[arg-type]
    from aiohttp.test_utils import TestServer

    server = TestServer(router.app(), host="127.0.0.1")
    await server.start_server(**settings.server_options())
    fleet.servers.append(server)
    return str(server.make_url("")).rstrip("/"), router


async def test_authentication_and_session_ownership(
    fleet: Fleet, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    await fleet.engine("w1")
    await fleet.engine("w2")
    url, router = await authenticated_router(fleet, tmp_path)
    status, body, _ = await post(http, url, chat(opening()), {"X-Session-Id": "s"})
    assert status == 401 and body["error"]["code"] == "unauthorized"
    assert fleet.kube.creates == 0
    alice = {"X-Session-Id": "same", "Authorization": "Bearer k-alice"}
    bob = {"X-Session-Id": "same", "x-api-key": "k-bob"}
    assert (await post(http, url, chat(opening()), alice))[0] == 200
    assert (await post(http, url, chat(opening()), bob))[0] == 200
    # One id, two clients: two sessions, each labelled with its owner.
    names = {session_object_name("same", "alice"), session_object_name("same", "bob")}
    assert set(fleet.kube.names(SESSIONS.plural)) == names
    owners = {
        fleet.kube.obj(SESSIONS.plural, n)["metadata"]["labels"]["sessionfleet.dev/owner"]
        for n in names
    }
    assert owners == {"alice", "bob"}
    # An object planted under alice's name for another id, or without her label, is
    # never used to route her turns.
    planted = session_object_name("planted", "alice")
    fleet.kube.put(
        SESSIONS.plural,
        {
            "metadata": {"name": planted},
            "spec": {"sessionId": "planted", "model": MODEL, "workerPin": "w2"},
            "status": {"phase": "Bound", "worker": "w2"},
        },
    )
    await until(lambda: router.table.session_named(planted) is not None)
    status, body, _ = await post(
        http, url, chat(opening()), {"X-Session-Id": "planted", "Authorization": "Bearer k-alice"}
    )
    assert status == 409 and body["error"]["code"] == "session_name_collision"


async def test_credentials_do_not_reach_the_worker(
    fleet: Fleet, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    seen: list[dict[str, str]] = []

    async def echo(request: aiohttp.web.Request) -> aiohttp.web.Response:
        seen.append(dict(request.headers))
        return aiohttp.web.json_response({"usage": {"prompt_tokens": 1, "completion_tokens": 1}})

    await fleet.fake_engine("w1", echo)
    url, _ = await authenticated_router(fleet, tmp_path)
    headers = {"Authorization": "Bearer k-alice", "x-api-key": "k-alice"}
    assert (await post(http, url, chat(opening()), headers))[0] == 200
    assert seen and not {"Authorization", "X-Api-Key"} & set(seen[0])


# --- streams and accounting ------------------------------------------------------------


async def test_a_client_that_leaves_mid_stream_is_counted_as_served(fleet: Fleet) -> None:
    await fleet.engine("w1", cost=CostModel(decode_seconds_per_token=0.005))
    url, router = await fleet.router()
    body = chat(opening(), stream=True, stream_options={"include_usage": True}, max_tokens=400)
    async with aiohttp.ClientSession() as http:
        async with http.post(
            url + "/v1/chat/completions", json=body, headers={"X-Session-Id": "leaver"}
        ) as r:
            assert r.status == 200
            await r.content.readany()
            r.close()  # the client goes away mid-answer
    name = session_object_name("leaver")
    await until(lambda: router.ledger.pending(name) is not None)
    pending = router.ledger.pending(name)
    assert pending is not None and pending.turns == 1
    text = router.metrics.registry.get_sample_value(
        "sessionfleet_router_requests_total", {"route": "session", "code": "499"}
    )
    assert text == 1
    assert (
        router.metrics.registry.get_sample_value(
            "sessionfleet_router_requests_total", {"route": "session", "code": "502"}
        )
        is None
    )


async def test_a_broken_stream_ends_with_a_json_error_frame(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    await fleet.fake_engine("w1", dies_mid_stream(b'data: {"choices": []}\n\n'))
    url, router = await fleet.router()
    async with http.post(url + "/v1/chat/completions", json=chat(opening(), stream=True)) as r:
        raw = await r.read()
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
    assert json.loads(events[-1])["error"]["code"] == "upstream_error"
    assert (
        router.metrics.registry.get_sample_value(
            "sessionfleet_router_requests_total", {"route": "stateless", "code": "502"}
        )
        == 1
    )


# --- supervision and connections -------------------------------------------------------


async def test_a_dead_background_task_fails_readiness_and_the_process(fleet: Fleet) -> None:
    await fleet.engine("w1")
    url, router = await fleet.router()
    async with aiohttp.ClientSession() as http:
        await until(lambda: router.table.synced)
        async with http.get(url + "/readyz") as r:
            assert r.status == 200

        async def dies() -> None:
            raise RuntimeError("watch broke for good")

        router.supervisor.start("test task", dies())
        await until(lambda: router.supervisor.failure is not None)
        async with http.get(url + "/readyz") as r:
            assert r.status == 503 and "test task" in await r.text()


async def test_serve_exits_non_zero_when_a_task_dies(fleet: Fleet) -> None:
    settings = RouterSettings(namespace="default", replica="x")

    class Broken(type(fleet.kube)):  # type: ignore[misc]
        async def list(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("the watch cannot start")

    broken = Broken()
    port = free_port()
    status = await asyncio.wait_for(serve(broken, settings, "127.0.0.1", port), 10)
    assert status == 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def connect_when_listening(
    port: int, timeout: float = 10
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Return the first connection the server accepts (it is still starting)."""
    async with asyncio.timeout(timeout):
        while True:
            try:
                return await asyncio.open_connection("127.0.0.1", port)
            except ConnectionRefusedError:
                await asyncio.sleep(0.02)


async def test_connections_beyond_the_limit_are_refused_and_idle_ones_closed(
    fleet: Fleet,
) -> None:
    await fleet.engine("w1")
    settings = RouterSettings(namespace="default", replica="x", max_connections=2, idle_timeout=0.5)
    port = free_port()
    stop = asyncio.create_task(serve(fleet.kube, settings, "127.0.0.1", port))  # type: ignore[arg-type]
    held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        held.append(await connect_when_listening(port))
        held.append(await asyncio.open_connection("127.0.0.1", port))
        await asyncio.sleep(0.05)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        answer = await asyncio.wait_for(reader.read(4096), 5)
        assert answer.startswith(b"HTTP/1.1 503") and b"too_many_connections" in answer
        writer.close()
        await writer.wait_closed()
        # A connection that never completes its headers is closed at the idle timeout.
        reader, writer = held[0]
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost:")
        # Closed (b""), not left open until the wait gives up (TimeoutError).
        assert await asyncio.wait_for(reader.read(4096), 5) == b""
    finally:
        for _, held_writer in held:
            held_writer.close()
            await held_writer.wait_closed()
        stop.cancel()
        await asyncio.gather(stop, return_exceptions=True)


def test_refusals_of_malformed_http_are_kept_out_of_the_error_log() -> None:
    import logging

    from aiohttp.http_exceptions import BadHttpMessage

    from sessionfleet.router.server import QuietRefusals

    def record(error: BaseException | None) -> logging.LogRecord:
        exc_info = (type(error), error, None) if error is not None else None
        return logging.LogRecord(
            "aiohttp.server", logging.ERROR, __file__, 1, "Error handling request", (), exc_info
        )

    quiet = QuietRefusals()
    refused = record(BadHttpMessage("Invalid method encountered"))
    assert quiet.filter(refused) is False  # DEBUG is off for aiohttp.server here
    assert refused.levelno == logging.DEBUG and refused.exc_info is None
    bug = record(RuntimeError("a handler bug"))
    assert quiet.filter(bug) is True and bug.levelno == logging.ERROR
