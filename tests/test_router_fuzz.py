"""Byte-level fuzzing of the router's request handling: no 5xx of its own, no crash,
bounded memory.

A router (with a simulated engine behind it and the in-memory Kubernetes API) runs in a
thread of its own; each case is written to a fresh TCP connection as raw bytes and the
answer's status line and headers are read back. Three generators: arbitrary bytes;
requests with hostile headers (encodings, content types, session ids, finals, keys);
and structured mutations of a valid request's body (byte edits, random JSON, nesting,
duplicate and escaped keys, invalid UTF-8). An answer the router gives itself carries
``X-Sessionfleet-Reason``; one it passed on from the worker carries
``X-Sessionfleet-Worker``. In this setup (a healthy worker, no limits) the router must
answer every case below 500.

``make test`` runs 5,000 cases with a fixed seed (the same cases every run); ``make
bench-fuzz`` runs 100,000+ random ones (``SESSIONFLEET_FUZZ_EXAMPLES``, ``--hypothesis-seed``
to replay) and reports the router's resident memory.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp.test_utils import TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from router_fakes import FakeKube
from router_fleet import MODEL, worker_object

from sessionfleet.engines.sim.engine import EngineConfig
from sessionfleet.engines.sim.server import build_app
from sessionfleet.kube import WORKERS
from sessionfleet.router.admission import SessionRates
from sessionfleet.router.limits import IntakeLimits
from sessionfleet.router.proxy import RouterConfig
from sessionfleet.router.server import Router, RouterSettings

SCALE = int(os.environ.get("SESSIONFLEET_FUZZ_EXAMPLES", "5000")) / 5000
RANDOM = SCALE > 1
"""Beyond the 5,000 fixed cases of make test, cases are drawn at random."""


def examples(share: int) -> Any:
    return settings(
        max_examples=max(1, int(share * SCALE)),
        deadline=None,
        derandomize=not RANDOM,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class RouterThread:
    """A router and an engine serving on 127.0.0.1 from an event loop in a thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.port = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.servers: list[TestServer] = []

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        self.ready.set()
        self.loop.run_forever()

    async def _start(self) -> None:
        kube = FakeKube()
        engine = TestServer(build_app(EngineConfig(model=MODEL)), host="127.0.0.1")
        await engine.start_server()
        endpoint = str(engine.make_url("")).rstrip("/")
        kube.put(WORKERS.plural, worker_object("w1", endpoint, max_sessions=1_000_000))
        settings = RouterSettings(
            namespace="default",
            replica="fuzz",
            config=RouterConfig(
                intake=IntakeLimits(max_body_bytes=1 << 20, body_timeout=2),
                session_rates=SessionRates(0, 0, 0, 0),
            ),
            flush_tick=3600,
        )
        router = Router(kube, settings)  # type: ignore[arg-type]
        server = TestServer(router.app(), host="127.0.0.1")
        await server.start_server(**settings.server_options())
        self.servers = [engine, server]
        assert server.port is not None
        self.port = server.port

    def start(self) -> None:
        self.thread.start()
        assert self.ready.wait(30)

    def stop(self) -> None:
        async def close() -> None:
            for server in reversed(self.servers):
                await server.close()

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


@pytest.fixture(scope="module")
def router_port() -> Iterator[int]:
    thread = RouterThread()
    thread.start()
    before = rss_mib()
    yield thread.port
    grown = rss_mib() - before
    thread.stop()
    print(f"\nfuzz: resident memory grew {grown:.0f} MiB over the cases")
    # Bounded: the cases create sessions (kept in the in-memory API) and nothing else.
    assert grown < 200, f"resident memory grew {grown:.0f} MiB"


def exchange(port: int, data: bytes, *, half_close: bool = True) -> tuple[int | None, str]:
    """Send ``data`` on a new connection; return the answer's status and head."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        connection.sendall(data)
        if half_close:
            connection.shutdown(socket.SHUT_WR)
        answer = b""
        while b"\r\n\r\n" not in answer:
            try:
                chunk = connection.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not chunk:
                break
            answer += chunk
    head = answer.split(b"\r\n\r\n", 1)[0].decode("latin-1")
    if not head.startswith("HTTP/1.1 "):
        return None, head
    return int(head[9:12]), head


def check(status: int | None, head: str) -> None:
    if status is None or status < 500:
        return
    lowered = head.lower()
    assert "x-sessionfleet-worker:" in lowered and "x-sessionfleet-reason:" not in lowered, head


def request(body: bytes, headers: dict[str, str] | None = None) -> bytes:
    lines = ["POST /v1/chat/completions HTTP/1.1", "Host: router", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    lines.append(f"Content-Length: {len(body)}")
    head = "\r\n".join(lines).encode("utf-8", "surrogateescape")
    return head + b"\r\n\r\n" + body


VALID = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
).encode()

header_values = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=300),
    st.sampled_from(["gzip", "br", "deflate", "identity", "", "application/json", "true"]),
)
header_names = st.sampled_from(
    [
        "Content-Type",
        "Content-Encoding",
        "X-Session-Id",
        "X-Parent-Session-Id",
        "X-Session-Final",
        "x-claude-code-session-id",
        "x-claude-code-agent-id",
        "x-claude-code-parent-agent-id",
        "session-id",
        "x-session-id",
        "x-parent-session-id",
        "Authorization",
        "Transfer-Encoding",
        "Expect",
        "User-Agent",
    ]
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)


def _printable(headers: dict[str, str]) -> dict[str, str]:
    # A line break inside a value would start another header: keep values on one line.
    return {k: v.replace("\r", " ").replace("\n", " ") for k, v in headers.items()}


@examples(1500)
@given(st.binary(max_size=3000))
def test_arbitrary_bytes(router_port: int, data: bytes) -> None:
    check(*exchange(router_port, data))


@examples(1500)
@given(st.dictionaries(header_names, header_values, max_size=5), st.sampled_from([VALID, b"{}"]))
def test_hostile_headers(router_port: int, headers: dict[str, str], body: bytes) -> None:
    check(*exchange(router_port, request(body, _printable(headers)), half_close=False))


def _mutate(body: bytes, edits: list[tuple[int, int, bytes]]) -> bytes:
    data = bytearray(body)
    for position, delete, insert in edits:
        at = position % (len(data) + 1)
        data[at : at + delete] = insert
    return bytes(data)


bodies = st.one_of(
    st.lists(
        st.tuples(st.integers(0, 10_000), st.integers(0, 4), st.binary(max_size=6)),
        min_size=1,
        max_size=6,
    ).map(lambda edits: _mutate(VALID, edits)),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(
        st.sampled_from(["model", "messages", "mod\\u0065l", "stream"]), json_values
    ).map(lambda d: json.dumps(d).encode()),
    st.integers(1, 200_000).map(lambda depth: b'{"a": ' + b"[" * depth + b"]" * depth + b"}"),
    st.sampled_from(
        [
            b'{"model":"\\q"}',
            b'{"model":"\xff"}',
            b'{"model": "' + MODEL.encode() + b'", "model": "other"}',
            b'{"messages": [], "model": "' + MODEL.encode() + b'", "tools": [{"model": 1}]}',
            b'{"mod\\u0065l": "' + MODEL.encode() + b'"}',
            b"\xef\xbb\xbf" + VALID,
        ]
    ),
)


@examples(2000)
@given(bodies, st.sampled_from([{}, {"X-Session-Id": "fuzzed"}, {"session-id": "fz-2"}]))
def test_mutated_bodies(router_port: int, body: bytes, headers: dict[str, str]) -> None:
    check(*exchange(router_port, request(body, headers), half_close=False))
