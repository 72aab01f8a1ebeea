"""The router over real HTTP on 127.0.0.1, in front of real simulated engines.

The Kubernetes API is the in-memory fake of ``router_fakes``; e2e/test_router*.py runs
the same flows against a real API server with the router and engines as processes.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import aiohttp
import pytest
from router_fleet import MODEL, Fleet, chat, opening, post, until, worker_object

from sessionfleet.fronts.identity import HeaderConfig, session_object_name
from sessionfleet.kube import SESSIONS, WORKERS
from sessionfleet.router.limits import IntakeLimits
from sessionfleet.router.proxy import SESSION_HEADER, WORKER_HEADER


async def test_a_session_sticks_and_its_usage_is_written(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    await fleet.engine("w1")
    await fleet.engine("w2")
    url, router = await fleet.router()
    messages = opening()
    workers, cached, prompts = set(), [], []
    for turn in range(4):
        status, body, headers = await post(http, url, chat(messages), {"X-Session-Id": "s-1"})
        assert status == 200, body
        workers.add(headers[WORKER_HEADER])
        assert headers[SESSION_HEADER] == session_object_name("s-1")
        cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
        prompts.append(body["usage"]["prompt_tokens"])
        messages += [
            {"role": "assistant", "content": body["choices"][0]["message"]["content"]},
            {"role": "user", "content": f"result {turn}: " + "passed " * 20},
        ]
    assert len(workers) == 1
    assert cached[0] == 0 and cached == sorted(cached) and cached[-1] > cached[1] > 0

    name = session_object_name("s-1")
    spec = fleet.kube.obj(SESSIONS.plural, name)["spec"]
    assert spec == {
        "sessionId": "s-1",
        "model": MODEL,
        "client": "Header",
        "workerHint": workers.pop(),
    }
    # Four turns, no write yet (the interval is 60 s and the flush loop has not run).
    assert not [p for p in fleet.kube.patches if p[2]]
    await router.flusher.flush_all()
    status = fleet.kube.obj(SESSIONS.plural, name)["status"]
    assert status["turns"] == 4
    assert status["promptTokens"] == sum(prompts)
    assert status["cachedTokens"] == sum(cached)
    assert status["recomputedTokens"] == sum(
        p - c for p, c in zip(prompts[1:], cached[1:], strict=True)
    )
    assert status["hitRatePercent"] == round(100 * sum(cached) / sum(prompts), 2)
    assert "lastActivity" in status
    assert len([p for p in fleet.kube.patches if p[2]]) == 1


async def test_streams_pass_through_and_report_usage(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    engine = await fleet.engine("w1")
    url, router = await fleet.router()
    body = chat(opening(), stream=True, stream_options={"include_usage": True}, max_tokens=30)

    async def raw(base: str, headers: dict[str, str]) -> tuple[bytes, list[bytes]]:
        async with http.post(base + "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            chunks = [chunk async for chunk in r.content.iter_any()]
        return b"".join(chunks), chunks

    direct, _ = await raw(engine, {})
    routed, _ = await raw(url, {"X-Session-Id": "stream-1"})

    def shape(stream: bytes) -> list[Any]:
        events = [e.removeprefix(b"data: ") for e in stream.split(b"\n\n") if e]
        assert events[-1] == b"[DONE]"
        return [
            {k: v for k, v in json.loads(e).items() if k not in ("id", "created")}
            for e in events[:-1]
        ]

    direct_events, routed_events = shape(direct), shape(routed)
    assert len(routed_events) == len(direct_events) == 1 + 30 + 1 + 1
    # Same reply text; the routed turn hit the cache the direct one filled.
    assert [e["choices"] for e in routed_events[:-1]] == [e["choices"] for e in direct_events[:-1]]
    assert routed_events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    pending = router.ledger.pending(session_object_name("stream-1"))
    assert pending is not None and pending.turns == 1
    assert (
        pending.cached_tokens
        == routed_events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    )


async def test_a_700kb_body_passes_unchanged(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    engine = await fleet.engine("w1")
    url, _ = await fleet.router()
    content = "def handler(event):\n    return {'ok': True}  # \u00e9\u00e8\n" * 15000
    raw = json.dumps(chat([{"role": "user", "content": content}]), ensure_ascii=False).encode()
    assert len(raw) > 700_000
    _, direct, _ = await post(http, engine, raw)
    # Sent as curl sends large bodies: Expect: 100-continue.
    async with http.post(
        url + "/v1/chat/completions", data=raw, headers={"X-Session-Id": "big"}, expect100=True
    ) as answer:
        status, routed = answer.status, await answer.json()
    assert status == 200
    assert routed["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"] > 170_000
    assert routed["choices"] == direct["choices"]


async def test_requests_without_a_session_spread(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    await fleet.engine("w1")
    await fleet.engine("w2")
    url, _ = await fleet.router()
    seen = set()
    for _ in range(6):
        status, _, headers = await post(http, url, chat(opening()))
        assert status == 200
        seen.add(headers[WORKER_HEADER])
        assert SESSION_HEADER not in headers
    assert seen == {"w1", "w2"}
    assert fleet.kube.names(SESSIONS.plural) == []


async def test_a_side_request_for_another_model_is_stateless(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    await fleet.engine("w1")
    fleet.kube.put(WORKERS.plural, worker_object("small", "http://127.0.0.1:9", model="small"))
    url, _ = await fleet.router()
    await post(http, url, chat(opening()), {"x-claude-code-session-id": "cc"})
    status, body, headers = await post(
        http, url, {"model": "small", "messages": []}, {"x-claude-code-session-id": "cc"}
    )
    # Routed to the small model's worker (which is down here), not to the session's.
    assert status == 502 and body["error"]["code"] == "upstream_unreachable"
    assert "small" in body["error"]["message"]
    assert fleet.kube.obj(SESSIONS.plural, session_object_name("cc"))["spec"]["client"] == (
        "ClaudeCode"
    )


async def test_a_child_starts_on_its_parents_worker(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    await fleet.engine("w1")
    await fleet.engine("w2")
    url, _ = await fleet.router()
    _, _, headers = await post(http, url, chat(opening()), {"X-Session-Id": "parent"})
    parent_worker = headers[WORKER_HEADER]
    # The other worker is now the least loaded; the child still joins its parent.
    for _ in range(2):
        _, _, headers = await post(
            http,
            url,
            chat(opening("subtask")),
            {"X-Session-Id": f"child-{_}", "X-Parent-Session-Id": "parent"},
        )
        assert headers[WORKER_HEADER] == parent_worker
    spec = fleet.kube.obj(SESSIONS.plural, session_object_name("child-0"))["spec"]
    assert spec["parentSessionId"] == "parent" and spec["workerHint"] == parent_worker


async def test_the_final_turn_finishes_the_session(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    await fleet.engine("w1")
    url, router = await fleet.router()
    await post(http, url, chat(opening()), {"X-Session-Id": "done"})
    status, _, _ = await post(
        http, url, chat(opening()), {"X-Session-Id": "done", "X-Session-Final": "true"}
    )
    assert status == 200
    name = session_object_name("done")
    await until(lambda: fleet.kube.obj(SESSIONS.plural, name)["spec"].get("finished") is True)
    assert fleet.kube.obj(SESSIONS.plural, name)["status"]["turns"] == 2
    # Once the operator marks it Finished, more turns are refused.
    obj = fleet.kube.obj(SESSIONS.plural, name)
    obj["status"]["phase"] = "Finished"
    fleet.kube.put(SESSIONS.plural, obj)
    await until(lambda: (router.table.session_named(name) or obj).phase == "Finished")  # type: ignore[attr-defined]
    status, body, headers = await post(http, url, chat(opening()), {"X-Session-Id": "done"})
    assert status == 409 and body["error"]["code"] == "session_finished"
    assert headers["X-Sessionfleet-Reason"] == "session_finished"
    # No retry cures it: the OpenAI and Anthropic SDKs, which retry 409s, are told so.
    assert headers["x-should-retry"] == "false"


async def test_a_migrating_session_is_held_then_released(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    await fleet.engine("w1")
    await fleet.engine("w2")
    url, router = await fleet.router(hold_timeout=10)
    _, _, headers = await post(http, url, chat(opening()), {"X-Session-Id": "mover"})
    source = headers[WORKER_HEADER]
    target = "w2" if source == "w1" else "w1"
    name = session_object_name("mover")
    obj = fleet.kube.obj(SESSIONS.plural, name)
    obj["status"].update({"phase": "Migrating", "worker": source})
    fleet.kube.put(SESSIONS.plural, obj)
    await until(lambda: router.table.session_named(name).phase == "Migrating")  # type: ignore[union-attr]
    turn = asyncio.ensure_future(post(http, url, chat(opening()), {"X-Session-Id": "mover"}))
    done, _ = await asyncio.wait({turn}, timeout=0.3)
    assert not done, "a Migrating session's turn was not held"
    assert router.metrics.held._value.get() == 1
    obj = fleet.kube.obj(SESSIONS.plural, name)
    obj["status"].update({"phase": "Bound", "worker": target})
    fleet.kube.put(SESSIONS.plural, obj)
    status, _, headers = await asyncio.wait_for(turn, 5)
    assert status == 200 and headers[WORKER_HEADER] == target


async def test_a_held_turn_times_out_with_a_reason(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    await fleet.engine("w1")
    url, router = await fleet.router(hold_timeout=0.2, retry_after=7)
    await post(http, url, chat(opening()), {"X-Session-Id": "stuck"})
    name = session_object_name("stuck")
    obj = fleet.kube.obj(SESSIONS.plural, name)
    obj["status"].update({"phase": "Restoring", "worker": "w1"})
    fleet.kube.put(SESSIONS.plural, obj)
    await until(lambda: router.table.session_named(name).phase == "Restoring")  # type: ignore[union-attr]
    status, body, headers = await post(http, url, chat(opening()), {"X-Session-Id": "stuck"})
    assert status == 503 and headers["Retry-After"] == "7"
    assert body["error"]["code"] == "session_held"
    assert "is Restoring" in body["error"]["message"]


@pytest.mark.parametrize(
    ("body", "headers", "status", "code"),
    [
        (b"{not json", {}, 400, "invalid_body"),
        (b"[1, 2]", {}, 400, "invalid_body"),
        (json.dumps({"messages": []}).encode(), {}, 400, "invalid_body"),
        (
            json.dumps(chat(opening())).encode(),
            {"X-Session-Id": "with space"},
            400,
            "invalid_session_id",
        ),
        (
            json.dumps({"model": "nobody-serves-this", "messages": []}).encode(),
            {},
            404,
            "model_not_found",
        ),
        (
            json.dumps({"model": "nobody-serves-this", "messages": []}).encode(),
            {"X-Session-Id": "x"},
            404,
            "model_not_found",
        ),
    ],
)
async def test_bad_requests_get_clear_errors(
    fleet: Fleet,
    http: aiohttp.ClientSession,
    body: bytes,
    headers: dict[str, str],
    status: int,
    code: str,
) -> None:
    await fleet.engine("w1")
    url, _ = await fleet.router()
    got, answer, answer_headers = await post(http, url, body, headers)
    assert got == status
    assert answer["error"]["code"] == code and answer["error"]["message"]
    assert answer_headers["X-Sessionfleet-Reason"] == code


async def test_engine_errors_pass_through(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    await fleet.engine("w1")
    url, _ = await fleet.router()
    status, body, headers = await post(http, url, chat([]), {"X-Session-Id": "e"})
    assert status == 400 and "messages must be a non-empty list" in body["error"]["message"]
    assert headers[WORKER_HEADER] == "w1"


async def test_methods_paths_and_sizes(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    await fleet.engine("w1")
    url, _ = await fleet.router(intake=IntakeLimits(max_body_bytes=1000))
    async with http.get(url + "/v1/chat/completions") as r:
        assert r.status == 405 and (await r.json())["error"]["code"] == "method_not_allowed"
    async with http.post(url + "/nowhere", json={}) as r:
        assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"
    status, body, _ = await post(http, url, chat([{"role": "user", "content": "x" * 2000}]))
    assert status == 413 and body["error"]["code"] == "body_too_large"
    async with http.get(url + "/v1/models") as r:
        assert [m["id"] for m in (await r.json())["data"]] == [MODEL]
    async with http.get(url + f"/v1/models/{MODEL}") as r:
        assert r.status == 200 and (await r.json())["id"] == MODEL
    async with http.get(url + "/v1/models/org/unknown-model") as r:
        assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"


async def test_no_ready_worker_and_unreachable_worker(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    fleet.kube.put(WORKERS.plural, worker_object("w1", "http://127.0.0.1:9", phase="Starting"))
    url, router = await fleet.router()
    status, body, headers = await post(http, url, chat(opening()), {"X-Session-Id": "a"})
    assert status == 503 and body["error"]["code"] == "no_ready_worker"
    assert headers["Retry-After"] == "5"
    fleet.kube.put(WORKERS.plural, worker_object("w1", "http://127.0.0.1:9"))
    await until(lambda: router.table.workers["w1"].ready)
    status, body, _ = await post(http, url, chat(opening()), {"X-Session-Id": "a"})
    assert status == 502 and body["error"]["code"] == "upstream_unreachable"


async def test_a_create_conflict_adopts_the_other_routers_choice(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    await fleet.engine("w1")
    await fleet.engine("w2")
    url, router = await fleet.router()
    await until(lambda: router.table.synced)
    # Another replica won the race: its object exists, this replica has not seen it yet.
    name = session_object_name("raced")
    fleet.kube.objects[(SESSIONS.plural, name)] = {
        "metadata": {"name": name, "resourceVersion": "999"},
        "spec": {"sessionId": "raced", "model": MODEL, "workerHint": "w2"},
        "status": {},
    }
    for _ in range(3):
        status, _, headers = await post(http, url, chat(opening()), {"X-Session-Id": "raced"})
        assert status == 200 and headers[WORKER_HEADER] == "w2"
    assert router.metrics.sessions_created.labels("adopted")._value.get() == 1


async def test_two_routers_agree_and_count_every_turn(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    await fleet.engine("w1")
    await fleet.engine("w2")
    url_a, router_a = await fleet.router()
    url_b, router_b = await fleet.router()
    results = await asyncio.gather(
        *(
            post(http, url, chat(opening()), {"X-Session-Id": "shared"})
            for url in (url_a, url_b, url_a, url_b)
        )
    )
    assert {headers[WORKER_HEADER] for _, _, headers in results} == {
        fleet.kube.obj(SESSIONS.plural, session_object_name("shared"))["spec"]["workerHint"]
    }
    await asyncio.gather(router_a.flusher.flush_all(), router_b.flusher.flush_all())
    # The two replicas raced on the status: the conditional writes kept every turn.
    status = fleet.kube.obj(SESSIONS.plural, session_object_name("shared"))["status"]
    assert status["turns"] == 4
    assert fleet.kube.creates <= 2


async def test_a_restarted_router_keeps_the_bindings(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    for name in ("w1", "w2", "w3"):
        await fleet.engine(name)
    url, _ = await fleet.router()
    first = {}
    for n in range(6):
        _, _, headers = await post(http, url, chat(opening()), {"X-Session-Id": f"s{n}"})
        first[f"s{n}"] = headers[WORKER_HEADER]
    assert len(set(first.values())) == 3
    url, _ = await fleet.router()  # a fresh replica: empty memory, same API
    for sid, worker in first.items():
        _, _, headers = await post(http, url, chat(opening()), {"X-Session-Id": sid})
        assert headers[WORKER_HEADER] == worker


async def test_metrics_readiness_and_custom_headers(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    await fleet.engine("w1")
    url, router = await fleet.router(headers=HeaderConfig(session_header="X-Agent"))
    await until(lambda: router.table.synced)
    async with http.get(url + "/readyz") as r:
        assert r.status == 200
    _, _, headers = await post(http, url, chat(opening()), {"X-Agent": "custom"})
    assert headers[SESSION_HEADER] == session_object_name("custom")
    await post(http, url, chat(opening()), {"X-Agent": "custom"})
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    for line in (
        'sessionfleet_router_requests_total{code="200",route="session"} 2.0',
        "sessionfleet_router_added_latency_seconds_count",
        "sessionfleet_router_in_flight_requests 0.0",
        "sessionfleet_router_held_turns 0.0",
        'sessionfleet_router_worker_cache_hit_ratio{worker="w1"}',
        'sessionfleet_router_sessions_created_total{outcome="created"} 1.0',
    ):
        assert line in text, line


async def test_writes_are_spread_over_ticks(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    await fleet.engine("w1")
    url, router = await fleet.router()
    answers = await asyncio.gather(
        *(post(http, url, chat(opening()), {"X-Session-Id": f"burst-{n}"}) for n in range(6))
    )
    assert all(status == 200 for status, _, _ in answers)
    # Six sessions are due at once; 8 writes per second and a 0.25 s tick: two per tick.
    assert router.flusher.start_due(0.25) == 2
    await router.flusher.idle()
    assert len([p for p in fleet.kube.patches if p[2]]) == 2
    assert router.flusher.start_due(0.25) == 2
    await router.flusher.flush_all()
    written = [fleet.kube.obj(SESSIONS.plural, session_object_name(f"burst-{n}")) for n in range(6)]
    assert all(obj["status"]["turns"] == 1 for obj in written)
    assert router.flusher.start_due(0.25) == 0


async def test_a_ticks_writes_start_one_by_one_across_the_tick(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    """Not in a burst: each waits its share of the tick after the one before it."""
    await fleet.engine("w1")
    url, router = await fleet.router()
    answers = await asyncio.gather(
        *(post(http, url, chat(opening()), {"X-Session-Id": f"paced-{n}"}) for n in range(4))
    )
    assert all(status == 200 for status, _, _ in answers)
    loop = asyncio.get_running_loop()
    sent_at: list[float] = []
    patch = fleet.kube.patch

    async def timed_patch(*args: Any, **kwargs: Any) -> dict[str, Any]:
        sent_at.append(loop.time())
        return await patch(*args, **kwargs)

    fleet.kube.patch = timed_patch  # type: ignore[method-assign]
    # 8 writes per second and a 0.5 s tick: four due, one every 0.125 s.
    pacing = asyncio.create_task(router.flusher.run(tick=0.5))
    try:
        async with asyncio.timeout(10):
            while len(sent_at) < 4:
                await asyncio.sleep(0.01)
    finally:
        pacing.cancel()
    gaps = [later - earlier for earlier, later in itertools.pairwise(sent_at)]
    assert all(gap >= 0.1 for gap in gaps), gaps


async def test_a_lost_session_continues_on_a_ready_worker(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    await fleet.engine("w1")
    await fleet.engine("w2")
    url_a, router_a = await fleet.router()
    url_b, router_b = await fleet.router()
    name = session_object_name("orphan")
    fleet.kube.put(
        SESSIONS.plural,
        {
            "metadata": {"name": name},
            "spec": {"sessionId": "orphan", "model": MODEL},
            "status": {"phase": "Lost", "worker": "deleted-worker"},
        },
    )
    await until(lambda: all(r.table.session_named(name) is not None for r in (router_a, router_b)))
    answers = [
        await post(http, url, chat(opening()), {"X-Session-Id": "orphan"})
        for url in (url_a, url_b, url_a)
    ]
    assert all(status == 200 for status, _, _ in answers)
    # Both replicas send it to the same Ready worker, and its cache builds up there.
    assert len({headers[WORKER_HEADER] for _, _, headers in answers}) == 1
    assert answers[-1][1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
