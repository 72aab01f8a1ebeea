"""The benchmark's stand-in for Envoy (bench/epp/gateway.py) in front of a real EPP server.

Two engines on 127.0.0.1 that say which one answered, the EPP's gRPC server in process
(its binding table filled directly, as the watches would fill it), and the stand-in's
HTTP server: a request must reach the engine the EPP picked and come back whole,
streamed when asked, so that a benchmark through it cannot route nowhere.
"""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from epp_fakes import USAGE, session, table, worker

from sessionfleet.epp.picker import PickerConfig
from sessionfleet.epp.server import EppSettings, Health, Processor, grpc_server
from sessionfleet.fronts.admission import SessionRates
from sessionfleet.fronts.identity import session_object_name
from sessionfleet.fronts.ledger import UsageLedger
from sessionfleet.fronts.metrics import RouterMetrics

# Appended: the repository root holds a folder named operator/ (the stdlib's name).
sys.path.append(str(Path(__file__).resolve().parent.parent))

from bench.epp.gateway import app as gateway_app


def engine(name: str, seen: list[dict[str, Any]]) -> web.Application:
    """An OpenAI-style engine that names itself in its answer and records each request."""

    async def complete(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append({"headers": request.headers.copy(), "body": body})
        if not body.get("stream"):
            return web.json_response({"served_by": name, "choices": [], "usage": USAGE})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in ({"served_by": name, "usage": None}, {"choices": [], "usage": USAGE}):
            await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    application = web.Application()
    application.router.add_post("/v1/chat/completions", complete)
    return application


@dataclass
class Bed:
    client: TestClient[Any, Any]
    seen: dict[str, list[dict[str, Any]]]
    endpoints: dict[str, str]
    processor: Processor


@pytest.fixture
async def bed() -> AsyncIterator[Bed]:
    seen: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
    engines = {name: TestServer(engine(name, seen[name]), host="127.0.0.1") for name in seen}
    for server in engines.values():
        await server.start_server()
    endpoints = {name: f"127.0.0.1:{server.port}" for name, server in engines.items()}
    workers = []
    for name, server in engines.items():
        spec = worker(f"w-{name}", "127.0.0.1")
        spec["status"]["endpoint"] = f"http://127.0.0.1:{server.port}"
        workers.append(spec)
    bindings = table(workers, [session("on-b", "w-b"), session("moving", "w-a", phase="Migrating")])
    settings = EppSettings(picker=PickerConfig(session_rates=SessionRates(0, 0, 0, 0)))
    processor = Processor(bindings, settings, UsageLedger(10.0), RouterMetrics(bindings))
    health = Health(bindings)
    await health.update()
    epp, port = grpc_server(processor, health, "127.0.0.1:0")
    await epp.start()
    client = TestClient(TestServer(gateway_app(f"127.0.0.1:{port}"), host="127.0.0.1"))
    await client.start_server()
    yield Bed(client, seen, endpoints, processor)
    await client.close()
    await epp.stop(None)
    for server in engines.values():
        await server.close()


def chat(*, stream: bool) -> dict[str, Any]:
    return {"model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi " * 40}]}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_reaches_the_engine_the_epp_picked_and_comes_back(
    bed: Bed, stream: bool
) -> None:
    answer = await bed.client.post(
        "/v1/chat/completions", json=chat(stream=stream), headers={"X-Session-Id": "on-b"}
    )
    text = await answer.text()
    assert answer.status == 200, text
    assert (len(bed.seen["a"]), len(bed.seen["b"])) == (0, 1)
    assert bed.seen["b"][0]["body"] == chat(stream=stream)
    assert bed.seen["b"][0]["headers"]["X-Session-Id"] == "on-b"
    if stream:
        assert answer.headers["Content-Type"].startswith("text/event-stream")
        events = [line for line in text.split("\n\n") if line]
        assert events[0] == 'data: {"served_by": "b", "usage": null}'
        assert events[-1] == "data: [DONE]"
    else:
        assert json.loads(text)["served_by"] == "b"
    stats = await (await bed.client.get("/stats")).json()
    assert stats["routed"] == {bed.endpoints["b"]: 1}
    assert (stats["answered"], stats["failed"]) == ({}, {}) and stats["response_chunks"] >= 1
    # The response went through the EPP too: it read the turn's usage.
    pending = bed.processor.ledger.pending(session_object_name("on-b", None))
    assert pending is not None and (pending.turns, pending.prompt_tokens) == (1, 120)


async def test_a_new_session_goes_where_the_epp_placed_it(bed: Bed) -> None:
    for _ in range(2):
        answer = await bed.client.post(
            "/v1/chat/completions", json=chat(stream=False), headers={"X-Session-Id": "fresh"}
        )
        assert answer.status == 200
    served = json.loads(await answer.text())["served_by"]
    # Both turns on the worker the EPP chose for the first one, and nowhere else.
    assert len(bed.seen[served]) == 2 and not bed.seen["b" if served == "a" else "a"]
    stats = await (await bed.client.get("/stats")).json()
    assert stats["routed"] == {bed.endpoints[served]: 2}


async def test_the_epps_own_answer_goes_to_the_client_and_nothing_upstream(bed: Bed) -> None:
    answer = await bed.client.post(
        "/v1/chat/completions", json=chat(stream=False), headers={"X-Session-Id": "moving"}
    )
    assert answer.status == 503
    assert (await answer.json())["error"]["code"] == "session_held"
    assert answer.headers["Retry-After"] == "5"
    assert bed.seen == {"a": [], "b": []}
    stats = await (await bed.client.get("/stats")).json()
    assert stats == {"routed": {}, "answered": {"503": 1}, "failed": {}, "response_chunks": 0}


async def test_an_epp_that_is_down_fails_the_request_closed() -> None:
    """FailClose, as GAIE's examples set: 500, not a request sent anywhere."""
    with socket.socket() as closed:  # a port nothing listens on once this is closed
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    client = TestClient(TestServer(gateway_app(f"127.0.0.1:{port}", timeout=2), host="127.0.0.1"))
    await client.start_server()
    try:
        answer = await client.post("/v1/chat/completions", json=chat(stream=False))
        assert answer.status == 500
        stats = await (await client.get("/stats")).json()
        assert (stats["routed"], stats["failed"]) == ({}, {"epp": 1})
    finally:
        await client.close()
