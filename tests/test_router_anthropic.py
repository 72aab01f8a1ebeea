"""Anthropic's Messages API through the router: sessions, usage split across a stream, errors.

Coding agents such as Claude Code send ``POST /v1/messages``. The router forwards it like
any ``/v1/`` path; these tests check what differs: the usage of a stream comes in two
halves (``message_start`` and ``message_delta``) and must be added up whole, and the
router's own errors and a broken stream's last event take Anthropic's shape, which the
Anthropic SDKs read. Real HTTP on 127.0.0.1 to simulated engines, the fake Kubernetes API.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import anthropic
import pytest
from router_fleet import MODEL, SYSTEM, Fleet, dies_mid_stream, until, worker_object

from sessionfleet.fronts.identity import CLAUDE_CODE_SESSION, session_object_name
from sessionfleet.kube import WORKERS
from sessionfleet.simengine.cost import CostModel

MESSAGES = "/v1/messages"


def request(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "system": SYSTEM, "messages": messages, "max_tokens": 8, **extra}


async def send(
    http: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, bytes, dict[str, str]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post(url + MESSAGES, data=data, headers=headers or {}) as r:
        return r.status, await r.read(), dict(r.headers)


def events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    pairs = []
    for frame in filter(None, raw.decode().split("\n\n")):
        lines = dict(line.split(": ", 1) for line in frame.split("\n"))
        pairs.append((lines["event"], json.loads(lines["data"])))
    return pairs


async def test_a_claude_code_session_stays_on_its_worker_and_every_token_counts(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    """Streamed and whole turns of one session: the status gets prompt, cache and output."""
    await fleet.engine("w1")
    await fleet.engine("w2")
    url, router = await fleet.router()
    headers = {CLAUDE_CODE_SESSION: "claude-1"}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Fix the bug."}]
    expected = {"prompt": 0, "cached": 0, "output": 0}
    workers = set()
    for turn in range(4):
        streamed = turn % 2 == 1
        status, raw, answer_headers = await send(
            http, url, request(messages, stream=streamed), headers
        )
        assert status == 200
        workers.add(answer_headers["X-Sessionfleet-Worker"])
        if streamed:
            stream = events(raw)
            usage = {**stream[0][1]["message"]["usage"], **stream[-2][1]["usage"]}
            text = "".join(d["delta"]["text"] for e, d in stream if e == "content_block_delta")
        else:
            body = json.loads(raw)
            usage, text = body["usage"], body["content"][0]["text"]
        expected["prompt"] += usage["input_tokens"] + usage["cache_read_input_tokens"]
        expected["cached"] += usage["cache_read_input_tokens"]
        expected["output"] += usage["output_tokens"]
        messages += [
            {"role": "assistant", "content": [{"type": "text", "text": text}]},
            {"role": "user", "content": f"Next {turn}."},
        ]
    assert len(workers) == 1
    pending = router.ledger.pending(session_object_name("claude-1"))
    assert pending is not None and pending.turns == 4
    # Without merging a stream's two halves, its turns would count no prompt at all.
    assert pending.prompt_tokens == expected["prompt"]
    assert pending.cached_tokens == expected["cached"] > 0
    assert pending.completion_tokens == expected["output"] == 4 * 8


async def test_a_long_stream_still_counts_its_prompt(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    """message_start scrolls far out of the kept tail; the kept head still has it."""
    await fleet.engine("w1")
    url, router = await fleet.router()
    body = request([{"role": "user", "content": "Write a lot."}], stream=True, max_tokens=2000)
    status, raw, _ = await send(http, url, body, {"X-Session-Id": "long"})
    assert status == 200 and len(raw) > 100_000
    opening = events(raw)[0][1]["message"]["usage"]
    pending = router.ledger.pending(session_object_name("long"))
    assert pending is not None
    assert pending.prompt_tokens == opening["input_tokens"] > 0
    assert pending.completion_tokens == 2000


async def test_a_client_that_leaves_mid_stream_still_has_its_prompt_counted(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    await fleet.engine("w1", cost=CostModel(decode_seconds_per_token=0.01))
    url, router = await fleet.router()
    body = request([{"role": "user", "content": "Go."}], stream=True, max_tokens=500)
    async with http.post(url + MESSAGES, json=body, headers={"X-Session-Id": "leaver"}) as r:
        first = await r.content.readany()
        assert b"message_start" in first
        r.close()
    name = session_object_name("leaver")
    await until(lambda: router.ledger.pending(name) is not None)
    pending = router.ledger.pending(name)
    assert pending is not None and pending.turns == 1 and pending.prompt_tokens > 0


@pytest.mark.parametrize(
    ("body", "headers", "status", "kind", "code"),
    [
        (b"{broken", {}, 400, "invalid_request_error", "invalid_body"),
        ({"messages": []}, {}, 400, "invalid_request_error", "invalid_body"),
        (
            {"model": MODEL, "messages": []},
            {"X-Session-Id": "has space"},
            400,
            "invalid_request_error",
            "invalid_session_id",
        ),
        ({"model": "nope", "messages": []}, {}, 404, "not_found_error", "model_not_found"),
    ],
)
async def test_the_routers_own_errors_take_anthropics_shape(
    fleet: Fleet,
    http: aiohttp.ClientSession,
    body: Any,
    headers: dict[str, str],
    status: int,
    kind: str,
    code: str,
) -> None:
    await fleet.engine("w1")
    url, _ = await fleet.router()
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    got, raw, answer_headers = await send(http, url, data, headers)
    assert got == status
    answer = json.loads(raw)
    assert answer["type"] == "error" and set(answer["error"]) == {"type", "message"}
    assert answer["error"]["type"] == kind and answer["error"]["message"]
    assert answer_headers["X-Sessionfleet-Reason"] == code
    # The same mistake on the chat API keeps OpenAI's shape.
    async with http.post(url + "/v1/chat/completions", data=data, headers=headers) as r:
        assert r.status == status
        assert (await r.json())["error"]["code"] == code


async def test_other_methods_and_unavailable_workers_on_the_messages_path(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    url, _ = await fleet.router(retry_after=2)
    async with http.get(url + MESSAGES) as r:
        assert r.status == 405
        assert (await r.json())["error"]["type"] == "invalid_request_error"
    # A worker of the model that is not Ready yet: 503, overloaded in Anthropic's words.
    fleet.kube.put(WORKERS.plural, worker_object("w1", "http://127.0.0.1:9", phase="Pending"))
    await until(lambda: fleet.routers[0].table.has_model(MODEL))
    status, raw, headers = await send(http, url, request([{"role": "user", "content": "x"}]))
    assert status == 503 and headers["Retry-After"] == "2"
    assert json.loads(raw)["error"]["type"] == "overloaded_error"


async def test_the_engines_own_errors_pass_through(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    await fleet.engine("w1")
    url, _ = await fleet.router()
    status, raw, headers = await send(http, url, {"model": MODEL, "messages": [{"role": "user"}]})
    assert status == 400 and "X-Sessionfleet-Reason" not in headers
    answer = json.loads(raw)
    assert answer["error"]["type"] == "invalid_request_error"
    assert "max_tokens is required" in answer["error"]["message"]


async def test_a_broken_messages_stream_ends_with_an_anthropic_error_event(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 5}}}
    first = f"event: message_start\ndata: {json.dumps(start)}\n\n".encode()
    await fleet.fake_engine("w1", dies_mid_stream(first), MESSAGES)
    url, router = await fleet.router()
    status, raw, _ = await send(http, url, request([{"role": "user", "content": "x"}], stream=True))
    assert status == 200
    name, error = events(raw)[-1]
    # The Anthropic SDKs raise on an event named error and skip unnamed ones.
    assert name == "error" and error["type"] == "error"
    assert error["error"]["type"] == "api_error"
    assert "stream ended early" in error["error"]["message"]
    assert (
        router.metrics.registry.get_sample_value(
            "sessionfleet_router_requests_total", {"route": "stateless", "code": "502"}
        )
        == 1
    )
    # The Anthropic SDK raises it while the stream is read, rather than ending quietly.
    client = anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)
    async with client:
        with pytest.raises(anthropic.APIStatusError) as raised:
            async with client.messages.stream(
                model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "x"}]
            ) as stream:
                await stream.get_final_message()
    assert raised.value.type == "api_error"
    assert raised.value.api_message is not None
    assert "stream ended early" in raised.value.api_message
