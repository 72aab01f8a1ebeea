"""The Endpoint Picker protocol over Envoy ``ext_proc`` v3, one stream at a time.

Implements the Gateway API Inference Extension's EPP protocol (v1.0.0,
``docs/proposals/004-endpoint-picker-protocol/README.md`` in
kubernetes-sigs/gateway-api-inference-extension) on Envoy's
``envoy.service.ext_proc.v3.ExternalProcessor`` messages:

* **Endpoint subset** (data plane to EPP): the request's ``metadata_context`` may carry
  ``filter_metadata["envoy.lb.subset_hint"]["x-gateway-destination-endpoint-subset"]``,
  a list of ``ip:port``; the EPP then picks only from it, and answers an
  ``ImmediateResponse`` 503 when the list is empty or holds no eligible endpoint.
* **Destination endpoint** (EPP to data plane): the chosen endpoints, ``ip:port``
  separated by commas with the primary first and fallbacks after it, both as the
  ``x-gateway-destination-endpoint`` request header and as
  ``dynamic_metadata["envoy.lb"]["x-gateway-destination-endpoint"]``, always the same
  value in both. No endpoint: ``ImmediateResponse`` 503 when none can serve, 429 when
  the request is shed (here: the new-session rate is spent).
* **Destination endpoint served** (data plane to EPP): the endpoint that served the
  request, from the response's ``metadata_context``
  ``filter_metadata["envoy.lb"]["x-gateway-destination-endpoint-served"]``, or from a
  response header of that name where a data plane sends it that way.

When the decision is made depends on the request body mode Envoy announces in
``protocol_config`` (or the EPP's configured default without one), because choosing a
new session's worker needs the ``model`` of the body:

==========================  =============================================================
request body mode           the decision, and in which answer it travels
==========================  =============================================================
``NONE``, ``STREAMED``      at the request headers (the model from the
                            ``x-gateway-model-name`` header or the only model served):
                            in the headers answer; body chunks are then let through
``BUFFERED`` (``_PARTIAL``)  at the body (one message): in the body answer
``FULL_DUPLEX_STREAMED``    at the body's end: the headers answer is held back until then,
                            and the chunks, kept meanwhile, are sent back unchanged as
                            ``streamed_response`` after it
==========================  =============================================================

Without ``protocol_config`` (Envoy before 1.34, NGINX Gateway Fabric's shim) the configured
mode is assumed. When that is ``FULL_DUPLEX_STREAMED`` the stream itself tells: a duplex
gateway sends the body without waiting for the headers answer, a synchronous one
(``BUFFERED``, ``STREAMED``) waits for it. So when no body message follows the headers
within the mode probe (``--mode-probe-seconds``, under Envoy's 200 ms message timeout),
the server calls :meth:`Exchange.assume_synchronous` and the decision travels in the
headers answer, as in ``STREAMED`` mode, instead of stalling until the gateway's timeout.

Request bodies held until the decision count against a budget shared by all streams
(:class:`~sessionfleet.fronts.body.BodyBudget`): past it, 503 with Retry-After. A body
over ``max_body_bytes`` is answered 413.

A request whose headers end the stream is decided at the headers in every mode. The
response is let through (echoed chunk by chunk in ``FULL_DUPLEX_STREAMED``) while its
last 16 KiB are kept to read the OpenAI ``usage`` from (streamed or not).

Pure: protobuf messages in and out, no gRPC, no I/O; time is passed in.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2

from sessionfleet.engines import FORWARDED_SESSION_HEADER
from sessionfleet.engines.vllm import Usage
from sessionfleet.epp.picker import EndpointPicker, Held, Route
from sessionfleet.fronts.body import (
    FULL_WALK_INLINE_BYTES,
    HEAD_BYTES,
    TAIL_BYTES,
    BodyBudget,
    BodyError,
    find_model,
    usage_in_body,
    usage_in_stream,
)
from sessionfleet.fronts.errors import REASON_HEADER, RouterError

DESTINATION_ENDPOINT: Final = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE: Final = "envoy.lb"
SUBSET_NAMESPACE: Final = "envoy.lb.subset_hint"
SUBSET_KEY: Final = "x-gateway-destination-endpoint-subset"
SERVED_KEY: Final = "x-gateway-destination-endpoint-served"
CONTROL_HEADERS: Final = (
    "x-gateway-inference-objective",
    "x-gateway-inference-fairness-id",
    "x-gateway-model-name-rewrite",
)
"""GAIE's control headers: read by the EPP, never passed on to the model server."""

_MODE = processing_mode_pb2.ProcessingMode
NONE: Final[int] = _MODE.NONE
STREAMED: Final[int] = _MODE.STREAMED
BUFFERED: Final[int] = _MODE.BUFFERED
BUFFERED_PARTIAL: Final[int] = _MODE.BUFFERED_PARTIAL
FULL_DUPLEX_STREAMED: Final[int] = _MODE.FULL_DUPLEX_STREAMED
_OVERWRITE: Final = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


class Headers(Mapping[str, str]):
    """Request or response headers, looked up by any case of their name."""

    def __init__(self, items: dict[str, str]) -> None:
        self._items = items

    @classmethod
    def of(cls, message: Any) -> Headers:
        """Read an ``HttpHeaders`` message (``raw_value`` or ``value``); first value wins.

        Raises :class:`RouterError` 400 for a value that is not UTF-8.
        """
        items: dict[str, str] = {}
        for header in message.headers.headers:
            try:
                value = header.raw_value.decode() if header.raw_value else header.value
            except UnicodeDecodeError:
                raise RouterError(
                    400, "invalid_header", f"header {header.key[:64]}: the value is not UTF-8"
                ) from None
            items.setdefault(header.key.lower(), value)
        return cls(items)

    def __getitem__(self, name: str) -> str:
        return self._items[name.lower()]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


def subset_hint(request: Any) -> frozenset[str] | None:
    """Return the endpoint subset a ``ProcessingRequest`` carries, None without one."""
    namespaces = request.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in namespaces:
        return None
    fields = namespaces[SUBSET_NAMESPACE].fields
    if SUBSET_KEY not in fields:
        return None
    value = fields[SUBSET_KEY]
    if value.WhichOneof("kind") == "string_value":  # tolerated: one or a comma list
        return frozenset(e.strip() for e in value.string_value.split(",") if e.strip())
    return frozenset(v.string_value for v in value.list_value.values if v.string_value)


def served_endpoint(request: Any, headers: Mapping[str, str]) -> str | None:
    """Return the endpoint that served the response, if the data plane said."""
    namespaces = request.metadata_context.filter_metadata
    if DESTINATION_NAMESPACE in namespaces:
        fields = namespaces[DESTINATION_NAMESPACE].fields
        if SERVED_KEY in fields and fields[SERVED_KEY].string_value:
            return str(fields[SERVED_KEY].string_value)
    return headers.get(SERVED_KEY)


def immediate(error: RouterError) -> Any:
    """Return the ``ProcessingResponse`` answering the client with the EPP's own error."""
    headers = [
        _header("content-type", "application/json"),
        _header(REASON_HEADER.lower(), error.code),
    ]
    if error.retry_after is not None:
        headers.append(_header("retry-after", str(error.retry_after)))
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=error.status),
            headers=pb.HeaderMutation(set_headers=headers),
            body=error.body(),
            details=error.code,
        )
    )


def _header(name: str, value: str) -> Any:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, raw_value=value.encode()),
        append_action=_OVERWRITE,
    )


def destination(route: Route) -> tuple[Any, Any]:
    """Return the ``CommonResponse`` and the dynamic metadata that name ``route``'s endpoints.

    The header and the metadata carry the same value, as the protocol requires.
    """
    value = ",".join(route.endpoints)
    set_headers = [_header(DESTINATION_ENDPOINT, value)]
    remove: list[str] = list(CONTROL_HEADERS)
    if route.identity is not None and route.session is not None:
        # The engine's view of the session, as the router forwards it.
        set_headers.append(_header(FORWARDED_SESSION_HEADER.lower(), route.identity.session_id))
    else:
        remove.append(FORWARDED_SESSION_HEADER.lower())
    common = pb.CommonResponse(
        header_mutation=pb.HeaderMutation(set_headers=set_headers, remove_headers=remove),
        clear_route_cache=True,
    )
    metadata = pb.ProcessingResponse().dynamic_metadata
    metadata.update({DESTINATION_NAMESPACE: {DESTINATION_ENDPOINT: value}})
    return common, metadata


@dataclass(frozen=True, slots=True)
class ExchangeSettings:
    """The body modes assumed when Envoy does not announce them, and the body bound."""

    request_body_mode: int = FULL_DUPLEX_STREAMED
    response_body_mode: int = FULL_DUPLEX_STREAMED
    max_body_bytes: int = 8 << 20
    retry_after: int = 5
    """Retry-After seconds when the bodies held at once are over budget."""


@dataclass(slots=True)
class TurnOutcome:
    """How the request ended, for accounting."""

    status: int | None
    usage: Usage | None
    served: str | None
    """The endpoint the data plane says served it, if it said."""
    completed: bool
    """The response reached its end (its body's last chunk, or headers ending it)."""


class Exchange:
    """One ``Process`` stream: ext_proc requests in, ext_proc responses out.

    After each :meth:`receive`, :attr:`held` says whether the decision waits for the
    session to become routable (the caller then calls :meth:`retry` on table changes,
    or :meth:`give_up`); :attr:`closed` says an immediate response ended the request.
    """

    def __init__(
        self,
        picker: EndpointPicker,
        settings: ExchangeSettings,
        started: float,
        budget: BodyBudget | None = None,
    ) -> None:
        self.picker = picker
        self.settings = settings
        self.started = started
        self.budget = budget
        """The bytes all streams hold at once (shared); None: no bound beyond one body's."""
        self.request_mode = settings.request_body_mode
        self.response_mode = settings.response_body_mode
        self.announced = False
        """Whether the gateway announced its body modes (``protocol_config``)."""
        self.parsed_model: str | BodyError | None = None
        """The body's model, parsed ahead off the event loop (:meth:`body_to_parse`)."""
        self.headers: Headers = Headers({})
        self.subset: frozenset[str] | None = None
        self.route: Route | None = None
        self.held: Held | None = None
        self.closed = False
        self.refused: RouterError | None = None
        """The EPP's own answer, when it gave one (the stream ends with it)."""
        self.outcome: TurnOutcome | None = None
        self.requested_model: str | None = None
        """The model the request named (its body, or the headers), once decided."""
        self._chunks: list[tuple[bytes, bool]] = []
        self._body_size = 0
        self._held = 0
        """Bytes of ``_chunks`` taken from the budget."""
        self._answer = "headers"
        """Where the decision travels: headers, body, or duplex (headers, then chunks)."""
        self._trailers = False
        self._status: int | None = None
        self._served: str | None = None
        self._event_stream = False
        self._head = bytearray()
        """A stream's first bytes: Anthropic's ``message_start`` carries the prompt usage."""
        self._tail = bytearray()
        self._response_size = 0
        self._first = True
        self._responded = False

    # --- the stream -----------------------------------------------------------------

    def receive(self, request: Any, now: float) -> list[Any]:
        """Return the responses to one ``ProcessingRequest`` (none while held or closed)."""
        if self._first:
            self._first = False
            if request.HasField("protocol_config"):
                self.announced = True
                self.request_mode = request.protocol_config.request_body_mode
                self.response_mode = request.protocol_config.response_body_mode
        if self.closed:
            return []
        kind = request.WhichOneof("request")
        try:
            if kind == "request_headers":
                return self._request_headers(request, now)
            if kind == "request_body":
                return self._request_body(request.request_body, now)
            if kind == "request_trailers":
                return self._request_trailers(now)
            if kind == "response_headers":
                return self._response_headers(request)
            if kind == "response_body":
                return self._response_body(request.response_body)
            if kind == "response_trailers":
                self._complete()
                return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        except RouterError as error:
            return self._refuse(error)
        return []

    @property
    def probing(self) -> bool:
        """Whether the body mode is still unknown: duplex assumed, headers only so far.

        The server then waits at most the mode probe for the next message before it
        calls :meth:`assume_synchronous`.
        """
        return (
            not self.announced
            and self._answer == "duplex"
            and self.route is None
            and self.held is None
            and not self.closed
            and not self._chunks
            and not self._trailers
        )

    def assume_synchronous(self, now: float) -> list[Any]:
        """Decide at the headers: the gateway waits for their answer before the body.

        A gateway that announces no mode and sends no body after the headers is a
        ``BUFFERED`` or ``STREAMED`` one; its body and response messages then each
        expect an answer of their own, as in those modes.
        """
        self.request_mode, self.response_mode = STREAMED, STREAMED
        self._answer = "headers"
        return self._decide(now)

    def body_to_parse(self, request: Any) -> bytes | None:
        """Return the whole body when ``request`` completes one to decide on and it is large.

        The server parses it off the event loop (:func:`~sessionfleet.fronts.body.model_of`)
        and sets :attr:`parsed_model` before :meth:`receive`: a crafted 7 MiB body took
        0.27 s to walk, past the gateway's message timeout for every other stream.
        """
        if request.WhichOneof("request") != "request_body" or self.closed:
            return None
        body = request.request_body
        if self.route is not None or self._answer == "headers":
            return None
        if not (self._answer == "body" or body.end_of_stream):
            return None
        size = self._body_size + len(body.body)
        if size <= FULL_WALK_INLINE_BYTES or size > self.settings.max_body_bytes:
            return None
        return b"".join([*(chunk for chunk, _ in self._chunks), bytes(body.body)])

    def close(self) -> None:
        """Give back what the stream holds of the body budget (at the stream's end)."""
        self._release()

    def _release(self) -> None:
        if self.budget is not None and self._held:
            self.budget.release(self._held)
        self._held = 0

    @property
    def responded(self) -> bool:
        """Whether the response has begun (its headers came through this stream)."""
        return self._responded

    @property
    def served(self) -> str | None:
        """The endpoint the data plane says served the request, once it said."""
        return self._served

    @property
    def waiting(self) -> bool:
        """Whether the decision waits for the session to become routable."""
        return self.held is not None

    def retry(self, now: float) -> list[Any]:
        """Decide again for a held request (after a change of the bindings)."""
        if self.held is None:
            return []
        return self._decide(now)

    def give_up(self, waited: float) -> list[Any]:
        """Answer a held request 503 ``session_held`` with ``Retry-After``."""
        held, self.held = self.held, None
        assert held is not None
        return self._refuse(
            RouterError(
                503,
                "session_held",
                f"session {held.session_id} {held.reason}; the EPP waited {waited:g} s",
                retry_after=self.picker.config.retry_after,
            )
        )

    def _refuse(self, error: RouterError) -> list[Any]:
        """End the request with the EPP's own answer."""
        self.closed, self.refused = True, error
        self._chunks = []
        self._release()
        return [immediate(error)]

    # --- the request ----------------------------------------------------------------

    def _request_headers(self, request: Any, now: float) -> list[Any]:
        self.headers = Headers.of(request.request_headers)
        self.subset = subset_hint(request)
        ends = request.request_headers.end_of_stream
        if ends or self.request_mode in (NONE, STREAMED):
            self._answer = "headers"
            return self._decide(now)
        if self.request_mode == FULL_DUPLEX_STREAMED:
            self._answer = "duplex"
            return []
        self._answer = "body"
        return [pb.ProcessingResponse(request_headers=pb.HeadersResponse())]

    def _request_body(self, body: Any, now: float) -> list[Any]:
        if self.route is not None or self._answer == "headers":
            # Decided at the headers: the body passes.
            return [pb.ProcessingResponse(request_body=pb.BodyResponse())]
        size = len(body.body)
        self._body_size += size
        if self._body_size > self.settings.max_body_bytes:
            raise RouterError(
                413, "body_too_large", f"the body exceeds {self.settings.max_body_bytes} bytes"
            )
        if self.budget is not None:
            if not self.budget.reserve(size):
                raise RouterError(
                    503,
                    "epp_overloaded",
                    f"the EPP holds {self.budget.used} bytes of request bodies, its limit "
                    f"(--max-inflight-body-bytes) is {self.budget.capacity}: try again",
                    retry_after=self.settings.retry_after,
                )
            self._held += size
        self._chunks.append((bytes(body.body), bool(body.end_of_stream)))
        if self._answer == "body" or body.end_of_stream:
            return self._decide(now)
        return []

    def _request_trailers(self, now: float) -> list[Any]:
        if self.route is None and self._answer == "duplex":
            self._trailers = True
            return self._decide(now)
        return [pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]

    def _model(self) -> str | None:
        parsed = self.parsed_model
        if isinstance(parsed, BodyError):
            raise RouterError(400, "invalid_body", str(parsed)) from parsed
        if parsed is not None:
            return parsed
        body = b"".join(chunk for chunk, _ in self._chunks)
        if body:
            try:
                return find_model(body)
            except BodyError as error:
                raise RouterError(400, "invalid_body", str(error)) from error
        return self.picker.model_of(self.headers)

    @property
    def response_bytes(self) -> int:
        """The response body's size so far."""
        return self._response_size

    @property
    def request_bytes(self) -> int:
        """The request body's size: as received, else as its ``content-length`` says."""
        length = self.headers.get("content-length", "")
        return self._body_size or (int(length) if length.isdigit() else 0)

    def _decide(self, now: float) -> list[Any]:
        try:
            self.requested_model = self._model()
            decision = self.picker.pick(self.headers, self.requested_model, self.subset, now)
        except RouterError as error:
            self.held = None
            return self._refuse(error)
        if isinstance(decision, Held):
            self.held = decision
            return []
        self.held, self.route = None, decision
        common, metadata = destination(decision)
        if self._answer == "body":
            self._chunks = []
            self._release()
            return [
                pb.ProcessingResponse(
                    request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata
                )
            ]
        answers = [
            pb.ProcessingResponse(
                request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata
            )
        ]
        if self._answer == "duplex":
            chunks, self._chunks = self._chunks, []
            self._release()
            answers.extend(_echo(chunk, ends, response=False) for chunk, ends in chunks)
            if self._trailers:
                answers.append(pb.ProcessingResponse(request_trailers=pb.TrailersResponse()))
        return answers

    # --- the response ---------------------------------------------------------------

    def _response_headers(self, request: Any) -> list[Any]:
        headers = Headers.of(request.response_headers)
        self._responded = True
        status = headers.get(":status", "")
        self._status = int(status) if status.isdigit() else None
        self._served = served_endpoint(request, headers)
        self._event_stream = "text/event-stream" in headers.get("content-type", "")
        if request.response_headers.end_of_stream:
            self._complete()
        return [pb.ProcessingResponse(response_headers=pb.HeadersResponse())]

    def _response_body(self, body: Any) -> list[Any]:
        chunk = bytes(body.body)
        self._response_size += len(chunk)
        if len(self._head) < HEAD_BYTES:
            self._head += chunk[: HEAD_BYTES - len(self._head)]
        self._tail += chunk
        if len(self._tail) > 2 * TAIL_BYTES:
            del self._tail[:-TAIL_BYTES]
        if body.end_of_stream:
            self._complete()
        if self.response_mode == FULL_DUPLEX_STREAMED:
            return [_echo(chunk, bool(body.end_of_stream), response=True)]
        return [pb.ProcessingResponse(response_body=pb.BodyResponse())]

    def _complete(self) -> None:
        if self.outcome is not None and self.outcome.completed:
            return
        self.outcome = self.ended()
        self.outcome.completed = True

    def ended(self) -> TurnOutcome:
        """Return the outcome so far (the stream may have ended before the response did)."""
        if self.outcome is not None:
            return self.outcome
        tail = bytes(self._tail)
        if self._event_stream or self._response_size > len(tail):
            usage = usage_in_stream(bytes(self._head), tail)
        else:
            usage = usage_in_body(tail) if tail else None
        return TurnOutcome(self._status, usage, self._served, completed=False)


def _echo(chunk: bytes, ends: bool, *, response: bool) -> Any:
    """Return the body answer of ``FULL_DUPLEX_STREAMED`` mode: the chunk, unchanged."""
    answer = pb.BodyResponse(
        response=pb.CommonResponse(
            body_mutation=pb.BodyMutation(
                streamed_response=pb.StreamedBodyResponse(body=chunk, end_of_stream=ends)
            )
        )
    )
    if response:
        return pb.ProcessingResponse(response_body=answer)
    return pb.ProcessingResponse(request_body=answer)
