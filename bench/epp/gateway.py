"""A stand-in for Envoy in front of the Endpoint Picker, for benchmarks: not a gateway.

No gateway binary can be installed on the machine that builds this project
(docs/gateway.md), so ``bench/router/run.py --epp`` puts this small HTTP server where
Envoy would be, to drive the EPP path with an HTTP load tool. Per request it does what
Envoy's ext_proc filter does under the Gateway API Inference Extension's EPP protocol,
with the project's own ext_proc client (``tests/epp_client.py``, the code the unit and
e2e tests replay Envoy's streams with):

1. one ``ExternalProcessor.Process`` stream to the EPP (all streams over one HTTP/2
   channel, as Envoy keeps one per cluster): the request headers with
   ``protocol_config`` (``FULL_DUPLEX_STREAMED`` both ways, as the Envoy of llm-d's
   standalone chart is configured: ``config/charts/standalone/values.yaml`` in
   llm-d/llm-d-inference-scheduler), then the body, in ``--chunk``-byte messages;
2. the request, with the EPP's header mutations, to the primary endpoint of
   ``x-gateway-destination-endpoint`` (checked equal to the ``envoy.lb`` dynamic
   metadata), or the EPP's ``ImmediateResponse`` to the client;
3. the upstream's response headers to the EPP (the endpoint that served in
   ``envoy.lb`` metadata), then each body chunk as it arrives, each passed to the
   client as the EPP sends it back, so a streamed answer stays streamed; an empty last
   chunk with ``end_of_stream`` when the upstream's body ends (as Envoy sends one when
   the end comes apart from the data); then the stream's half-close.

What it is not: it is Python (aiohttp and grpc.aio on one event loop), so its own cost
per request is far above Envoy's C++ and is counted in the path's latency; the bench
reports its CPU per request apart from the EPP's. Envoy's upstream connection pools,
retries along the endpoint list, timeouts (``message_timeout``), failure modes
(``FailOpen``), TLS to the EPP (off here: ``--no-secure-serving``, as in ``make
bench-epp``), HTTP/2 to clients, route matching and header sanitising are not there.
The body is read whole before its first message (Envoy streams it as it reads it).
A failed exchange with the EPP answers 500 (Envoy's ``FailClose``), an unreachable
upstream 503.

``GET /stats`` answers how many requests went to each endpoint and how many failed,
so a bench can check that its requests reached the engine the EPP picked, and how many
response chunks went through the EPP.

Run: ``python bench/epp/gateway.py --port P --epp 127.0.0.1:EPP_PORT``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from aiohttp import web

REPO = Path(__file__).resolve().parents[2]
# Appended, not prepended: the repository root holds a folder named operator/, which
# must not hide the standard library's operator module.
sys.path.append(str(REPO))

from tests.epp_client import MODES, Envoy, upstream_headers  # noqa: E402

logger = logging.getLogger("bench.epp.gateway")

# Connection-specific headers (RFC 9110 7.6.1) and the body framing, which each hop sets
# for itself.
_HOP = frozenset(
    ["connection", "keep-alive", "proxy-connection", "te", "transfer-encoding", "upgrade"]
    + ["content-length", "expect", "trailer"]
)


class Gateway:
    """The HTTP side: each request through one ext_proc exchange, then upstream."""

    def __init__(self, epp: str, chunk: int, timeout: float) -> None:
        self.epp = epp
        self.chunk = chunk
        self.timeout = timeout
        self.routed: Counter[str] = Counter()
        """Requests sent upstream, per endpoint the EPP named."""
        self.answered: Counter[int] = Counter()
        """Requests the EPP answered itself, per status."""
        self.failed: Counter[str] = Counter()
        """Requests that failed here, per reason."""
        self.response_chunks = 0
        """Upstream body chunks sent to the EPP (each is one message and its answer)."""
        self._envoy: Envoy | None = None
        self._client: aiohttp.ClientSession | None = None

    async def connect(self, _: web.Application) -> AsyncIterator[None]:
        """Hold the gRPC channel to the EPP and the upstream client while serving."""
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        async with (
            grpc.aio.insecure_channel(self.epp) as channel,
            aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=None, sock_read=60),
                cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False,
                skip_auto_headers=("Accept-Encoding", "User-Agent"),
            ) as client,
        ):
            self._envoy, self._client = Envoy(channel, timeout=self.timeout), client
            yield
            self._envoy = self._client = None

    @property
    def envoy(self) -> Envoy:
        assert self._envoy is not None, "not serving"
        return self._envoy

    @property
    def client(self) -> aiohttp.ClientSession:
        assert self._client is not None, "not serving"
        return self._client

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Run one request through the EPP and the endpoint it names."""
        body = await request.read()
        headers = {k.lower(): v for k, v in request.headers.items() if k.lower() not in _HOP}
        headers[":method"] = request.method
        headers[":path"] = request.path_qs
        stream = self.envoy.open(MODES.FULL_DUPLEX_STREAMED)
        try:
            turn = await stream.request(
                headers, body, chunk=self.chunk, authority=request.host or "gateway"
            )
        except (grpc.RpcError, AssertionError, TimeoutError) as error:
            return self._fail(stream, "epp", error, 500)
        if turn.immediate is not None:
            status, answer_headers, answer = turn.immediate
            self.answered[status] += 1
            await stream.close(turn)
            # Its headers carry the content type of its JSON body.
            return web.Response(
                status=status, body=json.dumps(answer).encode(), headers=answer_headers
            )
        endpoint = turn.destination[0]
        try:
            upstream = await self.client.post(
                f"http://{endpoint}{request.path_qs}",
                data=turn.sent,
                headers=upstream_headers(headers, turn),
            )
        except aiohttp.ClientError as error:
            return self._fail(stream, "upstream", error, 503)
        async with upstream:
            self.routed[endpoint] += 1
            kept = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP}
            response = web.StreamResponse(status=upstream.status, headers=kept)
            try:
                await stream.response_headers(
                    upstream.status, {k.lower(): v for k, v in kept.items()}, endpoint
                )
                await response.prepare(request)
                async for data in upstream.content.iter_any():
                    self.response_chunks += 1
                    await response.write(await stream.response_chunk(data, False))
                await response.write(await stream.response_chunk(b"", True))
                await stream.close(turn)
            except (grpc.RpcError, AssertionError, TimeoutError) as error:
                if not response.prepared:
                    return self._fail(stream, "epp", error, 500)
                # The headers are out: the client sees a cut answer, as with Envoy.
                self.failed["epp"] += 1
                logger.warning("the EPP failed mid-response: %r", error)
                stream.call.cancel()
            await response.write_eof()
            return response

    def _fail(self, stream: Any, reason: str, error: BaseException, status: int) -> web.Response:
        self.failed[reason] += 1
        logger.warning("%s failed: %r", reason, error)
        stream.call.cancel()
        return web.json_response({"error": {"message": f"{reason}: {error!r}"}}, status=status)

    async def stats(self, _: web.Request) -> web.Response:
        """Return the counts: requests per endpoint, the EPP's own answers, failures."""
        return web.json_response(
            {
                "routed": dict(self.routed),
                "answered": {str(k): v for k, v in self.answered.items()},
                "failed": dict(self.failed),
                "response_chunks": self.response_chunks,
            }
        )


def app(epp: str, *, chunk: int = 64 << 10, timeout: float = 10.0) -> web.Application:
    """Return the stand-in's application, talking to the EPP at ``epp`` (``host:port``)."""
    gateway = Gateway(epp, chunk, timeout)
    application = web.Application(client_max_size=16 << 20)
    application.cleanup_ctx.append(gateway.connect)
    application.router.add_get("/stats", gateway.stats)
    application.router.add_get("/healthz", healthz)
    application.router.add_post("/{path:.*}", gateway.handle)
    return application


async def healthz(_: web.Request) -> web.Response:
    """Answer that the stand-in is up (the bench waits for it)."""
    return web.Response(text="ok")


def main(argv: list[str] | None = None) -> int:
    """Serve until interrupted."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--epp", required=True, help="the EPP's host:port (plaintext gRPC)")
    parser.add_argument("--chunk", type=int, default=64 << 10, help="request body message bytes")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    with contextlib.suppress(KeyboardInterrupt):
        web.run_app(
            app(args.epp, chunk=args.chunk),
            host=args.host,
            port=args.port,
            print=None,
            access_log=None,
            handle_signals=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
