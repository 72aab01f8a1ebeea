"""The hot path: one turn in, one turn out, no API server call for a bound session.

For each request: read the body (bytes, never decoded whole), find the session in the
headers and the model in the body, look the session's worker up in the in-memory
table (creating the session on its first turn), forward the bytes to the worker over a
kept connection (:mod:`.upstream`), and pass the answer back. Streams are written to the
client chunk by chunk as they arrive; only the last 16 KiB are kept, to read the usage
from the final chunk. The usage is added to the session's pending delta
(:mod:`sessionfleet.fronts.ledger`) after the answer has been sent.

Added latency (``sessionfleet_router_added_latency_seconds``) is the request's time in
the router less the time spent waiting for the worker (for its headers and for each
chunk) and for a held turn's session to be bound again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from time import perf_counter
from typing import Final

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from sessionfleet.engines import FORWARDED_SESSION_HEADER
from sessionfleet.engines.anthropic import error_event, is_messages_path
from sessionfleet.engines.vllm import Usage
from sessionfleet.fronts.admission import ApiKeys, AuthError, SessionRates
from sessionfleet.fronts.bindings import BindingTable, SessionView, WorkerView
from sessionfleet.fronts.body import (
    HEAD_BYTES,
    TAIL_BYTES,
    BodyError,
    model_of,
    usage_in_body,
    usage_in_stream,
)
from sessionfleet.fronts.errors import RouterError
from sessionfleet.fronts.identity import HeaderConfig, Identity, IdentityError, identify
from sessionfleet.fronts.kubesync import Flusher, SessionCreator
from sessionfleet.fronts.ledger import UsageLedger, turn_totals
from sessionfleet.fronts.metrics import RouterMetrics
from sessionfleet.fronts.requester import FORWARDED_FOR, TrustedProxies, requester_key
from sessionfleet.fronts.routing import bound_worker
from sessionfleet.fronts.turns import Turns
from sessionfleet.router.intake import Intake
from sessionfleet.router.limits import IntakeLimits
from sessionfleet.router.upstream import (
    Upstream,
    UpstreamError,
    UpstreamResponse,
    UpstreamTimeout,
    UpstreamUnreachable,
)

logger = logging.getLogger("sessionfleet.router")

WORKER_HEADER: Final = "X-Sessionfleet-Worker"
"""Added to every forwarded answer: the InferenceWorker that served it."""
SESSION_HEADER: Final = "X-Sessionfleet-Session"
"""Added to every answer of a session's turn: the AgentSession's object name."""

# Hop-by-hop headers (RFC 9110 7.6.1) and those the client library sets itself.
_REQUEST_SKIP: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        # The router has read the whole body already; an upstream 100 Continue would
        # only be an interim answer to skip.
        "expect",
        FORWARDED_SESSION_HEADER.lower(),
    }
)
ENGINE_SESSION_HEADER: Final = "X-Session-ID"
"""vLLM's session header: the router sends the AgentSession's name in it."""
_CREDENTIALS: Final = frozenset({"authorization", "x-api-key"})
"""With client authentication on, the router consumed these; workers never see them."""
_CREDENTIAL_SKIP: Final = _REQUEST_SKIP | _CREDENTIALS
_ENGINE_SESSION_SKIP: Final = frozenset({ENGINE_SESSION_HEADER.lower()})
_RESPONSE_SKIP: Final = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "upgrade", "trailer"}
)
CLIENT_CLOSED: Final = 499
"""The status recorded (in metrics only) for a turn whose client left mid-answer."""
_BUFFERED_RESPONSE_MAX: Final = 1 << 20
"""Non-streamed answers up to 1 MiB are read whole and sent in one write."""


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """How the router behaves (the ``router`` command's flags)."""

    headers: HeaderConfig = field(default_factory=HeaderConfig)
    hold_timeout: float = 30.0
    retry_after: int = 5
    sync_timeout: float = 10.0
    intake: IntakeLimits = field(default_factory=IntakeLimits)
    session_rates: SessionRates = field(default_factory=SessionRates)
    trusted_proxies: TrustedProxies = field(default_factory=TrustedProxies)
    """Peers whose X-Forwarded-For names the client a new session counts against."""


def _forward_headers(
    incoming: CIMultiDictProxy[str],
    session_id: str | None,
    session_name: str | None,
    *,
    strip_credentials: bool,
) -> list[tuple[str, str]]:
    skip = _CREDENTIAL_SKIP if strip_credentials else _REQUEST_SKIP
    if session_name is not None:
        skip = skip | _ENGINE_SESSION_SKIP
    headers = [(name, value) for name, value in incoming.items() if name.lower() not in skip]
    if session_id is not None:
        headers.append((FORWARDED_SESSION_HEADER, session_id))
    if session_name is not None:
        # vLLM hands this header to its KV connector as the request's session; the KV
        # store records the session's blocks under its AgentSession name (docs/kvstore.md).
        # It replaces a client's own x-session-id (OpenCode sends that same header).
        headers.append((ENGINE_SESSION_HEADER, session_name))
    return headers


def _response_headers(upstream: list[tuple[str, str]], worker: str) -> CIMultiDict[str]:
    headers: CIMultiDict[str] = CIMultiDict()
    for name, value in upstream:
        if name.lower() not in _RESPONSE_SKIP:
            headers.add(name, value)
    headers[WORKER_HEADER] = worker
    return headers


@dataclass(slots=True)
class _Turn:
    """What one request turned out to be, for accounting once it is answered."""

    route: str = "other"
    status: int = 500
    waited: float = 0.0
    """Seconds spent waiting for the worker or for a held session."""
    worker: WorkerView | None = None
    session: SessionView | None = None
    identity: Identity | None = None
    created: bool = False
    usage: Usage | None = None
    completed: bool = False
    """The worker answered 200 and the answer reached the client (or began to)."""
    outcome: int | None = None
    """The status to count when it is not the one sent: a stream that broke after its
    status line (502), or whose client left (499)."""
    started: float = 0.0
    """Unix time the request arrived: orders a session's turns across replicas."""
    body_bytes: int = 0
    """Bytes of the in-flight body budget this request holds."""


def _upstream_failure(worker: WorkerView, error: UpstreamError) -> RouterError:
    """Return the 502 for a worker's failed answer, with what failed in the message."""
    if isinstance(error, UpstreamTimeout):
        return RouterError(
            502, "upstream_timeout", f"worker {worker.name} did not answer in time: {error}"
        )
    code = "upstream_unreachable" if isinstance(error, UpstreamUnreachable) else "upstream_error"
    return RouterError(502, code, f"worker {worker.name} at {worker.endpoint}: {error}")


def _model_object(model: str) -> dict[str, str]:
    """Return a model as OpenAI's model endpoints list it."""
    return {"id": model, "object": "model", "owned_by": "sessionfleet"}


def _stream_error(error: BaseException, *, anthropic: bool) -> bytes:
    """Return the server-sent event telling a client its stream broke at the worker.

    Anthropic's SDKs read only events named ``error`` (they skip unnamed ones), so a
    Messages stream ends with Anthropic's error event; others with OpenAI's shape.
    """
    message = f"the worker's stream ended early: {error!r}"
    if anthropic:
        return error_event(502, message)
    body = {
        "error": {
            "message": message,
            "type": "upstream_error",
            "code": "upstream_error",
        }
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class Proxy:
    """The request handlers of one router."""

    def __init__(
        self,
        config: RouterConfig,
        table: BindingTable,
        ledger: UsageLedger,
        metrics: RouterMetrics,
        creator: SessionCreator,
        flusher: Flusher,
        upstream: Upstream,
        keys: ApiKeys | None = None,
    ) -> None:
        self.config = config
        self.keys = keys
        self.intake = Intake(config.intake)
        self.table = table
        self.ledger = ledger
        self.metrics = metrics
        self.creator = creator
        self.flusher = flusher
        self.upstream = upstream
        self.turns = Turns(table, metrics)
        """Turns in flight here and their holds; the migration handshake reads them."""

    # --- the turn ---------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Route one OpenAI-compatible POST to its worker."""
        start = perf_counter()
        turn = _Turn(started=time.time())
        self.metrics.in_flight += 1
        try:
            response = await self._route(request, turn)
            turn.status = turn.outcome or response.status
            return response
        except RouterError as error:
            turn.status = error.status
            return error.response(anthropic=is_messages_path(request.path))
        except asyncio.CancelledError:
            # The server cancels a handler whose client disconnected (when configured
            # to); what was served still counts (see _stream).
            turn.status = turn.outcome or CLIENT_CLOSED
            raise
        finally:
            self.intake.budget.release(turn.body_bytes)
            self.metrics.in_flight -= 1
            self.metrics.request(turn.route, turn.status, perf_counter() - start - turn.waited)
            if turn.completed:
                self._account(turn)
            elif turn.created and turn.session is not None:
                # The session's first turn got no answer from a worker: nothing of it
                # is worth keeping for its TTL, unless another turn of it did better.
                self.creator.discard(turn.session, busy=self.turns.sessions)

    def _client(self, request: web.Request) -> str | None:
        """Return the authenticated client (None with authentication off); 401 otherwise."""
        if self.keys is None:
            return None
        try:
            return self.keys.client_of(request.headers)
        except AuthError as error:
            raise RouterError(401, "unauthorized", str(error)) from error

    async def _read_body(self, request: web.Request, turn: _Turn) -> bytes:
        try:
            body, turn.body_bytes = await self.intake.read(request)
        except web.RequestPayloadError as error:
            raise RouterError(
                400, "invalid_body", f"the body could not be read: {error}"
            ) from error
        return body

    async def _route(self, request: web.Request, turn: _Turn) -> web.StreamResponse:
        owner = self._client(request)
        body = await self._read_body(request, turn)
        try:
            identity = identify(request.headers, self.config.headers)
            model = await model_of(body)
        except (IdentityError, BodyError) as error:
            code = "invalid_session_id" if isinstance(error, IdentityError) else "invalid_body"
            raise RouterError(400, code, str(error)) from error
        if not self.table.synced:
            await self._wait_synced(turn)
        if identity is not None:

            def requester() -> str:
                return requester_key(
                    owner,
                    request.remote,
                    request.headers.getall(FORWARDED_FOR, ()),
                    self.config.trusted_proxies,
                )

            session, turn.created = await self.creator.ensure(
                identity, model, owner=owner, requester=requester
            )
            if session.model == model:
                turn.route, turn.identity = "session", identity
                turn.worker, turn.session = await self._bound_worker(session, turn), session
        if turn.worker is None:
            # No session, or a side request of a session for another model (agents ask
            # a small model for titles and summaries under the same session id).
            turn.route, turn.worker = "stateless", self._stateless(model)
        return await self._forward(request, body, turn)

    def _stateless(self, model: str) -> WorkerView:
        worker = self.table.least_loaded(model)
        if worker is not None:
            return worker
        if self.table.has_model(model):
            raise RouterError(
                503,
                "no_ready_worker",
                f"no InferenceWorker serving {model!r} is Ready",
                retry_after=self.config.retry_after,
            )
        raise RouterError(404, "model_not_found", f"no InferenceWorker serves {model!r}")

    async def _wait_synced(self, turn: _Turn) -> None:
        started = perf_counter()
        deadline = asyncio.get_running_loop().time() + self.config.sync_timeout
        while not self.table.synced:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                raise RouterError(
                    503,
                    "router_not_ready",
                    "the router has not loaded the bindings from the Kubernetes API yet",
                    retry_after=1,
                )
            try:
                await asyncio.wait_for(self.table.changed().wait(), remaining)
            except TimeoutError:
                pass
        turn.waited += perf_counter() - started

    def _decide(self, session: SessionView) -> WorkerView | str:
        """Return the worker for a bound session's turn, or why the turn must wait."""
        return bound_worker(self.table, session)

    async def _bound_worker(self, session: SessionView, turn: _Turn) -> WorkerView:
        decision = self._decide(session)
        if isinstance(decision, WorkerView):
            return decision
        # Hold the turn: the operator is moving or restoring the session, or its
        # worker is coming back. Every change to the table wakes the wait.
        why = decision

        def retry() -> WorkerView | None:
            nonlocal why
            current = self.table.session_named(session.name)
            if current is None:
                raise RouterError(
                    503,
                    "session_held",
                    f"session {session.session_id} was deleted while its turn waited",
                    retry_after=1,
                )
            decided = self._decide(current)
            if isinstance(decided, WorkerView):
                return decided
            why = decided
            return None

        started = perf_counter()
        try:
            worker = await self.turns.hold(retry, self.config.hold_timeout)
        finally:
            turn.waited += perf_counter() - started
        if worker is None:
            raise RouterError(
                503,
                "session_held",
                f"session {session.session_id} {why}; the turn waited "
                f"{self.config.hold_timeout:g} s",
                retry_after=self.config.retry_after,
            )
        return worker

    async def _forward(self, request: web.Request, body: bytes, turn: _Turn) -> web.StreamResponse:
        worker = turn.worker
        assert worker is not None and worker.endpoint is not None
        session_id = turn.identity.session_id if turn.identity else None
        session_name = turn.session.name if turn.session is not None else None
        headers = _forward_headers(
            request.headers, session_id, session_name, strip_credentials=self.keys is not None
        )
        self.turns.started(worker, session_name)
        try:
            sent = perf_counter()
            upstream = await self.upstream.post(worker.endpoint, request.path_qs, headers, body)
            turn.waited += perf_counter() - sent
            try:
                return await self._answer(request, upstream, turn)
            finally:
                upstream.release()
        except UpstreamError as error:
            raise _upstream_failure(worker, error) from error
        finally:
            self.turns.ended(worker, session_name)

    async def _answer(
        self, request: web.Request, upstream: UpstreamResponse, turn: _Turn
    ) -> web.StreamResponse:
        """Pass the worker's answer on: streamed as it comes, or read whole and sent at once."""
        length = upstream.content_length
        if (
            upstream.content_type == "text/event-stream"
            or length is None
            or length > _BUFFERED_RESPONSE_MAX
        ):
            return await self._stream(request, upstream, turn)
        waiting = perf_counter()
        data = await upstream.read()
        turn.waited += perf_counter() - waiting
        response = web.Response(
            status=upstream.status,
            reason=upstream.reason,
            body=data,
            headers=self._headers(upstream, turn),
        )
        if upstream.status == 200:
            turn.usage, turn.completed = usage_in_body(data), True
        return response

    def _headers(self, upstream: UpstreamResponse, turn: _Turn) -> CIMultiDict[str]:
        assert turn.worker is not None
        headers = _response_headers(upstream.headers, turn.worker.name)
        if turn.session is not None:
            headers[SESSION_HEADER] = turn.session.name
        return headers

    async def _stream(
        self, request: web.Request, upstream: UpstreamResponse, turn: _Turn
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            status=upstream.status, reason=upstream.reason, headers=self._headers(upstream, turn)
        )
        try:
            await response.prepare(request)
        except ConnectionError:
            turn.outcome = CLIENT_CLOSED
            return response
        head, tail = bytearray(), bytearray()
        try:
            broken = await self._relay(response, upstream, turn, head, tail)
        except asyncio.CancelledError:
            turn.outcome = CLIENT_CLOSED
            raise
        finally:
            # Whatever happened, what reached the client was served: count it.
            turn.usage = usage_in_stream(bytes(head), bytes(tail))
            turn.completed = upstream.status == 200
        if broken is not None:
            # The status line is gone already: report the failure in the stream itself.
            assert turn.worker is not None
            logger.warning("stream from worker %s broke: %s", turn.worker.name, broken)
            turn.outcome = 502
            anthropic = is_messages_path(request.path)
            await self._write_quietly(response, _stream_error(broken, anthropic=anthropic))
        elif turn.outcome != CLIENT_CLOSED:
            await self._write_quietly(response, None)
        return response

    async def _relay(
        self,
        response: web.StreamResponse,
        upstream: UpstreamResponse,
        turn: _Turn,
        head: bytearray,
        tail: bytearray,
    ) -> UpstreamError | None:
        """Pass the worker's chunks on, keeping the first bytes in ``head``, the last in ``tail``.

        Returns the worker's error if its stream broke; a client that goes away sets
        the turn's outcome to 499 and ends the relay (releasing the unfinished answer then
        closes the worker's connection, which ends the request there).
        """
        while True:
            waiting = perf_counter()
            try:
                chunk = await upstream.next_chunk()
            except UpstreamError as error:
                return error
            finally:
                turn.waited += perf_counter() - waiting
            if not chunk:
                return None
            if len(head) < HEAD_BYTES:
                head += chunk[: HEAD_BYTES - len(head)]
            tail += chunk
            if len(tail) > 2 * TAIL_BYTES:
                del tail[:-TAIL_BYTES]
            try:
                await response.write(chunk)
            except ConnectionError:  # aiohttp's ClientConnectionResetError is one too
                turn.outcome = CLIENT_CLOSED
                return None

    @staticmethod
    async def _write_quietly(response: web.StreamResponse, data: bytes | None) -> None:
        """Write a last frame and end the answer; a client that left already is no error."""
        try:
            if data is not None:
                await response.write(data)
            await response.write_eof()
        except ConnectionError:
            pass

    # --- after the answer ---------------------------------------------------------------

    def _account(self, turn: _Turn) -> None:
        assert turn.worker is not None
        self.metrics.usage(turn.worker.name, turn.usage)
        if turn.session is None or turn.identity is None:
            return
        name = turn.session.name
        self.ledger.record(name, turn_totals(turn.usage, started=turn.started, now=time.time()))
        if turn.identity.final:
            self.flusher.finish(name)

    # --- other endpoints -----------------------------------------------------------------

    def _served_models(self) -> list[str]:
        return sorted({w.model for w in self.table.workers.values() if w.ready})

    async def models(self, _: web.Request) -> web.Response:
        """``GET /v1/models``: the models Ready workers serve."""
        data = [_model_object(m) for m in self._served_models()]
        return web.json_response({"object": "list", "data": data})

    async def model(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{model}`` (the OpenAI SDKs' ``models.retrieve``); ids may hold ``/``."""
        model = request.match_info["model"]
        if model not in self._served_models():
            return RouterError(
                404, "model_not_found", f"no Ready worker serves the model {model!r}"
            ).response()
        return web.json_response(_model_object(model))

    async def not_found(self, request: web.Request) -> web.Response:
        """Any other path or method."""
        if request.path.startswith("/v1/") and request.method != "POST":
            error = RouterError(
                405, "method_not_allowed", f"{request.method} {request.path}: use POST"
            )
        else:
            error = RouterError(404, "not_found", f"the router does not serve {request.path}")
        return error.response(anthropic=is_messages_path(request.path))
