"""Byte-level fuzzing of the router's request handling: no 5xx of its own, no crash,
bounded memory.

A router (with a simulated engine behind it and the in-memory Kubernetes API) runs in a
process of its own, whose memory is measured. Each case is written to a fresh TCP
connection as raw bytes, and the answer's status line and headers are read back. Three
generators: arbitrary bytes; requests with hostile headers (encodings, content types,
session ids, finals, keys); and structured mutations of a valid request's body (byte
edits, random JSON, nesting, duplicate and escaped keys, invalid UTF-8). An answer the
router gives itself carries ``X-Sessionfleet-Reason``; one it passed on from the worker
carries ``X-Sessionfleet-Worker``. In this setup (a healthy worker, no limits) the
router must answer every case below 500.

``make test`` runs 5,000 cases with a fixed seed (the same cases every run); ``make
bench-fuzz`` runs 100,000+ random ones (``SESSIONFLEET_FUZZ_EXAMPLES``) and reports the
router process's resident memory.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import socket
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from router_fakes import FakeKube
from router_fleet import MODEL, worker_object

from sessionfleet.fronts.admission import SessionRates
from sessionfleet.kube import WORKERS
from sessionfleet.router.limits import IntakeLimits
from sessionfleet.router.proxy import RouterConfig
from sessionfleet.router.server import Router, RouterSettings
from sessionfleet.simengine.engine import EngineConfig
from sessionfleet.simengine.server import build_app

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


def memory_mib(pid: int) -> tuple[float, float]:
    """A process's resident memory now and at its peak (VmRSS, VmHWM), in MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


def _serve(port_out: Connection) -> None:
    """The router process: an engine and a router on 127.0.0.1, the in-memory API."""
    # aiohttp logs each request its HTTP parser refuses; thousands of them say nothing.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)

    async def start() -> None:
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
        port_out.send(server.port)
        await asyncio.Event().wait()

    asyncio.run(start())


@pytest.fixture(scope="module")
def router_port() -> Iterator[int]:
    """A router in a process of its own, so that its memory is its own."""
    context = multiprocessing.get_context("spawn")
    port_in, port_out = context.Pipe(duplex=False)
    process = context.Process(target=_serve, args=(port_out,), daemon=True)
    process.start()
    try:
        assert port_in.poll(60), "the router process did not start"
        port = port_in.recv()
        assert process.pid is not None
        before, _ = memory_mib(process.pid)
        yield port
        now, peak = memory_mib(process.pid)
    finally:
        process.kill()
        process.join(10)
    print(
        f"\nfuzz: router process resident memory {before:.0f} MiB at start, "
        f"{now:.0f} MiB after the cases, {peak:.0f} MiB at its peak"
    )
    # The cases create sessions (kept by the in-memory API in that process too); the
    # router must stay well within the chart's 512 MiB limit.
    assert peak < 512, f"the router process peaked at {peak:.0f} MiB"


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
