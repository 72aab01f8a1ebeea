"""The router's bounds on request heads, and its allow-list of paths (issue 29, items 2, 9).

Real HTTP on 127.0.0.1, written as raw bytes (an HTTP client would clean the paths up),
to a router in front of a real simulated engine or a stand-in that records every
request it receives; the Kubernetes API is the in-memory fake.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import aiohttp.web
import pytest
from aiohttp.test_utils import TestServer
from router_fleet import MODEL, Fleet, chat, opening, worker_object

from sessionfleet.kube import WORKERS
from sessionfleet.router.heads import head_size
from sessionfleet.router.limits import IntakeLimits
from sessionfleet.router.paths import is_served
from sessionfleet.router.proxy import RouterConfig
from sessionfleet.router.server import RouterSettings, serve


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def head(path: str = "/v1/chat/completions", *, filler: int = 0, length: int = 10) -> bytes:
    """A POST head with ``filler`` bytes of extra headers, in 8,000-byte lines."""
    lines = [f"POST {path} HTTP/1.1", "Host: x", f"Content-Length: {length}"]
    lines += [f"X-Filler-{i}: " + "a" * 8000 for i in range(filler // 8000)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def answer_of(port: int, data: bytes, timeout: float = 5) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(1 << 16), timeout)
    finally:
        writer.close()


def json_body(answer: bytes) -> dict[str, Any]:
    _, _, body = answer.partition(b"\r\n\r\n")
    result: dict[str, Any] = json.loads(body)
    return result


@pytest.fixture
async def served(fleet: Fleet) -> AsyncIterator[tuple[int, RouterSettings]]:
    """A router run by :func:`serve` (the real listener), small head limits, a sim engine."""
    await fleet.engine("w1")
    settings = RouterSettings(
        namespace="default",
        replica="x",
        config=RouterConfig(
            intake=IntakeLimits(
                max_header_bytes=32 << 10, max_inflight_header_bytes=64 << 10, body_timeout=5
            )
        ),
    )
    port = free_port()
    task = asyncio.create_task(serve(fleet.kube, settings, "127.0.0.1", port))  # type: ignore[arg-type]
    for _ in range(300):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            break
        except OSError:
            await asyncio.sleep(0.01)
    yield port, settings
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def metric(port: int, name: str) -> float:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{port}/metrics") as r,
    ):
        for line in (await r.text()).splitlines():
            if line.startswith((name + " ", name + "{")):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


# --- heads ----------------------------------------------------------------------------


def test_head_size_counts_the_line_and_every_header() -> None:
    raw = head(filler=16_000)
    headers = tuple(
        (name.encode(), value.encode())
        for name, _, value in (
            line.partition(": ") for line in raw.decode().split("\r\n")[1:] if line
        )
    )
    assert head_size("POST", "/v1/chat/completions", headers) == len(raw)


async def test_a_complete_head_over_the_limit_is_431_before_its_body_is_read(
    fleet: Fleet,
) -> None:
    await fleet.engine("w1")
    url, router = await fleet.router(intake=IntakeLimits(max_header_bytes=16 << 10))
    port = int(url.rsplit(":", 1)[1])
    answer = await answer_of(port, head(filler=24_000))
    assert answer.startswith(b"HTTP/1.1 431")
    assert json_body(answer)["error"]["code"] == "headers_too_large"
    assert router.proxy.intake.budget.used == 0
    # A head within the limit is served as before.
    body = json.dumps(chat(opening())).encode()
    ok = await answer_of(port, head(filler=8_000, length=len(body)) + body)
    assert ok.startswith(b"HTTP/1.1 200"), ok[:200]


async def test_a_head_still_arriving_past_the_limit_is_431_at_once(
    served: tuple[int, RouterSettings],
) -> None:
    port, _ = served
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    # 40 KB of headers, never finished: aiohttp alone would hold them to the idle timeout.
    writer.write(head(filler=40_000)[:-2])
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(1 << 16), 5)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 431")
    assert json_body(answer)["error"]["code"] == "headers_too_large"
    assert await metric(port, "sessionfleet_router_head_refusals_total") == 1


async def test_heads_held_at_once_are_capped_503_with_retry_after(
    served: tuple[int, RouterSettings],
) -> None:
    port, _ = served
    held = []
    # Two requests of 24 KB heads announce a body and send none: 48 KB of the 64 KiB budget.
    for _ in range(2):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head(filler=24_000))
        await writer.drain()
        held.append((reader, writer))
    for _ in range(100):
        if await metric(port, "sessionfleet_router_header_bytes") >= 48_000:
            break
        await asyncio.sleep(0.02)
    answer = await answer_of(port, head(filler=24_000))
    assert answer.startswith(b"HTTP/1.1 503"), answer[:100]
    assert b"Retry-After: 1" in answer
    assert json_body(answer)["error"]["code"] == "router_busy"
    assert await metric(port, 'sessionfleet_router_head_refusals_total{reason="busy"}') == 1
    for _, writer in held:
        writer.close()
    for _ in range(100):
        if await metric(port, "sessionfleet_router_header_bytes") < 1000:
            break
        await asyncio.sleep(0.02)
    # Only the scrape's own head is held now, and a new request is served.
    assert await metric(port, "sessionfleet_router_header_bytes") < 1000
    body = json.dumps(chat(opening())).encode()
    ok = await answer_of(port, head(filler=8_000, length=len(body)) + body)
    assert ok.startswith(b"HTTP/1.1 200"), ok[:200]


# --- paths ----------------------------------------------------------------------------

HOSTILE_PATHS = [
    "/v1/../collective_rpc",
    "/v1/chat/../../collective_rpc",
    "/v1/./chat/completions",
    "/v1/%2e%2e/sleep",
    "/v1/%2E%2E/pause",
    "/v1/.%2e/collective_rpc",
    "/v1/%2e./collective_rpc",
    "/v1/chat%2fcompletions",
    "/v1/chat%2Fcompletions",
    "/v1/..%2fcollective_rpc",
    "/v1/chat/completions/..",
    "/v1/chat/completions/",
    "/v1//chat/completions",
    "//v1/chat/completions",
    "/v1\\..\\collective_rpc",
    "/v1/chat\\completions",
    "/v1/chat/completions%00",
    "/collective_rpc",
    "/sleep",
    "/pause",
    "/v1/collective_rpc",
    "/v1/models/../../collective_rpc",
    "/v1/models",
]


@pytest.fixture
async def recorder(fleet: Fleet) -> list[str]:
    """A stand-in worker that records the raw path of every request it receives."""
    received: list[str] = []

    async def record(request: aiohttp.web.Request) -> aiohttp.web.Response:
        received.append(request.raw_path)
        return aiohttp.web.json_response(
            {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
        )

    app = aiohttp.web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    fleet.servers.append(server)
    fleet.kube.put(WORKERS.plural, worker_object("w1", str(server.make_url("")).rstrip("/")))
    return received


@pytest.mark.parametrize("path", HOSTILE_PATHS)
async def test_paths_outside_the_api_are_404_and_never_forwarded(
    fleet: Fleet, recorder: list[str], path: str
) -> None:
    url, _ = await fleet.router()
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps({"model": MODEL, "messages": []}).encode()
    for query in ("", "?x=1"):
        answer = await answer_of(port, head(path + query, length=len(body)) + body)
        assert answer.startswith(b"HTTP/1.1 404"), (path, answer[:200])
        assert json_body(answer)["error"]["code"] == "not_found"
    assert recorder == []


@pytest.mark.parametrize(
    "path", ["/v1/chat/completions", "/v1/completions", "/v1/messages?beta=true"]
)
async def test_api_paths_are_forwarded_unchanged(
    fleet: Fleet, recorder: list[str], path: str
) -> None:
    url, _ = await fleet.router()
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps({"model": MODEL, "messages": []}).encode()
    answer = await answer_of(port, head(path, length=len(body)) + body)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert recorder == [path]


@pytest.mark.parametrize(
    ("path", "served"),
    [
        ("/v1/models/org/model-7b", True),
        ("/v1/models/Qwen2.5-7B", True),
        ("/v1/models/../metrics", False),
        ("/v1/models/org//model", False),
        ("/v1/models/.hidden", False),
        ("/v1/models/a%2fb", False),
        ("/healthz", True),
        ("/healthz/", False),
        ("/metrics", True),
    ],
)
def test_the_allow_list(path: str, served: bool) -> None:
    assert is_served(path) is served
