"""The operator's scrape of an engine's /metrics over a real socket, and its failures.

Each scrape has a connection of its own (``sessionfleet.kube.connections.fetch_once``);
whatever goes wrong keeps the figures of the last good scrape.
"""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from sessionfleet.controllers.config import OperatorConfig
from sessionfleet.controllers.fleet import Fleet
from sessionfleet.controllers.loop import scrape_all, scrape_worker

KEY = ("ns", "w")


@pytest.fixture
async def engine() -> AsyncIterator[tuple[str, dict[str, object]]]:
    """An engine whose /metrics answer is set by the test: text, gzip, a status, a stall."""
    state: dict[str, object] = {"text": "vllm:kv_cache_usage_perc 0.25\n", "status": 200}

    async def metrics(request: web.Request) -> web.Response:
        state["requests"] = int(state.get("requests", 0)) + 1  # type: ignore[call-overload]
        if state.get("stall"):
            await asyncio.sleep(5)
        body = str(state["text"]).encode()
        headers = {}
        if state.get("gzip"):
            body, headers = gzip.compress(body), {"Content-Encoding": "gzip"}
        return web.Response(body=body, status=int(state["status"]), headers=headers)  # type: ignore[call-overload]

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield str(server.make_url("")).rstrip("/"), state
    await server.close()


def fleet() -> Fleet:
    config = OperatorConfig(scrape_timeout_seconds=0.5)
    return Fleet(config=config, kube=None, http=None)  # type: ignore[arg-type]


async def test_a_scrape_reads_the_figures_and_marks_the_worker_only_when_they_change(
    engine: tuple[str, dict[str, object]],
) -> None:
    endpoint, state = engine
    f = fleet()
    assert await scrape_worker(f, KEY, endpoint)
    assert f.engines.stats[KEY].kv_usage == 0.25 and KEY in f.sessions.placement.touched
    f.sessions.placement.touched.clear()
    assert not await scrape_worker(f, KEY, endpoint)  # the same figures
    assert not f.sessions.placement.touched
    state.update(text="vllm:kv_cache_usage_perc 0.5\n", gzip=True)
    assert await scrape_worker(f, KEY, endpoint)
    assert f.engines.stats[KEY].kv_usage == 0.5


@pytest.mark.parametrize(
    "fault",
    [
        {"status": 500},
        {"stall": True},
        {"text": "vllm:kv_cache_usage_perc{not closed 0.5\n"},
        {"endpoint": "refused"},
    ],
    ids=["500", "stall", "garbage", "refused"],
)
async def test_a_failed_scrape_keeps_the_last_figures(
    engine: tuple[str, dict[str, object]], fault: dict[str, object]
) -> None:
    endpoint, state = engine
    f = fleet()
    assert await scrape_worker(f, KEY, endpoint)
    state.update(fault)
    target = "http://127.0.0.1:9" if fault.get("endpoint") else endpoint
    started = asyncio.get_running_loop().time()
    assert not await scrape_worker(f, KEY, target)
    assert asyncio.get_running_loop().time() - started < 3  # the stall is cut at 0.5 s
    assert f.engines.stats[KEY].kv_usage == 0.25


async def test_scraping_many_engines_a_few_at_a_time_reads_every_one(
    engine: tuple[str, dict[str, object]],
) -> None:
    endpoint, state = engine
    f = fleet()
    changed = await scrape_all(f, [(("ns", f"w{i}"), endpoint) for i in range(40)])
    assert changed == [True] * 40 and state["requests"] == 40
    assert len(f.engines.stats) == 40
