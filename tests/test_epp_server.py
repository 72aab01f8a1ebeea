"""The EPP's gRPC server over a real in-process grpc.aio server and the generated stub.

No Kubernetes: the binding table is filled directly, as the watches would fill it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from epp_client import Envoy, Upstream
from epp_fakes import (
    MODES,
    chat_body,
    completion,
    destination_of,
    fleet,
    immediate_of,
    request_body,
    request_headers,
    response_body,
    response_headers,
    session,
    sse_chunks,
    worker,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from router_fakes import FakeKube

from sessionfleet.api import SessionClient
from sessionfleet.epp.picker import PickerConfig
from sessionfleet.epp.protocol import ExchangeSettings
from sessionfleet.epp.server import SERVICE_NAME, EppSettings, Health, Processor, grpc_server
from sessionfleet.fronts.admission import SessionRates
from sessionfleet.fronts.bindings import BindingTable
from sessionfleet.fronts.identity import Identity, session_object_name
from sessionfleet.fronts.kubesync import SessionCreator
from sessionfleet.fronts.ledger import UsageLedger
from sessionfleet.fronts.metrics import RouterMetrics
from sessionfleet.fronts.requester import FAIRNESS_HEADER

SID = {"x-session-id": "task-42"}
NO_LIMITS = SessionRates(0, 0, 0, 0)
NAME = session_object_name("task-42", None)


@dataclass
class Bed:
    table: BindingTable
    processor: Processor
    health: Health
    channel: grpc.aio.Channel

    @property
    def stub(self) -> Any:
        return pb_grpc.ExternalProcessorStub(self.channel)


async def start(
    table: BindingTable,
    *,
    mode: int = MODES.FULL_DUPLEX_STREAMED,
    hold: float = 0.0,
    rates: SessionRates = NO_LIMITS,
) -> tuple[Any, Bed]:
    settings = EppSettings(
        picker=PickerConfig(session_rates=rates),
        exchange=ExchangeSettings(mode, mode),
        hold_timeout=hold,
    )
    processor = Processor(table, settings, UsageLedger(10.0), RouterMetrics(table))
    health = Health(table)
    await health.update()
    server, port = grpc_server(processor, health, "127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return server, Bed(table, processor, health, channel)


@pytest.fixture
async def bed() -> AsyncIterator[Bed]:
    server, test_bed = await start(fleet([session("task-42", "w-2")]))
    yield test_bed
    await test_bed.channel.close()
    await server.stop(None)


async def exchange(call: Any, messages: list[Any], expect: int) -> list[Any]:
    """Write ``messages`` in order, then read ``expect`` answers."""
    for message in messages:
        await call.write(message)
    return [await asyncio.wait_for(call.read(), 5) for _ in range(expect)]


def kinds(answers: list[Any]) -> list[str]:
    return [a.WhichOneof("response") for a in answers]


async def test_full_duplex_turn_over_grpc(bed: Bed) -> None:
    call = bed.stub.Process()
    body = chat_body()
    answers = await exchange(
        call,
        [request_headers(SID), request_body(body[:30], False), request_body(body[30:], True)],
        3,
    )
    assert kinds(answers) == ["request_headers", "request_body", "request_body"]
    assert destination_of(answers[0]) == ("10.0.0.2:8000", "10.0.0.2:8000")
    assert bed.table.workers["w-2"].in_flight == 1
    chunks = sse_chunks()
    answers = await exchange(
        call,
        [response_headers(event_stream=True, served="10.0.0.2:8000")]
        + [response_body(c, i == len(chunks) - 1) for i, c in enumerate(chunks)],
        1 + len(chunks),
    )
    assert kinds(answers) == ["response_headers"] + ["response_body"] * len(chunks)
    assert [a.response_body.response.body_mutation.streamed_response.body for a in answers[1:]] == (
        chunks
    )
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK
    assert bed.table.workers["w-2"].in_flight == 0
    pending = bed.processor.ledger.pending(NAME)
    assert pending is not None and (pending.turns, pending.prompt_tokens) == (1, 120)


async def test_buffered_turn_over_grpc() -> None:
    server, bed = await start(fleet([session("task-42", "w-3")]), mode=MODES.BUFFERED)
    try:
        call = bed.stub.Process()
        answers = await exchange(call, [request_headers(SID)], 1)
        assert kinds(answers) == ["request_headers"]
        answers = await exchange(call, [request_body(chat_body(), True)], 1)
        assert destination_of(answers[0])[0] == "10.0.0.3:8000"
        answers = await exchange(call, [response_headers(), response_body(completion(), True)], 2)
        assert kinds(answers) == ["response_headers", "response_body"]
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
        assert bed.processor.ledger.pending(NAME) is not None
    finally:
        await bed.channel.close()
        await server.stop(None)


async def test_streamed_turn_over_grpc() -> None:
    server, bed = await start(fleet([session("task-42", "w-1")]), mode=MODES.STREAMED)
    try:
        call = bed.stub.Process()
        answers = await exchange(call, [request_headers(SID)], 1)
        assert destination_of(answers[0])[0] == "10.0.0.1:8000"
        body = chat_body(stream=True)
        answers = await exchange(
            call, [request_body(body[:20], False), request_body(body[20:], True)], 2
        )
        assert kinds(answers) == ["request_body", "request_body"]
        chunks = sse_chunks()
        answers = await exchange(
            call,
            [response_headers(event_stream=True)]
            + [response_body(c, i == len(chunks) - 1) for i, c in enumerate(chunks)],
            1 + len(chunks),
        )
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
        pending = bed.processor.ledger.pending(NAME)
        assert pending is not None and pending.cached_tokens == 100
    finally:
        await bed.channel.close()
        await server.stop(None)


async def test_immediate_response_ends_the_stream(bed: Bed) -> None:
    call = bed.stub.Process()
    answers = await exchange(
        call, [request_headers(SID, subset=["10.0.0.1:8000"]), request_body(chat_body(), True)], 1
    )
    status, headers, body = immediate_of(answers[0])
    assert status == 503 and body["error"]["code"] == "no_ready_worker"
    assert await call.read() == grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK
    assert bed.processor.ledger.pending(NAME) is None


async def test_new_session_is_placed_without_an_api_call(bed: Bed) -> None:
    call = bed.stub.Process()
    answers = await exchange(
        call, [request_headers({"x-session-id": "fresh"}), request_body(chat_body(), True)], 2
    )
    endpoints = destination_of(answers[0])[0].split(",")
    assert len(endpoints) == 3
    name = session_object_name("fresh", None)
    assert bed.processor.picker.provisional[name].worker != "w-2"  # w-2 holds a session
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF


async def test_held_session_answers_503_at_once_by_default() -> None:
    server, bed = await start(fleet([session("task-42", "w-1", phase="Migrating")]))
    try:
        call = bed.stub.Process()
        answers = await exchange(call, [request_headers(SID, end=True)], 1)
        status, headers, body = immediate_of(answers[0])
        assert (status, body["error"]["code"]) == (503, "session_held")
        assert headers["retry-after"] == "5"
    finally:
        await bed.channel.close()
        await server.stop(None)


async def test_held_session_is_released_when_bound_again() -> None:
    table = fleet([session("task-42", "w-1", phase="Migrating")])
    server, bed = await start(table, hold=5.0)
    try:
        call = bed.stub.Process()
        await call.write(request_headers(SID, end=True))
        read = asyncio.ensure_future(call.read())
        await asyncio.sleep(0.2)
        assert not read.done()
        table.apply_session(session("task-42", "w-3"))
        answer = await asyncio.wait_for(read, 5)
        assert destination_of(answer)[0] == "10.0.0.3:8000"
        await call.done_writing()
    finally:
        await bed.channel.close()
        await server.stop(None)


async def test_health_services_follow_the_bindings() -> None:
    table = BindingTable()
    server, bed = await start(table)
    try:
        stub = health_pb2_grpc.HealthStub(bed.channel)

        async def status(service: str) -> int:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
            return int(reply.status)

        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        assert await status("liveness") == serving
        assert await status("readiness") == not_serving
        assert await status(SERVICE_NAME) == not_serving
        table.replace_workers([])
        table.replace_sessions([])
        await bed.health.update()
        assert await status("readiness") == serving
        assert await status(SERVICE_NAME) == serving
    finally:
        await bed.channel.close()
        await server.stop(None)


def test_cli_flags_make_the_settings() -> None:
    from sessionfleet.cli import build_parser
    from sessionfleet.epp.cli import settings_from_args

    args = build_parser().parse_args(
        [
            "epp",
            "--namespace=agents",
            "--port=9100",
            "--metrics-port=0",
            "--session-header=X-Task",
            "--hold-timeout=2.5",
            "--fallbacks=0",
            "--request-body-mode=BUFFERED",
        ]
    )
    settings = settings_from_args(args)
    assert (args.port, args.metrics_port) == (9100, 0)
    assert settings.namespace == "agents"
    assert settings.picker.headers.session_header == "X-Task"
    assert settings.picker.fallbacks == 0 and settings.hold_timeout == 2.5
    assert settings.exchange.request_body_mode == MODES.BUFFERED
    assert settings.exchange.response_body_mode == MODES.FULL_DUPLEX_STREAMED


async def test_new_session_is_recorded_in_the_background_with_the_choice_as_hint() -> None:
    table = fleet()
    server, bed = await start(table)
    calls: list[tuple[str, str, str | None]] = []
    release = asyncio.Event()

    class Creator:
        async def ensure(self, identity: Any, model: str, *, placed: str | None = None) -> Any:
            calls.append((identity.session_id, model, placed))
            await release.wait()  # the API server is slow: the answer does not wait for it
            table.apply_session(session(identity.session_id, placed))

    bed.processor.creator = Creator()  # type: ignore[assignment]
    try:
        call = bed.stub.Process()
        answers = await exchange(
            call, [request_headers({"x-session-id": "new-1"}), request_body(chat_body(), True)], 2
        )
        first = destination_of(answers[0])[0].split(",")[0]
        name = session_object_name("new-1", None)
        # Recorded once the response shows where it was served.
        await asyncio.sleep(0.05)
        assert not calls
        await exchange(call, [response_headers(served=first)], 1)
        for _ in range(50):
            if calls:
                break
            await asyncio.sleep(0.01)
        assert calls and calls[0][0] == "new-1" and calls[0][1] == "m"
        hinted = table.workers[calls[0][2] or ""]
        assert hinted.endpoint == f"http://{first}"
        assert name in bed.processor.picker.provisional
        release.set()
        for _ in range(50):
            if name not in bed.processor.picker.provisional:
                break
            await asyncio.sleep(0.01)
        assert name not in bed.processor.picker.provisional
        assert table.session_named(name) is not None
        await call.done_writing()
    finally:
        await bed.channel.close()
        await server.stop(None)


async def test_the_epps_choice_is_recorded_as_it_is_not_placed_again() -> None:
    """The turn went to the EPP's choice, so its KV cache is there: the hint says so.

    Even when the router's table, by the time the create runs, would place the session
    elsewhere (here its worker has filled up): the operator admits the hint or says why
    not (sessionfleet.policy.placement.admit_or_place), the front never places twice.
    """
    table = fleet([session("other", "w-2")])
    table.apply_worker(worker("w-2", "10.0.0.2", max_sessions=1))  # full now
    kube = FakeKube()
    creator = SessionCreator(
        kube, "ns", table, RouterMetrics(table), replica="epp", timeout=5, retry_after=1
    )
    identity = Identity("new-1", None, SessionClient.HEADER, final=False, header="x-session-id")
    view, created = await creator.ensure(identity, "m", placed="w-2")
    assert created and view.worker == "w-2"
    assert kube.obj("agentsessions", view.name)["spec"]["workerHint"] == "w-2"
    view, created = await creator.ensure(replace(identity, session_id="new-2"), "m")
    assert created and view.worker not in (None, "w-2")  # the router's own turn: placed


@pytest.mark.parametrize("mode", [MODES.FULL_DUPLEX_STREAMED, MODES.BUFFERED])
async def test_the_envoy_replay_client_counts_the_turn_in_flight_until_the_stream_ends(
    bed: Bed, mode: int
) -> None:
    """The shared client (tests/epp_client.py, also used by e2e/test_epp.py) in both modes.

    While the upstream answers, the session's turn is in flight (the migration
    handshake acknowledges only without one); the stream's end clears it.
    """
    seen: list[tuple[str, dict[str, str], bytes, int]] = []

    async def forward(endpoint: str, headers: dict[str, str], body: bytes) -> Upstream:
        seen.append((endpoint, headers, body, bed.processor.turns.sessions.get(NAME, 0)))
        return Upstream(200, {"content-type": "text/event-stream"}, sse_chunks())

    bed.processor.turns.ended_event.clear()
    turn = await Envoy(bed.channel).turn(SID, chat_body(), forward, mode=mode, chunk=40)
    assert turn.destination == ["10.0.0.2:8000"] and turn.immediate is None
    ((endpoint, headers, body, in_flight),) = seen
    assert (endpoint, body, in_flight) == ("10.0.0.2:8000", chat_body(), 1)
    assert headers["x-sessionfleet-session-id"] == "task-42"
    assert turn.body == b"".join(sse_chunks())
    assert NAME not in bed.processor.turns.sessions and bed.processor.turns.ended_event.is_set()
    pending = bed.processor.ledger.pending(NAME)
    assert pending is not None and pending.turns == 1


async def test_the_first_of_two_overlapping_turns_ending_is_no_turn_boundary(bed: Bed) -> None:
    """The migration handshake hears "turn ended" only when the session's last turn ends.

    Two turns of one session are in flight through the EPP; the first one's end must not
    wake the acknowledger as if the session were at a turn boundary (it used to).
    """
    gates = [asyncio.Event(), asyncio.Event()]
    arrived: list[int] = []
    turns = bed.processor.turns

    async def forward(endpoint: str, headers: dict[str, str], body: bytes) -> Upstream:
        mine = len(arrived)
        arrived.append(mine)
        await gates[mine].wait()
        return Upstream(200, {"content-type": "application/json"}, [completion()])

    async def until(check: Any) -> None:
        for _ in range(500):
            if check():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("not reached")

    envoy = Envoy(bed.channel)
    first = asyncio.ensure_future(envoy.turn(SID, chat_body(), forward))
    await until(lambda: len(arrived) == 1)
    second = asyncio.ensure_future(envoy.turn(SID, chat_body(), forward))
    await until(lambda: len(arrived) == 2)
    assert turns.sessions.get(NAME) == 2
    turns.ended_event.clear()
    gates[0].set()
    await first
    await until(lambda: turns.sessions.get(NAME) == 1)
    assert not turns.ended_event.is_set()
    gates[1].set()
    await second
    await until(lambda: NAME not in turns.sessions)
    assert turns.ended_event.is_set() and bed.table.workers["w-2"].in_flight == 0


async def test_one_client_at_the_new_session_limit_does_not_stop_another() -> None:
    """Through the gRPC ext_proc stream, as Envoy sends GAIE's fairness id."""
    server, bed = await start(fleet(), rates=SessionRates(0.001, 3, 100, 100))

    async def forward(endpoint: str, headers: dict[str, str], body: bytes) -> Upstream:
        return Upstream(200, {"content-type": "application/json"}, [completion()])

    async def new_session(client: str | None, n: int) -> int:
        headers = {"x-session-id": f"{client}-{n}"}
        if client is not None:
            headers[FAIRNESS_HEADER] = client
        turn = await Envoy(bed.channel).turn(headers, chat_body(), forward)
        return turn.immediate[0] if turn.immediate is not None else 200

    try:
        assert [await new_session("tenant-a", n) for n in range(5)] == [200] * 3 + [429] * 2
        assert await new_session("tenant-b", 0) == 200
        # Requests without a fairness id share one key of their own.
        assert [await new_session(None, n) for n in range(4)] == [200] * 3 + [429]
        assert bed.processor.picker.limiter.tracked == 3
    finally:
        await bed.channel.close()
        await server.stop(None)
