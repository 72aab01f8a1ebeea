"""The simulated engine over real HTTP on 127.0.0.1: vLLM's API, cache, pause, export."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from sessionfleet.engines import FORWARDED_SESSION_HEADER, vllm
from sessionfleet.simengine.cost import CostModel
from sessionfleet.simengine.engine import EngineConfig
from sessionfleet.simengine.server import build_app

MODEL = "sim-model"
SYSTEM = "You are a coding agent. " + "Follow the repository's rules. " * 40

Start = Callable[..., Awaitable[str]]


@pytest.fixture
async def start() -> AsyncIterator[Start]:
    """Start engines in this process; each answers real HTTP on 127.0.0.1."""
    servers: list[TestServer] = []

    async def _start(**overrides: Any) -> str:
        config = EngineConfig(model=MODEL, **overrides)
        server = TestServer(build_app(config), host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        return str(server.make_url("")).rstrip("/")

    yield _start
    for server in servers:
        await server.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def chat(
    http: aiohttp.ClientSession,
    base: str,
    messages: list[dict[str, Any]],
    *,
    session: str | None = None,
    **extra: Any,
) -> tuple[int, dict[str, Any]]:
    headers = {FORWARDED_SESSION_HEADER: session} if session else {}
    body = {"model": MODEL, "messages": messages, **extra}
    async with http.post(f"{base}/v1/chat/completions", json=body, headers=headers) as r:
        return r.status, await r.json()


async def stream_events(
    http: aiohttp.ClientSession, base: str, body: dict[str, Any], path: str = "/v1/chat/completions"
) -> list[str]:
    async with http.post(f"{base}{path}", json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        text = await r.text()
    assert text.endswith("\n\n")
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [e.removeprefix("data: ") for e in events]


def first_turn() -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Fix the bug."}]


async def test_cached_tokens_grow_turn_by_turn(start: Start, http: aiohttp.ClientSession) -> None:
    base = await start()
    messages = first_turn()
    cached, prompts = [], []
    for turn in range(5):
        status, body = await chat(http, base, messages, max_tokens=40)
        assert status == 200
        usage = vllm.usage_of_response(body)
        assert usage is not None and usage.cached_tokens is not None
        cached.append(usage.cached_tokens)
        prompts.append(usage.prompt_tokens)
        reply = body["choices"][0]["message"]["content"]
        assert usage.completion_tokens == 40
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": f"Tool output {turn}: " + "ok " * 100},
        ]
    assert cached[0] == 0
    assert all(b > a for a, b in zip(cached, cached[1:], strict=False))
    # Each later turn hits everything but the new message and the partial block,
    # including the previous reply, which the engine cached while generating it.
    for previous_prompt, hit in zip(prompts, cached[1:], strict=False):
        assert hit >= previous_prompt + 40 - 16


async def test_another_engine_recomputes_the_prefix(
    start: Start, http: aiohttp.ClientSession
) -> None:
    warm, cold = await start(), await start()
    await chat(http, warm, first_turn())
    _, again = await chat(http, warm, first_turn())
    _, elsewhere = await chat(http, cold, first_turn())
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert elsewhere["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_streaming_with_and_without_usage(start: Start, http: aiohttp.ClientSession) -> None:
    base = await start()
    events = await stream_events(
        http,
        base,
        {"messages": first_turn(), "max_tokens": 7, "stream_options": {"include_usage": True}},
    )
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert len(content) == 7 * 4
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == []
    usage = vllm.usage_of_response(chunks[-1])
    assert usage == vllm.Usage(
        prompt_tokens=usage.prompt_tokens, completion_tokens=7, cached_tokens=0
    )
    plain = await stream_events(http, base, {"messages": first_turn(), "max_tokens": 3})
    assert not any("usage" in e for e in plain)


async def test_force_include_usage_and_no_details(
    start: Start, http: aiohttp.ClientSession
) -> None:
    base = await start(force_include_usage=True, enable_prompt_tokens_details=False)
    events = await stream_events(http, base, {"messages": first_turn()})
    usage = json.loads(events[-2])["usage"]
    assert usage["completion_tokens"] == 16  # the default max tokens
    assert usage["prompt_tokens_details"] is None
    assert vllm.parse_usage(usage) == vllm.Usage(usage["prompt_tokens"], 16, None)


async def test_completions_stream_and_not(start: Start, http: aiohttp.ClientSession) -> None:
    base = await start()
    body = {"model": MODEL, "prompt": "def main():" * 50, "max_tokens": 4}
    async with http.post(f"{base}/v1/completions", json=body) as r:
        first = await r.json()
    assert first["object"] == "text_completion"
    assert len(first["choices"][0]["text"]) == 16
    events = await stream_events(
        http, base, {**body, "stream_options": {"include_usage": True}}, "/v1/completions"
    )
    usage = json.loads(events[-2])["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        (
            {"model": "other", "messages": [{"role": "user", "content": "x"}]},
            404,
            "The model `other` does not exist.",
        ),
        ({"messages": [{"role": "user", "content": "x"}]}, 400, "model is required"),
        ({"model": MODEL, "messages": []}, 400, "messages must be a non-empty list"),
        ({"model": MODEL, "messages": [{"content": "x"}]}, 400, "every message needs a role"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n must"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
            400,
            "max_tokens must be a positive integer",
        ),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "stream_options": {"include_usage": True},
            },
            400,
            "only be set when stream is true",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]},
            400,
            "maximum context length is 1000 tokens",
        ),
        ([1, 2], 400, "must be a JSON object"),
    ],
)
async def test_bad_requests_get_vllm_errors(
    start: Start, http: aiohttp.ClientSession, body: Any, status: int, fragment: str
) -> None:
    base = await start(max_model_len=1000)
    async with http.post(f"{base}/v1/chat/completions", json=body) as r:
        assert r.status == status
        error = (await r.json())["error"]
    assert fragment in error["message"]
    assert error["code"] == status


async def test_invalid_json_is_a_400(start: Start, http: aiohttp.ClientSession) -> None:
    base = await start()
    async with http.post(f"{base}/v1/chat/completions", data=b"{nope") as r:
        assert r.status == 400
        assert "not valid JSON" in (await r.json())["error"]["message"]


async def test_models_health_version(start: Start, http: aiohttp.ClientSession) -> None:
    base = await start()
    async with http.get(f"{base}/v1/models") as r:
        assert [m["id"] for m in (await r.json())["data"]] == [MODEL]
    async with http.get(f"{base}/health") as r:
        assert r.status == 200
    async with http.get(f"{base}/version") as r:
        assert "sim" in (await r.json())["version"]


async def test_metrics_use_vllm_names(start: Start, http: aiohttp.ClientSession) -> None:
    base = await start(kv_tokens=32 * 1000, block_size=32)
    await chat(http, base, first_turn())
    await chat(http, base, first_turn())
    async with http.get(f"{base}/metrics") as r:
        text = await r.text()
    samples = {
        line.split("{")[0]: line for line in text.splitlines() if line and not line.startswith("#")
    }
    for name in (
        vllm.NUM_REQUESTS_RUNNING,
        vllm.NUM_REQUESTS_WAITING,
        vllm.KV_CACHE_USAGE_PERC,
        vllm.PREFIX_CACHE_QUERIES + "_total",
        vllm.PREFIX_CACHE_HITS + "_total",
        vllm.CACHE_CONFIG_INFO,
    ):
        assert name in samples, name
    assert 'block_size="32"' in samples[vllm.CACHE_CONFIG_INFO]
    assert 'num_gpu_blocks="1000"' in samples[vllm.CACHE_CONFIG_INFO]
    assert f'model_name="{MODEL}"' in samples[vllm.NUM_REQUESTS_RUNNING]
    hits = float(samples[vllm.PREFIX_CACHE_HITS + "_total"].rsplit(" ", 1)[1])
    queries = float(samples[vllm.PREFIX_CACHE_QUERIES + "_total"].rsplit(" ", 1)[1])
    assert 0 < hits < queries
    assert not any(name in text for name in vllm.DEPRECATED_METRICS)


SLOW = CostModel(decode_seconds_per_token=0.01)


async def test_pause_keep_freezes_and_keeps_the_cache(
    start: Start, http: aiohttp.ClientSession
) -> None:
    base = await start(cost=SLOW)
    await chat(http, base, first_turn(), max_tokens=1)
    in_flight = asyncio.ensure_future(chat(http, base, first_turn(), max_tokens=20))
    await asyncio.sleep(0.05)
    async with http.post(f"{base}/pause", params={"mode": "keep"}) as r:
        assert (await r.json()) == {"status": "paused"}
    async with http.get(f"{base}/is_paused") as r:
        assert (await r.json()) == {"is_paused": True}
    newcomer = asyncio.ensure_future(chat(http, base, first_turn(), max_tokens=1))
    done, _ = await asyncio.wait({in_flight, newcomer}, timeout=0.5)
    assert not done, "a paused engine finished a request"
    async with http.post(f"{base}/resume") as r:
        assert (await r.json()) == {"status": "resumed"}
    (_, body), (_, later) = await asyncio.gather(in_flight, newcomer)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 20
    # keep never clears the cache, whatever clear_cache says.
    assert later["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_pause_abort_ends_requests_and_clears_the_cache(
    start: Start, http: aiohttp.ClientSession
) -> None:
    base = await start(cost=SLOW)
    await chat(http, base, first_turn(), max_tokens=1)
    in_flight = asyncio.ensure_future(chat(http, base, first_turn(), max_tokens=500))
    await asyncio.sleep(0.05)
    async with http.post(f"{base}/pause") as r:  # mode=abort, clear_cache=true: vLLM's defaults
        assert r.status == 200
    _, body = await in_flight
    assert body["choices"][0]["finish_reason"] == "abort"
    assert body["usage"]["completion_tokens"] < 500
    async with http.post(f"{base}/resume"):
        pass
    _, after = await chat(http, base, first_turn(), max_tokens=1)
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_pause_wait_without_clearing(start: Start, http: aiohttp.ClientSession) -> None:
    base = await start()
    await chat(http, base, first_turn(), max_tokens=1)
    async with http.post(f"{base}/pause", params={"mode": "wait", "clear_cache": "false"}) as r:
        assert r.status == 200
    async with http.post(f"{base}/resume"):
        pass
    _, after = await chat(http, base, first_turn(), max_tokens=1)
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    async with http.post(f"{base}/pause", params={"mode": "sideways"}) as r:
        assert r.status == 400


async def test_export_import_carries_a_session(
    start: Start, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    source, target = await start(), await start()
    messages = first_turn()
    _, body = await chat(http, source, messages, session="s1", max_tokens=30)
    await chat(http, source, [{"role": "user", "content": "unrelated " * 80}], session="s2")
    messages += [
        {"role": "assistant", "content": body["choices"][0]["message"]["content"]},
        {"role": "user", "content": "next"},
    ]
    async with http.post(
        f"{source}/sim/cache/export", json={"directory": str(tmp_path / "s1"), "session": "s1"}
    ) as r:
        exported = await r.json()
    assert exported["sessions"] == ["s1"] and exported["blocks"] > 0
    async with http.post(
        f"{target}/sim/cache/import", json={"directory": str(tmp_path / "s1")}
    ) as r:
        imported = await r.json()
    assert imported["added"] == exported["blocks"]
    _, moved = await chat(http, target, messages, session="s1")
    assert moved["usage"]["prompt_tokens_details"]["cached_tokens"] >= exported["tokens"] - 16
    # Only session s1's blocks travelled.
    _, other = await chat(http, target, [{"role": "user", "content": "unrelated " * 80}])
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_whole_cache_export_and_refusals(
    start: Start, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    base = await start()
    await chat(http, base, first_turn(), session="a")
    async with http.post(f"{base}/sim/cache/export", json={"directory": str(tmp_path)}) as r:
        assert (await r.json())["sessions"] == ["a"]
    async with http.get(f"{base}/sim/cache") as r:
        summary = await r.json()
    assert summary["cachedBlocks"] > 0 and "a" in summary["sessions"]
    other = await start(block_size=32)
    async with http.post(f"{other}/sim/cache/import", json={"directory": str(tmp_path)}) as r:
        assert r.status == 422
        assert "block size 16" in (await r.json())["error"]["message"]
    async with http.post(f"{base}/sim/cache/import", json={"directory": str(tmp_path / "no")}) as r:
        assert r.status == 422
    async with http.post(f"{base}/sim/cache/export", json={"session": "a"}) as r:
        assert r.status == 400
    async with http.post(
        f"{base}/sim/cache/export", json={"directory": str(tmp_path), "session": "zz"}
    ) as r:
        assert r.status == 404


# --- Anthropic's Messages API (/v1/messages) ------------------------------------------


async def message(
    http: aiohttp.ClientSession, base: str, body: dict[str, Any], *, session: str | None = None
) -> tuple[int, dict[str, Any]]:
    headers = {FORWARDED_SESSION_HEADER: session} if session else {}
    async with http.post(
        f"{base}/v1/messages", json={"model": MODEL, **body}, headers=headers
    ) as r:
        return r.status, await r.json()


async def message_events(
    http: aiohttp.ClientSession, base: str, body: dict[str, Any]
) -> list[tuple[str, dict[str, Any]]]:
    """Stream a Messages request; return its (event name, data) pairs."""
    async with http.post(f"{base}/v1/messages", json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        text = await r.text()
    events = []
    for frame in filter(None, text.split("\n\n")):
        name, data = frame.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data.removeprefix("data: "))
        assert payload["type"] == name.removeprefix("event: ")  # Anthropic repeats the name
        events.append((payload["type"], payload))
    return events


async def test_messages_read_the_cache_turn_by_turn(
    start: Start, http: aiohttp.ClientSession
) -> None:
    base = await start()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Fix the bug."}]
    reads, prompts = [], []
    for turn in range(4):
        status, body = await message(
            http, base, {"system": SYSTEM, "messages": messages, "max_tokens": 40}
        )
        assert status == 200
        assert body["type"] == "message" and body["role"] == "assistant"
        assert body["id"].startswith("msg_")
        assert body["stop_reason"] == "max_tokens"  # the filler always runs to max_tokens
        usage = body["usage"]
        assert usage["output_tokens"] == 40
        assert usage["cache_creation_input_tokens"] == 0  # vLLM has no separate cache writes
        reads.append(usage["cache_read_input_tokens"])
        prompts.append(usage["input_tokens"] + usage["cache_read_input_tokens"])
        # The reply goes back as the SDKs send it: a list of content blocks.
        messages += [
            {"role": "assistant", "content": body["content"]},
            {"role": "user", "content": [{"type": "text", "text": f"Output {turn}: ok"}]},
        ]
    assert reads[0] == 0
    for previous_prompt, hit in zip(prompts, reads[1:], strict=False):
        assert hit >= previous_prompt + 40 - 16  # the previous reply hits too
    # The usage reads as the router reads it: the prompt is uncached plus cache reads.
    parsed = vllm.parse_usage(usage)
    assert parsed == vllm.Usage(prompts[-1], 40, reads[-1])


async def test_messages_render_like_the_chat_api(start: Start, http: aiohttp.ClientSession) -> None:
    """A Messages request and the chat request vLLM converts it to share one prefix."""
    base = await start()
    await chat(http, base, first_turn(), max_tokens=4)
    _, body = await message(
        http,
        base,
        {
            # Claude Code's attribution block holds a per-request hash; vLLM drops it.
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cch=81f3;"},
                {"type": "text", "text": SYSTEM},
            ],
            "messages": [{"role": "user", "content": "Fix the bug."}],
            "max_tokens": 4,
        },
    )
    prompt = body["usage"]["input_tokens"] + body["usage"]["cache_read_input_tokens"]
    _, same = await chat(http, base, first_turn(), max_tokens=4)
    assert prompt == same["usage"]["prompt_tokens"]
    # Same prompt, same hits: every full block the chat request cached.
    assert body["usage"]["cache_read_input_tokens"] > 0
    assert (
        body["usage"]["cache_read_input_tokens"]
        == same["usage"]["prompt_tokens_details"]["cached_tokens"]
    )


async def test_tool_use_and_results_are_rendered(start: Start, http: aiohttp.ClientSession) -> None:
    base = await start()
    conversation: list[dict[str, Any]] = [
        {"role": "user", "content": "List the files."},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Running ls."},
                {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"cmd": "ls"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.py\nb.py"},
            ],
        },
    ]
    _, first = await message(
        http, base, {"system": SYSTEM, "messages": conversation, "max_tokens": 4}
    )
    longer = [
        *conversation[:2],
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "a.py\nb.py\n" + "c.py\n" * 200}],
                }
            ],
        },
    ]
    _, second = await message(http, base, {"system": SYSTEM, "messages": longer, "max_tokens": 4})

    # The tool's output is part of the prompt: more of it is more tokens, and the
    # conversation before it hits the cache.
    def prompt(usage: dict[str, int]) -> int:
        return usage["input_tokens"] + usage["cache_read_input_tokens"]

    assert prompt(second["usage"]) > prompt(first["usage"]) + 200
    assert second["usage"]["cache_read_input_tokens"] >= prompt(first["usage"]) - 32


async def test_a_messages_stream_splits_its_usage_as_anthropic_documents(
    start: Start, http: aiohttp.ClientSession
) -> None:
    base = await start()
    body = {"system": SYSTEM, "messages": [{"role": "user", "content": "Go."}], "max_tokens": 6}
    await message(http, base, body)  # warm the cache
    events = await message_events(http, base, body)
    names = [name for name, _ in events]
    assert names == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * 6,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    opening = events[0][1]["message"]
    assert opening["content"] == [] and opening["stop_reason"] is None
    assert opening["usage"]["cache_read_input_tokens"] > 0
    assert opening["usage"]["output_tokens"] == 0
    assert events[1][1]["content_block"] == {"type": "text", "text": ""}
    text = "".join(data["delta"]["text"] for name, data in events if name == "content_block_delta")
    _, whole = await message(http, base, body)
    assert text == whole["content"][0]["text"]  # the same request generates the same words
    closing = events[-2][1]
    assert closing["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    # Only the output count in message_delta: the input counts are message_start's.
    assert closing["usage"] == {"output_tokens": 6}
    assert {**opening["usage"], **closing["usage"]} == whole["usage"]


async def test_messages_without_cache_details(start: Start, http: aiohttp.ClientSession) -> None:
    base = await start(enable_prompt_tokens_details=False)
    body = {"system": SYSTEM, "messages": [{"role": "user", "content": "Go."}], "max_tokens": 2}
    await message(http, base, body)
    _, again = await message(http, base, body)
    # As vLLM: the whole prompt as input_tokens, the cache counts absent (unknown).
    assert set(again["usage"]) == {"input_tokens", "output_tokens"}
    assert vllm.parse_usage(again["usage"]) == vllm.Usage(again["usage"]["input_tokens"], 2, None)


@pytest.mark.parametrize(
    ("body", "status", "kind", "fragment"),
    [
        ({"model": "other"}, 404, "not_found_error", "The model `other` does not exist."),
        ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens is required"),
        ({"max_tokens": 0}, 400, "invalid_request_error", "max_tokens is required"),
        ({"messages": []}, 400, "invalid_request_error", "messages must be a non-empty list"),
        (
            {"messages": [{"role": "system", "content": "x"}]},
            400,
            "invalid_request_error",
            "the system prompt goes in the top-level system field",
        ),
        (
            {"messages": [{"role": "user", "content": [{"text": "no type"}]}]},
            400,
            "invalid_request_error",
            "content blocks with a type",
        ),
        ({"system": 7}, 400, "invalid_request_error", "system must be a string"),
        ({"stream": "yes"}, 400, "invalid_request_error", "stream must be a boolean"),
        (
            {"messages": [{"role": "user", "content": "x" * 5000}]},
            400,
            "invalid_request_error",
            "maximum context length is 1000 tokens",
        ),
    ],
)
async def test_bad_messages_get_anthropic_errors(
    start: Start,
    http: aiohttp.ClientSession,
    body: dict[str, Any],
    status: int,
    kind: str,
    fragment: str,
) -> None:
    base = await start(max_model_len=1000)
    valid = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    request = {k: v for k, v in {**valid, **body}.items() if v is not None}
    got, answer = await message(http, base, request)
    assert got == status
    assert answer["type"] == "error" and set(answer["error"]) == {"type", "message"}
    assert answer["error"]["type"] == kind
    assert fragment in answer["error"]["message"]


async def test_messages_refuse_invalid_json_in_anthropic_shape(
    start: Start, http: aiohttp.ClientSession
) -> None:
    base = await start()
    async with http.post(f"{base}/v1/messages", data=b"{nope") as r:
        assert r.status == 400
        answer = await r.json()
    assert answer["error"]["type"] == "invalid_request_error"
    assert "not valid JSON" in answer["error"]["message"]
