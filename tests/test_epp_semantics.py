"""The EPP behind real gateways (issue 31, items 3, 4, 6, 7): the pool, the control
headers and models, where a session is bound, when a turn ends, GAIE's metric names.

Pure parts directly; the server over a real in-process grpc.aio server.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from epp_fakes import (
    MODES,
    chat_body,
    destination_of,
    fleet,
    immediate_of,
    request_body,
    request_headers,
    response_body,
    response_headers,
    session,
    sse_chunks,
    table,
    worker,
)
from prometheus_client import generate_latest

from sessionfleet.epp.gaie_metrics import GaieMetrics
from sessionfleet.epp.picker import EndpointPicker, PickerConfig
from sessionfleet.epp.pool import Mismatch, PoolSpec, PoolView, membership
from sessionfleet.epp.protocol import CONTROL_HEADERS, Exchange, ExchangeSettings
from sessionfleet.epp.server import EppSettings, Health, Processor, grpc_server
from sessionfleet.fronts.admission import SessionRates
from sessionfleet.fronts.bindings import BindingTable, WorkerView
from sessionfleet.fronts.identity import session_object_name
from sessionfleet.fronts.ledger import UsageLedger
from sessionfleet.fronts.metrics import RouterMetrics

NO_LIMITS = SessionRates(0, 0, 0, 0)
SELECTED = {"app": "engine", "pool": "agents"}


def picker(bindings: BindingTable, pool: PoolView | None = None, fallbacks: int = 0) -> Any:
    config = PickerConfig(fallbacks=fallbacks, session_rates=NO_LIMITS)
    return EndpointPicker(bindings, config, now=0.0, pool=pool)


def exchange(bindings: BindingTable, pool: PoolView | None = None, fallbacks: int = 0) -> Exchange:
    settings = ExchangeSettings(MODES.BUFFERED, MODES.BUFFERED)
    return Exchange(picker(bindings, pool, fallbacks), settings, started=0.0)


def decide(ex: Exchange, headers: dict[str, str], body: bytes, **kw: Any) -> Any:
    ex.receive(request_headers(headers, **kw), 0.0)
    return ex.receive(request_body(body, True), 0.0)[0]


def pool_view(port: int = 8000, labels: dict[str, str] | None = None) -> PoolView:
    view = PoolView("agents")
    view.apply_pool(
        {
            "metadata": {"name": "agents"},
            "spec": {
                "selector": {"matchLabels": labels or SELECTED},
                "targetPorts": [{"number": port}, {"number": port + 1}],
            },
        }
    )
    view.pool_synced = True
    pods = [
        {"metadata": {"name": "p1", "labels": SELECTED}, "status": {"podIP": "10.0.0.1"}},
        {"metadata": {"name": "p2", "labels": {"app": "engine"}}, "status": {"podIP": "10.0.0.2"}},
        {"metadata": {"name": "p3", "labels": SELECTED}, "status": {"podIP": "10.0.0.3"}},
    ]
    view.replace_pods(pods)
    return view


# --- item 3: the InferencePool ---------------------------------------------------------


def test_membership_names_selected_pods_at_the_first_target_port_and_says_why_not() -> None:
    spec = PoolSpec.from_object(
        {
            "metadata": {"name": "agents"},
            "spec": {"selector": {"matchLabels": SELECTED}, "targetPorts": [{"number": 9000}]},
        }
    )
    pods = {"10.0.0.1": SELECTED, "10.0.0.2": {"app": "engine"}}

    def at(ip: str) -> WorkerView:
        return WorkerView.from_object(worker("w", ip))

    selected = WorkerView("w", "m", "Ready", "http://10.0.0.1:9000", 4, 0, 0.0)
    assert membership(spec, pods, selected).address == "10.0.0.1:9000"
    assert membership(spec, pods, selected).mismatch is None
    other_port = membership(spec, pods, at("10.0.0.1"))  # the engine is on 8000
    assert other_port.mismatch is Mismatch.PORT_DIFFERS and other_port.address == "10.0.0.1:9000"
    assert "8000" in other_port.message and "9000" in other_port.message
    outside = membership(spec, pods, at("10.0.0.2"))
    assert (outside.address, outside.mismatch) == (None, Mismatch.NOT_SELECTED)
    unknown = membership(spec, pods, at("10.0.0.7"))
    assert (unknown.address, unknown.mismatch) == (None, Mismatch.NO_POD)


def test_with_a_pool_the_epp_picks_only_selected_workers_at_the_pool_port() -> None:
    view = pool_view(port=8000)
    for _ in range(6):  # stateless: rotates among the selected only
        answer = decide(exchange(fleet(), view), {}, chat_body())
        assert destination_of(answer)[0] in {"10.0.0.1:8000", "10.0.0.3:8000"}
    # A new session with fallbacks: never the unselected worker.
    answer = decide(exchange(fleet(), view, fallbacks=2), {"x-session-id": "s"}, chat_body())
    assert sorted(destination_of(answer)[0].split(",")) == ["10.0.0.1:8000", "10.0.0.3:8000"]
    # A session bound to a worker the pool does not select: 503, never elsewhere.
    bound = fleet([session("s2", "w-2")])
    status, _, body = immediate_of(
        decide(exchange(bound, view), {"x-session-id": "s2"}, chat_body())
    )
    assert status == 503 and "pool" in body["error"]["message"]


def test_with_a_pool_port_the_endpoint_and_the_subset_hint_use_the_target_port() -> None:
    view = pool_view(port=9000)  # the engines listen on 8000: PortDiffers, named at 9000
    ex = exchange(fleet(), view)
    answer = decide(ex, {"x-session-id": "s"}, chat_body(), subset=["10.0.0.3:9000"])
    assert destination_of(answer) == ("10.0.0.3:9000", "10.0.0.3:9000")
    # The engines' own port is not in a kgateway-style hint built from the pool.
    ex = exchange(fleet(), view)
    status, _, _ = immediate_of(decide(ex, {}, chat_body(), subset=["10.0.0.3:8000"]))
    assert status == 503


def test_pool_mismatches_are_reported_once_per_change() -> None:
    view = pool_view(port=8000)
    workers = list(fleet().workers.values())
    lines = view.report(workers)
    assert lines == [
        "pool mismatch NotSelected: worker w-2: InferencePool agents does not select its pod "
        "(selector {'app': 'engine', 'pool': 'agents'})"
    ]
    assert view.report(workers) == []  # unchanged: not logged again
    view.apply_pod(
        {"metadata": {"name": "p2", "labels": SELECTED}, "status": {"podIP": "10.0.0.2"}}
    )
    assert view.report(workers) == ["pool mismatch resolved: worker w-2 is in the pool"]
    missing = PoolView("agents")
    missing.pool_synced = missing.pods_synced = True
    assert missing.address(workers[0]) is None  # a pool not found names nothing


# --- item 4: control headers and models -------------------------------------------------


def test_the_control_headers_are_removed_before_the_model_server() -> None:
    headers = {
        "x-gateway-inference-objective": "premium",
        "x-gateway-inference-fairness-id": "tenant-a",
        "x-gateway-model-name-rewrite": "m",
    }
    answer = decide(exchange(fleet()), headers, chat_body())
    removed = set(answer.request_body.response.header_mutation.remove_headers)
    assert set(CONTROL_HEADERS) <= removed and len(CONTROL_HEADERS) == 3


def test_an_adapter_name_of_the_only_base_model_is_placed_as_a_session_of_it() -> None:
    ex = exchange(fleet())
    answer = decide(ex, {"x-session-id": "lora-1"}, chat_body("m-sql-lora"))
    assert destination_of(answer)[0].startswith("10.0.0.")
    assert ex.route is not None and ex.route.new is not None
    assert ex.route.new.model == "m" and ex.route.model == "m"


def test_an_unknown_name_among_several_models_goes_statelessly_to_any_ready_worker() -> None:
    bindings = table([worker("big", "10.0.0.1", model="big"), worker("small", "10.0.0.2")])
    ex = exchange(bindings)
    answer = decide(ex, {"x-session-id": "s"}, chat_body("alias"))
    assert destination_of(answer)[0] in {"10.0.0.1:8000", "10.0.0.2:8000"}
    assert ex.route is not None and ex.route.session is None and ex.route.new is None
    # The rewrite header names the model to route by: a session of "big".
    ex = exchange(bindings)
    answer = decide(
        ex, {"x-session-id": "s", "x-gateway-model-name-rewrite": "big"}, chat_body("x")
    )
    assert destination_of(answer)[0] == "10.0.0.1:8000"
    assert ex.route is not None and ex.route.new is not None and ex.route.new.model == "big"


# --- item 6: Anthropic usage at the head ------------------------------------------------


def anthropic_stream() -> list[bytes]:
    start = {
        "type": "message_start",
        "message": {"usage": {"input_tokens": 900, "cache_read_input_tokens": 800}},
    }
    filler = {"type": "content_block_delta", "delta": {"text": "x" * 2000}}
    delta = {"type": "message_delta", "usage": {"output_tokens": 12}}
    events = [start, *([filler] * 12), delta]
    return [f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events]


def test_an_anthropic_stream_counts_the_prompt_from_its_message_start() -> None:
    ex = exchange(fleet())
    decide(ex, {"x-session-id": "a"}, chat_body())
    ex.receive(response_headers(event_stream=True), 0.0)
    chunks = anthropic_stream()
    for i, chunk in enumerate(chunks):
        ex.receive(response_body(chunk, i == len(chunks) - 1), 0.0)
    assert ex.outcome is not None and ex.outcome.usage is not None
    usage = ex.outcome.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (1700, 12)
    assert usage.cached_tokens == 800


# --- item 6: where a session is bound, when a turn ends ---------------------------------


class Creator:
    def __init__(self, bindings: BindingTable) -> None:
        self.calls: list[tuple[str, str | None]] = []
        self.bindings = bindings

    async def ensure(self, identity: Any, model: str, *, placed: str | None = None) -> Any:
        self.calls.append((identity.session_id, placed))
        self.bindings.apply_session(session(identity.session_id, placed))


@asynccontextmanager
async def serve(
    bindings: BindingTable, *, fallbacks: int = 0, linger: float = 120.0
) -> AsyncIterator[tuple[Any, Processor]]:
    """An in-process EPP over real gRPC; yields its stub and its processor."""
    settings = EppSettings(
        picker=PickerConfig(fallbacks=fallbacks, session_rates=NO_LIMITS),
        exchange=ExchangeSettings(MODES.FULL_DUPLEX_STREAMED, MODES.FULL_DUPLEX_STREAMED),
        unobserved_turn_seconds=linger,
    )
    metrics = RouterMetrics(bindings)
    gaie = GaieMetrics(metrics.registry, bindings, "agents", lambda w: True)
    processor = Processor(bindings, settings, UsageLedger(10.0), metrics, gaie=gaie)
    processor.creator = Creator(bindings)  # type: ignore[assignment]
    health = Health(bindings)
    server, port = grpc_server(processor, health, "127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield pb_grpc.ExternalProcessorStub(channel), processor
    finally:
        await channel.close()
        await server.stop(None)


async def ask(stub: Any, sid: str, body: bytes = b"") -> tuple[Any, list[Any]]:
    """Open a stream and send a session's request, as Envoy does; the call and answers."""
    call = stub.Process()
    messages = [request_headers({"x-session-id": sid}), request_body(body or chat_body(), True)]
    return call, await send(call, messages, 2)


async def send(call: Any, messages: list[Any], expect: int) -> list[Any]:
    for message in messages:
        await call.write(message)
    return [await asyncio.wait_for(call.read(), 5) for _ in range(expect)]


async def until(check: Any) -> None:
    for _ in range(200):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not reached")


async def test_a_new_session_served_by_a_fallback_is_bound_where_it_was_served() -> None:
    bindings = fleet()
    async with serve(bindings, fallbacks=2) as (stub, processor):
        body = chat_body()
        call, answers = await ask(stub, "fb", body)
        listed = destination_of(answers[0])[0].split(",")
        primary, fallback = listed[0], listed[1]
        # The data plane could not reach the primary and served it at the fallback.
        await send(call, [response_headers(served=fallback)], 1)
        creator: Any = processor.creator
        await until(lambda: creator.calls)
        by_address = {
            (w.endpoint or "").removeprefix("http://"): w.name for w in bindings.workers.values()
        }
        assert creator.calls == [("fb", by_address[fallback])]
        assert by_address[primary] != by_address[fallback]
        await send(call, [response_body(b"{}", True)], 1)
        await call.done_writing()
        # The next turn goes where the session is bound: the fallback.
        call, answers = await ask(stub, "fb", body)
        assert destination_of(answers[0])[0] == fallback
        call.cancel()


async def test_a_turn_ends_at_the_response_end_not_at_a_half_close_before_it() -> None:
    """NGINX Gateway Fabric's shim: headers, body, half-close, and no response on the stream."""
    bindings = fleet([session("ng", "w-1")])
    name = session_object_name("ng", None)
    async with serve(bindings, linger=30.0) as (stub, processor):
        body = chat_body()
        call, answers = await ask(stub, "ng", body)
        assert destination_of(answers[0])[0] == "10.0.0.1:8000"
        await call.done_writing()
        assert await asyncio.wait_for(call.read(), 5) is not None  # EOF: the call ends
        await call.code()
        # The engine is still answering where the EPP cannot see: the turn still counts.
        await asyncio.sleep(0.05)
        assert processor.turns.sessions.get(name) == 1
        assert bindings.workers["w-1"].in_flight == 1
        # Envoy-style: the session's next turn ends the previous one, and itself ends at the
        # response's end of stream, before the gateway closes its side.
        call, _ = await ask(stub, "ng", body)
        assert processor.turns.sessions.get(name) == 1
        chunks = sse_chunks()
        await send(call, [response_headers(event_stream=True)], 1)
        assert processor.turns.sessions.get(name) == 1  # the response is streaming
        await send(call, [response_body(c, i == len(chunks) - 1) for i, c in enumerate(chunks)], 3)
        await until(lambda: not processor.turns.sessions.get(name))
        assert bindings.workers["w-1"].in_flight == 0
        await call.done_writing()


async def test_an_unobserved_turn_stops_counting_after_its_time() -> None:
    bindings = fleet([session("ng", "w-1")])
    name = session_object_name("ng", None)
    async with serve(bindings, linger=0.2) as (stub, processor):
        call, _ = await ask(stub, "ng")
        await call.done_writing()
        await call.code()
        assert processor.turns.sessions.get(name) == 1
        await until(lambda: not processor.turns.sessions.get(name))


async def test_a_held_request_of_the_session_ends_its_unobserved_turn() -> None:
    """The migration handshake is not kept waiting: the session's next request (held
    while Migrating) shows the unobserved turn is over."""
    bindings = fleet([session("ng", "w-1")])
    name = session_object_name("ng", None)
    async with serve(bindings, linger=60.0) as (stub, processor):
        call, _ = await ask(stub, "ng")
        await call.done_writing()
        await call.code()
        assert processor.turns.sessions.get(name) == 1
        bindings.apply_session(session("ng", "w-1", phase="Migrating"))
        call, answers = await ask(stub, "ng")
        status, _, body = immediate_of(answers[0])
        assert (status, body["error"]["code"]) == (503, "session_held")
        assert not processor.turns.sessions.get(name)
        assert bindings.workers["w-1"].in_flight == 0


# --- item 7: GAIE's metric names ---------------------------------------------------------


async def test_gaie_metrics_are_exported_under_their_names_and_labels() -> None:
    bindings = fleet([session("g", "w-1")])
    async with serve(bindings) as (stub, processor):
        call, _ = await ask(stub, "g")
        chunks = sse_chunks()
        await send(call, [response_headers(event_stream=True)], 1)
        await send(call, [response_body(c, i == len(chunks) - 1) for i, c in enumerate(chunks)], 3)
        await call.done_writing()
        await call.code()
        # A request the EPP refuses: an error of GAIE's code.
        call = stub.Process()
        bad = {"x-session-id": "bad id"}
        await send(call, [request_headers(bad), request_body(chat_body(), True)], 1)
        await call.code()
    text = generate_latest(processor.metrics.registry).decode()
    labels = 'model_name="m",target_model_name="m"'
    assert f"inference_objective_request_total{{{labels}}} 1.0" in text
    assert f"inference_objective_input_tokens_sum{{{labels}}} 120.0" in text
    assert f"inference_objective_output_tokens_sum{{{labels}}} 7.0" in text
    assert (
        f'inference_objective_request_duration_seconds_bucket{{le="3600.0",{labels}}} 1.0' in text
    )
    assert 'inference_objective_running_requests{model_name="m"} 0.0' in text
    assert 'error_code="BadRequest"' in text
    assert 'inference_pool_ready_pods{name="agents"} 3.0' in text
    assert 'inference_pool_average_kv_cache_utilization{name="agents"}' in text
    assert "inference_extension_info{" in text
    assert "sessionfleet_router_requests_total" in text  # alongside sessionfleet_*
