"""An ext_proc v3 client that plays Envoy's part against an Endpoint Picker.

Shared by the unit tests (``tests/test_epp_server.py``, against an in-process server),
the e2e test (``e2e/test_epp.py``, against a ``sessionfleet epp`` process) and the
benchmarks (``bench/epp/run.py``; ``bench/epp/gateway.py``, a stand-in for Envoy that
drives a :class:`Stream` per HTTP request). It imports only the Envoy protos, gRPC and
protobuf, so all can import it: the unit tests as ``epp_client``, the others as
``tests.epp_client``.

The messages and their order follow what Envoy's ext_proc filter sends for an HTTP
request to an ``InferencePool`` under the Gateway API Inference Extension's Endpoint
Picker protocol (v1.0.0, ``docs/proposals/004-endpoint-picker-protocol/README.md`` in
kubernetes-sigs/gateway-api-inference-extension):

1. ``request_headers`` (``:method``, ``:path``, ``:authority``, ``:scheme``,
   ``content-type``, the client's headers), with ``protocol_config`` naming the body
   modes on this first message, and the endpoint subset hint, if any, in
   ``metadata_context.filter_metadata["envoy.lb.subset_hint"]``;
2. the request body: in ``FULL_DUPLEX_STREAMED`` chunk after chunk without waiting for
   answers, ``end_of_stream`` on the last (the EPP answers the headers, with the
   destination, then each chunk back as ``streamed_response``); in ``BUFFERED``, after
   the headers' answer, the whole body in one message (answered with the destination);
3. the request goes to the primary endpoint of ``x-gateway-destination-endpoint``
   (``ip:port``) with the EPP's header mutations applied, and the body Envoy holds: the
   chunks the EPP streamed back in ``FULL_DUPLEX_STREAMED``, the original in ``BUFFERED``;
4. ``response_headers`` from the upstream, with the endpoint that served the request in
   ``metadata_context.filter_metadata["envoy.lb"]["x-gateway-destination-endpoint-served"]``;
5. the response body as it arrives (``FULL_DUPLEX_STREAMED``: chunk by chunk, each
   echoed back by the EPP; ``BUFFERED``: once, whole), ``end_of_stream`` on the last;
6. the end of the stream (half-close); the EPP ends the call.

An ``ImmediateResponse`` at any point ends the exchange: Envoy answers the client with
it and sends nothing more.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2

MODES = processing_mode_pb2.ProcessingMode
DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"


# --- messages, as Envoy builds them ---------------------------------------------------


def _header_map(headers: dict[str, str]) -> Any:
    return base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
    )


def request_headers(
    headers: dict[str, str],
    *,
    end: bool = False,
    subset: list[str] | None = None,
    mode: int | None = None,
    response_mode: int | None = None,
) -> Any:
    message = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=_header_map({":method": "POST", ":path": "/v1/chat/completions", **headers}),
            end_of_stream=end,
        )
    )
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({SUBSET: subset})
        message.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    if mode is not None:
        message.protocol_config.CopyFrom(
            pb.ProtocolConfiguration(
                request_body_mode=mode,
                response_body_mode=response_mode if response_mode is not None else mode,
            )
        )
    return message


def request_body(data: bytes, end: bool) -> Any:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end))


def response_headers(
    status: int = 200,
    *,
    served: str | None = None,
    served_header: str | None = None,
    event_stream: bool = False,
    end: bool = False,
    headers: dict[str, str] | None = None,
) -> Any:
    """Response headers; ``headers`` (the upstream's own) replace the made-up ones."""
    if headers is None:
        headers = {"content-type": "text/event-stream" if event_stream else "application/json"}
    headers = {":status": str(status), **headers}
    if served_header:
        headers[SERVED] = served_header
    message = pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(headers=_header_map(headers), end_of_stream=end)
    )
    if served is not None:
        lb = struct_pb2.Struct()
        lb.update({SERVED: served})
        message.metadata_context.filter_metadata["envoy.lb"].CopyFrom(lb)
    return message


def response_body(data: bytes, end: bool) -> Any:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=end))


# --- reading the EPP's answers ----------------------------------------------------------


def set_headers(common: Any) -> dict[str, str]:
    return {o.header.key: o.header.raw_value.decode() for o in common.header_mutation.set_headers}


def destination_of(answer: Any) -> tuple[str, str]:
    """Return (header value, dynamic metadata value) of a deciding answer."""
    kind = answer.WhichOneof("response")
    common = getattr(answer, kind).response
    header = set_headers(common)[DESTINATION]
    metadata = answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    return header, metadata[DESTINATION].string_value


def immediate_of(answer: Any) -> tuple[int, dict[str, str], dict[str, Any]]:
    """Return (status, headers, JSON body) of an ImmediateResponse."""
    assert answer.WhichOneof("response") == "immediate_response"
    response = answer.immediate_response
    headers = {o.header.key: o.header.raw_value.decode() for o in response.headers.set_headers}
    return response.status.code, headers, json.loads(response.body)


def streamed_body(answer: Any, kind: str) -> bytes:
    """The chunk a ``FULL_DUPLEX_STREAMED`` body answer sends on (``request_body``/…)."""
    assert answer.WhichOneof("response") == kind, answer
    return bytes(getattr(answer, kind).response.body_mutation.streamed_response.body)


# --- one request, end to end ------------------------------------------------------------


@dataclass
class Upstream:
    """What the endpoint answered: status, headers and the body in its chunks."""

    status: int
    headers: dict[str, str]
    chunks: list[bytes]


Forward = Callable[[str, dict[str, str], bytes], Awaitable[Upstream]]
"""Sends (endpoint ``ip:port``, request headers, body) upstream, as Envoy would."""


@dataclass
class Turn:
    """How one request went through the EPP."""

    destination: list[str] = field(default_factory=list)
    """The endpoints the EPP chose, primary first; empty when it answered itself."""
    mutations: dict[str, str] = field(default_factory=dict)
    """The request headers the EPP set."""
    removed: list[str] = field(default_factory=list)
    """The request headers the EPP removed (Envoy drops them before the upstream)."""
    immediate: tuple[int, dict[str, str], dict[str, Any]] | None = None
    upstream: Upstream | None = None
    sent: bytes = b""
    """The request body Envoy forwards: the EPP's echo in ``FULL_DUPLEX_STREAMED``."""
    body: bytes = b""
    """The response body the client got (echoed by the EPP in ``FULL_DUPLEX_STREAMED``)."""

    @property
    def json(self) -> Any:
        return json.loads(self.body)


class Envoy:
    """Plays Envoy's ext_proc filter for one request per :meth:`turn`; see the module."""

    def __init__(self, channel: grpc.aio.Channel, *, timeout: float = 10.0) -> None:
        self.stub = pb_grpc.ExternalProcessorStub(channel)
        self.timeout = timeout

    def open(self, mode: int = MODES.FULL_DUPLEX_STREAMED) -> Stream:
        """Open one request's stream, to drive step by step (:class:`Stream`)."""
        return Stream(self.stub.Process(), mode, self.timeout)

    async def turn(
        self,
        headers: dict[str, str],
        body: bytes,
        forward: Forward,
        *,
        mode: int = MODES.FULL_DUPLEX_STREAMED,
        chunk: int = 64,
        subset: list[str] | None = None,
        authority: str = "gateway.local",
        announce: bool = True,
    ) -> Turn:
        """Send one request through the EPP and ``forward``; return what happened.

        ``announce=False`` sends no ``protocol_config``, as Envoy before 1.34 does; in
        ``BUFFERED`` mode the EPP then decides at the headers (its mode probe).
        """
        stream = self.open(mode)
        turn = await stream.request(
            headers, body, chunk=chunk, subset=subset, authority=authority, announce=announce
        )
        if turn.immediate is not None:
            return await stream.close(turn)
        upstream = await forward(turn.destination[0], upstream_headers(headers, turn), turn.sent)
        turn.upstream = upstream
        await stream.response_headers(upstream.status, upstream.headers, turn.destination[0])
        chunks = upstream.chunks or [b""]
        if mode == MODES.FULL_DUPLEX_STREAMED:
            for i, piece in enumerate(chunks):
                turn.body += await stream.response_chunk(piece, i == len(chunks) - 1)
        else:
            turn.body = await stream.response_chunk(b"".join(chunks), True)
        return await stream.close(turn)


def upstream_headers(headers: dict[str, str], turn: Turn) -> dict[str, str]:
    """Return the request headers Envoy sends upstream: the client's, as the EPP mutated them."""
    out = {k: v for k, v in headers.items() if not k.startswith(":") and k.lower() != "host"}
    for name in turn.removed:
        out = {k: v for k, v in out.items() if k.lower() != name}
    out.update(turn.mutations)
    out.pop(DESTINATION, None)
    out["content-type"] = "application/json"
    return out


class Stream:
    """One request's ext_proc stream, driven step by step in Envoy's order (the module's).

    :meth:`Envoy.turn` runs the steps for a whole upstream answer at once; a gateway
    stand-in (``bench/epp/gateway.py``) runs them as the upstream's answer arrives:
    :meth:`request` (the decision), then, after sending the request to
    ``turn.destination[0]``, :meth:`response_headers`, :meth:`response_chunk` per chunk
    and :meth:`close`.
    """

    def __init__(self, call: Any, mode: int, timeout: float) -> None:
        if mode not in (MODES.FULL_DUPLEX_STREAMED, MODES.BUFFERED):
            raise ValueError(f"body mode {mode} is not replayed here")
        self.call = call
        self.mode = mode
        self.timeout = timeout

    async def _read(self) -> Any:
        answer = await asyncio.wait_for(self.call.read(), self.timeout)
        assert answer is not grpc.aio.EOF, "the EPP ended the stream early"
        return answer

    async def request(
        self,
        headers: dict[str, str],
        body: bytes,
        *,
        chunk: int = 64,
        subset: list[str] | None = None,
        authority: str = "gateway.local",
        announce: bool = True,
    ) -> Turn:
        """Send the request's headers and body; return the EPP's decision as a :class:`Turn`.

        ``turn.immediate`` is set when the EPP answered itself (then only :meth:`close`
        is left); else ``turn.destination`` and ``turn.sent``, the body to forward.
        """
        call, mode, turn = self.call, self.mode, Turn()
        first = request_headers(
            {
                ":authority": authority,
                ":scheme": "http",
                "content-type": "application/json",
                "content-length": str(len(body)),
                **headers,
            },
            subset=subset,
            mode=mode if announce else None,
            response_mode=mode,
        )
        await call.write(first)
        if mode == MODES.FULL_DUPLEX_STREAMED:
            pieces = [body[i : i + chunk] for i in range(0, len(body), chunk)] or [b""]
            for i, piece in enumerate(pieces):
                await call.write(request_body(piece, i == len(pieces) - 1))
            answer = await self._read()
            if _ended(turn, answer):
                return turn
            assert answer.WhichOneof("response") == "request_headers", answer
            _decided(turn, answer)
            turn.sent = b"".join(
                [streamed_body(await self._read(), "request_body") for _ in pieces]
            )
            return turn
        answer = await self._read()
        if _ended(turn, answer):
            return turn
        assert answer.WhichOneof("response") == "request_headers", answer
        at_headers = DESTINATION in set_headers(answer.request_headers.response)
        if at_headers:
            _decided(turn, answer)
        await call.write(request_body(body, True))
        answer = await self._read()
        if _ended(turn, answer):
            return turn
        assert answer.WhichOneof("response") == "request_body", answer
        if not at_headers:
            _decided(turn, answer)
        turn.sent = body
        return turn

    async def response_headers(self, status: int, headers: dict[str, str], served: str) -> None:
        """Send the upstream's response headers, with the endpoint that ``served`` it."""
        await self.call.write(response_headers(status, served=served, headers=headers))
        answer = await self._read()
        assert answer.WhichOneof("response") == "response_headers", answer

    async def response_chunk(self, data: bytes, end: bool) -> bytes:
        """Send a piece of the response body; return what Envoy passes on to the client.

        ``FULL_DUPLEX_STREAMED``: the chunk the EPP sends back. ``BUFFERED``: the whole
        body, in one call with ``end``, passed on as it was.
        """
        await self.call.write(response_body(data, end))
        if self.mode == MODES.FULL_DUPLEX_STREAMED:
            return streamed_body(await self._read(), "response_body")
        answer = await self._read()
        assert answer.WhichOneof("response") == "response_body", answer
        return data

    async def close(self, turn: Turn) -> Turn:
        """End the stream (half-close) and check the EPP ends the call cleanly."""
        await self.call.done_writing()
        assert await asyncio.wait_for(self.call.read(), self.timeout) == grpc.aio.EOF
        assert await self.call.code() == grpc.StatusCode.OK
        return turn


def _ended(turn: Turn, answer: Any) -> bool:
    if answer.WhichOneof("response") != "immediate_response":
        return False
    turn.immediate = immediate_of(answer)
    return True


def _decided(turn: Turn, answer: Any) -> None:
    header, metadata = destination_of(answer)
    assert header == metadata, (header, metadata)  # the protocol: always the same value
    turn.destination = header.split(",")
    kind = answer.WhichOneof("response")
    common = getattr(answer, kind).response
    turn.mutations = set_headers(common)
    turn.removed = [name.lower() for name in common.header_mutation.remove_headers]


async def tls_channel(port: int, host: str = "127.0.0.1") -> grpc.aio.Channel:
    """Return a TLS channel to the EPP that verifies the certificate it serves.

    The EPP's certificate is self-signed (made at its start), as a gateway configured
    with the EPP's CA would trust it: the test reads it first and trusts only it.
    """
    certificate = await asyncio.to_thread(ssl.get_server_certificate, (host, port))
    secure = grpc.ssl_channel_credentials(root_certificates=certificate.encode())
    return grpc.aio.secure_channel(f"{host}:{port}", secure)
