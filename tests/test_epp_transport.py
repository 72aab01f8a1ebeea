"""The EPP behind real gateways' transport: TLS, the body limits, an unannounced mode.

Over a real in-process grpc.aio server and the generated stub, as in test_epp_server.py.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from epp_fakes import (
    MODES,
    chat_body,
    destination_of,
    fleet,
    immediate_of,
    request_body,
    request_headers,
    session,
)

from sessionfleet.epp.cli import listeners_from_args, settings_from_args
from sessionfleet.epp.picker import EndpointPicker, PickerConfig
from sessionfleet.epp.protocol import Exchange, ExchangeSettings
from sessionfleet.epp.server import EppSettings, Health, Processor, grpc_server, receive_limit
from sessionfleet.epp.tls import CERT_FILE, KEY_FILE, CertificateDirectory, self_signed
from sessionfleet.epp.tls import server_credentials as tls_credentials
from sessionfleet.fronts.admission import SessionRates
from sessionfleet.fronts.bindings import BindingTable
from sessionfleet.fronts.body import BodyBudget
from sessionfleet.fronts.ledger import UsageLedger
from sessionfleet.fronts.metrics import RouterMetrics

SID = {"x-session-id": "task-42"}
NO_LIMITS = SessionRates(0, 0, 0, 0)


async def serve(
    table: BindingTable, *, credentials: Any = None, **settings: Any
) -> tuple[Any, int, Processor]:
    exchange = settings.pop("exchange", ExchangeSettings())
    processor = Processor(
        table,
        EppSettings(picker=PickerConfig(session_rates=NO_LIMITS), exchange=exchange, **settings),
        UsageLedger(10.0),
        RouterMetrics(table),
    )
    health = Health(table)
    await health.update()
    server, port = grpc_server(processor, health, "127.0.0.1:0", credentials=credentials)
    await server.start()
    return server, port, processor


@pytest.fixture
async def plain() -> AsyncIterator[tuple[int, Processor]]:
    server, port, processor = await serve(fleet([session("task-42", "w-2")]))
    yield port, processor
    await server.stop(None)


async def read(call: Any, count: int, timeout: float = 5) -> list[Any]:
    return [await asyncio.wait_for(call.read(), timeout) for _ in range(count)]


async def one_turn(channel: grpc.aio.Channel) -> tuple[str, str]:
    """A bound session's request headers and body; the destination the EPP names."""
    call = pb_grpc.ExternalProcessorStub(channel).Process()
    await call.write(request_headers(SID))
    await call.write(request_body(chat_body(), True))
    answers = await read(call, 2)
    call.cancel()
    return destination_of(answers[0])


# --- TLS --------------------------------------------------------------------------------


def write_pair(directory: Path, names: list[str]) -> bytes:
    pair = self_signed(names)
    (directory / CERT_FILE).write_bytes(pair.certificate)
    (directory / KEY_FILE).write_bytes(pair.key)
    return pair.certificate


async def serve_tls_from(path: Path) -> tuple[Any, int]:
    """An EPP serving TLS from the certificate directory ``path``; its server and port."""
    directory = CertificateDirectory(path)
    server, port, _ = await serve(
        fleet([session("task-42", "w-2")]),
        credentials=tls_credentials(directory.current, directory),
    )
    return server, port


def names_in(certificate: bytes) -> list[str]:
    parsed = x509.load_pem_x509_certificate(certificate)
    alternatives = parsed.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [*alternatives.get_values_for_type(x509.DNSName)] + [
        str(ip) for ip in alternatives.get_values_for_type(x509.IPAddress)
    ]


def test_the_self_signed_certificate_names_the_host_and_loopback() -> None:
    pair = self_signed(["epp.inference.svc"])
    assert names_in(pair.certificate) == ["epp.inference.svc", "localhost", "127.0.0.1"]
    assert b"PRIVATE KEY" in pair.key


async def test_a_client_that_verifies_the_certificate_gets_its_turn_routed(tmp_path: Path) -> None:
    certificate = write_pair(tmp_path, ["epp-a"])
    server, port = await serve_tls_from(tmp_path)
    try:
        secure = grpc.ssl_channel_credentials(root_certificates=certificate)
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", secure) as channel:
            assert await one_turn(channel) == ("10.0.0.2:8000", "10.0.0.2:8000")
        # A plaintext client (an EPP behind a gateway that speaks TLS, reversed) fails.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises((grpc.aio.AioRpcError, asyncio.TimeoutError)):
                await asyncio.wait_for(one_turn(channel), 3)
    finally:
        await server.stop(None)


async def test_a_rotated_certificate_is_served_to_new_connections(tmp_path: Path) -> None:
    first = write_pair(tmp_path, ["first"])
    server, port = await serve_tls_from(tmp_path)
    try:
        assert names_in(ssl.get_server_certificate(("127.0.0.1", port)).encode())[0] == "first"
        later = time.time() + 5  # a modification time that surely differs
        second = write_pair(tmp_path, ["second"])
        for name in (CERT_FILE, KEY_FILE):
            os.utime(tmp_path / name, (later, later))
        served = ssl.get_server_certificate(("127.0.0.1", port)).encode()
        assert names_in(served)[0] == "second"
        assert served != first
        secure = grpc.ssl_channel_credentials(root_certificates=second)
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", secure) as channel:
            assert await one_turn(channel) == ("10.0.0.2:8000", "10.0.0.2:8000")
    finally:
        await server.stop(None)


def test_a_half_written_rotation_keeps_the_pair_in_use(tmp_path: Path) -> None:
    write_pair(tmp_path, ["first"])
    directory = CertificateDirectory(tmp_path)
    (tmp_path / KEY_FILE).write_text("not yet")
    assert directory.changed() is None
    assert names_in(directory.current.certificate)[0] == "first"


def test_a_cert_path_without_its_files_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--cert-path .*tls.crt"):
        CertificateDirectory(tmp_path)


# --- flags ------------------------------------------------------------------------------


def parse(*flags: str) -> Any:
    import argparse

    from sessionfleet.epp.cli import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["epp", *flags])


def test_the_defaults_serve_tls_one_endpoint_and_one_body_limit() -> None:
    args = parse()
    settings, listeners = settings_from_args(args), listeners_from_args(args)
    assert (listeners.secure, listeners.cert_path, listeners.health_port) == (True, None, 9003)
    assert settings.picker.fallbacks == 0
    assert settings.exchange.max_body_bytes == 8 << 20
    assert settings.max_inflight_body_bytes == 192 << 20
    assert settings.mode_probe_seconds == 0.1
    plain = listeners_from_args(parse("--no-secure-serving", "--cert-path=/tls"))
    assert (plain.secure, plain.cert_path) == (False, "/tls")


def test_a_body_budget_under_one_body_is_refused() -> None:
    with pytest.raises(ValueError, match="--max-inflight-body-bytes"):
        settings_from_args(parse("--max-body-bytes=1000", "--max-inflight-body-bytes=999"))


# --- body limits ------------------------------------------------------------------------


def padded_body(size: int) -> bytes:
    """A chat body of about ``size`` bytes whose model comes after the long messages."""
    filler = "x" * size
    return ('{"messages": [{"role": "user", "content": "' + filler + '"}], "model": "m"}').encode()


async def test_a_buffered_body_over_grpcs_default_receive_limit_is_routed(
    plain: tuple[int, Processor],
) -> None:
    """5 MiB in one BUFFERED message: grpc.aio's default 4 MiB refused it as a stream error."""
    port, _ = plain
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process()
        await call.write(request_headers(SID, mode=MODES.BUFFERED))
        await read(call, 1)
        await call.write(request_body(padded_body(5 << 20), True))
        (answer,) = await read(call, 1)
        assert answer.WhichOneof("response") == "request_body"
        assert destination_of(answer) == ("10.0.0.2:8000", "10.0.0.2:8000")
        call.cancel()


async def test_a_buffered_body_over_the_limit_is_answered_413() -> None:
    server, port, _ = await serve(
        fleet([session("task-42", "w-2")]), exchange=ExchangeSettings(max_body_bytes=1 << 20)
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process()
            await call.write(request_headers(SID, mode=MODES.BUFFERED))
            await read(call, 1)
            await call.write(request_body(padded_body(int(1.5 * (1 << 20))), True))
            (answer,) = await read(call, 1)
            status, _, error = immediate_of(answer)
            assert (status, error["error"]["code"]) == (413, "body_too_large")
    finally:
        await server.stop(None)


def test_grpc_accepts_a_message_past_the_body_limit_so_the_epp_can_answer_413() -> None:
    assert receive_limit(8 << 20) > (8 << 20) + (64 << 10)


def exchange_with(budget: BodyBudget, max_body: int = 1 << 20) -> Exchange:
    picker = EndpointPicker(
        fleet([session("task-42", "w-2")]), PickerConfig(session_rates=NO_LIMITS), now=0.0
    )
    return Exchange(
        picker,
        ExchangeSettings(
            MODES.FULL_DUPLEX_STREAMED, MODES.FULL_DUPLEX_STREAMED, max_body_bytes=max_body
        ),
        started=1.0,
        budget=budget,
    )


def test_bodies_held_at_once_past_the_budget_are_answered_503_and_given_back() -> None:
    budget = BodyBudget(1000)
    first, second = exchange_with(budget), exchange_with(budget)
    for each in (first, second):
        each.receive(request_headers(SID), 1.0)
    assert first.receive(request_body(b"x" * 700, False), 1.0) == []
    assert budget.used == 700
    (answer,) = second.receive(request_body(b"x" * 400, False), 1.0)
    status, headers, error = immediate_of(answer)
    assert (status, error["error"]["code"]) == (503, "epp_overloaded")
    assert headers["retry-after"] == "5"
    assert budget.used == 700  # the refused chunk took nothing
    first.close()
    assert budget.used == 0


def test_a_decided_body_gives_its_bytes_back_before_the_response() -> None:
    budget = BodyBudget(1 << 20)
    exchange = exchange_with(budget)
    exchange.receive(request_headers(SID), 1.0)
    body = chat_body()
    exchange.receive(request_body(body[:30], False), 1.0)
    assert budget.used == 30
    answers = exchange.receive(request_body(body[30:], True), 1.0)
    assert destination_of(answers[0]) == ("10.0.0.2:8000", "10.0.0.2:8000")
    assert budget.used == 0


def test_a_large_body_is_handed_out_to_parse_off_the_loop_and_its_model_used() -> None:
    exchange = exchange_with(BodyBudget(1 << 24), max_body=1 << 22)
    exchange.receive(request_headers(SID), 1.0)
    body = padded_body(200_000)
    assert exchange.body_to_parse(request_body(body[:1000], False)) is None  # not complete
    exchange.receive(request_body(body[:1000], False), 1.0)
    last = request_body(body[1000:], True)
    assert exchange.body_to_parse(last) == body
    exchange.parsed_model = "m"
    answers = exchange.receive(last, 1.0)
    assert destination_of(answers[0]) == ("10.0.0.2:8000", "10.0.0.2:8000")
    small = exchange_with(BodyBudget(1 << 24))
    small.receive(request_headers(SID), 1.0)
    assert small.body_to_parse(request_body(chat_body(), True)) is None  # parsed inline


async def test_a_large_crafted_body_is_refused_400_by_the_parse_off_the_loop(
    plain: tuple[int, Processor],
) -> None:
    port, _ = plain
    crafted = b'{"messages": [' + b"[" * 100_000 + b"]" * 100_000 + b"]}"
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process()
        await call.write(request_headers(SID))
        await call.write(request_body(crafted, True))
        (answer,) = await read(call, 1)
        status, _, error = immediate_of(answer)
        assert (status, error["error"]["code"]) == (400, "invalid_body")


# --- a gateway that announces no mode ---------------------------------------------------


async def test_a_synchronous_gateway_without_protocol_config_gets_its_answer_at_the_headers(
    plain: tuple[int, Processor],
) -> None:
    """Envoy before 1.34 in BUFFERED mode: headers, then it waits for their answer."""
    port, processor = plain
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process()
        await call.write(request_headers(SID))
        (answer,) = await read(call, 1, timeout=2)  # the probe is 0.1 s, Envoy's timeout 0.2
        assert answer.WhichOneof("response") == "request_headers"
        assert destination_of(answer) == ("10.0.0.2:8000", "10.0.0.2:8000")
        await call.write(request_body(chat_body(), True))
        (answer,) = await read(call, 1)
        assert answer.WhichOneof("response") == "request_body"
        assert not answer.request_body.response.HasField("body_mutation")  # let through
        call.cancel()
    assert processor.table.workers["w-2"].in_flight <= 1


async def test_a_duplex_gateway_without_protocol_config_is_decided_at_the_body_end(
    plain: tuple[int, Processor],
) -> None:
    """NGINX Gateway Fabric's shim: no protocol_config, the body right after the headers."""
    port, _ = plain
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process()
        await call.write(request_headers(SID))
        await call.write(request_body(chat_body(), True))
        answers = await read(call, 2)
        kinds = [a.WhichOneof("response") for a in answers]
        assert kinds == ["request_headers", "request_body"]
        assert answers[1].request_body.response.body_mutation.streamed_response.body
        call.cancel()


async def test_with_the_probe_off_an_unannounced_synchronous_gateway_waits() -> None:
    server, port, _ = await serve(fleet([session("task-42", "w-2")]), mode_probe_seconds=0.0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process()
            await call.write(request_headers(SID))
            with pytest.raises(asyncio.TimeoutError):
                await read(call, 1, timeout=0.5)
            call.cancel()
    finally:
        await server.stop(None)
