"""CPU per request of the router's client for workers against aiohttp's client.

Run from the repository root (after ``make venv``)::

    .venv/bin/python bench/router/client_cpu.py [--requests 20000] [--concurrency 64]

A trivial HTTP/1.1 server (a process of its own, on CPU 0 when there are two) answers
every request with the same 300-byte JSON body; this process (on CPU 1) sends POSTs of
a 650-byte body over kept connections, ``--concurrency`` at a time, first with aiohttp's
client set up as the router had it (no cookie jar, no automatic headers, no
decompression), then with :class:`sessionfleet.router.upstream.Upstream`, alternating
for ``--rounds`` rounds. It prints this process's CPU time per request (user + system,
the socket calls included) for each. Nothing here is pass/fail.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
from yarl import URL

from sessionfleet.router.upstream import Upstream

_JSON = (
    b'{"id":"x","object":"chat.completion","choices":[{"index":0,"message":'
    b'{"role":"assistant","content":"' + b"a" * 170 + b'"}}],"usage":{"prompt_tokens":1,'
    b'"completion_tokens":2,"total_tokens":3}}'
)
ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
    len(_JSON),
    _JSON,
)
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 600}]}).encode()
FIELDS = [("Content-Type", "application/json"), ("X-Session-Id", "s1"), ("Accept", "*/*")]


class _Server(asyncio.Protocol):
    """Answer each complete request (head and Content-Length body) with ANSWER."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = self.buffer[:end].lower()
            start = head.find(b"content-length:")
            length = int(head[start + 15 :].split(b"\r\n", 1)[0]) if start >= 0 else 0
            if len(self.buffer) < end + 4 + length:
                return
            self.buffer = self.buffer[end + 4 + length :]
            self.transport.write(ANSWER)


def serve(port: int) -> None:
    """Run the trivial server until killed."""
    loop = asyncio.new_event_loop()
    loop.run_until_complete(loop.create_server(_Server, "127.0.0.1", port))
    loop.run_forever()


async def _cpu_per_request(one: Callable[[], Awaitable[bytes]], requests: int, c: int) -> float:
    async def loop(count: int) -> None:
        for _ in range(count):
            await one()

    await asyncio.gather(*(loop(20) for _ in range(c)))  # connections open, code warm
    started = time.process_time()
    await asyncio.gather(*(loop(requests // c) for _ in range(c)))
    return 1e6 * (time.process_time() - started) / (requests // c * c)


async def aiohttp_client(url: str, requests: int, c: int) -> float:
    """CPU µs per request through aiohttp's client, as the router configured it."""
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        cookie_jar=aiohttp.DummyCookieJar(),
        auto_decompress=False,
        skip_auto_headers=("Accept-Encoding", "User-Agent"),
    ) as client:
        target = URL(url + "/v1/chat/completions", encoded=True)

        async def one() -> bytes:
            async with client.post(target, data=BODY, headers=dict(FIELDS)) as answer:
                return await answer.read()

        return await _cpu_per_request(one, requests, c)


async def upstream_client(url: str, requests: int, c: int) -> float:
    """CPU µs per request through the router's own client."""
    client = Upstream(connect_timeout=5, read_timeout=60)

    async def one() -> bytes:
        answer = await client.post(url, "/v1/chat/completions", FIELDS, BODY)
        try:
            return await answer.read()
        finally:
            answer.release()

    try:
        return await _cpu_per_request(one, requests, c)
    finally:
        await client.aclose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20000, help="per measurement")
    parser.add_argument("--concurrency", type=int, default=64, help="requests at a time")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    args = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    two = len(os.sched_getaffinity(0)) >= 2
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port)],
        preexec_fn=(lambda: os.sched_setaffinity(0, {0})) if two else None,
    )
    if two:
        os.sched_setaffinity(0, {1})
    url = f"http://127.0.0.1:{port}"
    results: dict[str, list[float]] = {"aiohttp": [], "upstream": []}
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        for _ in range(args.rounds):
            results["aiohttp"].append(
                asyncio.run(aiohttp_client(url, args.requests, args.concurrency))
            )
            results["upstream"].append(
                asyncio.run(upstream_client(url, args.requests, args.concurrency))
            )
    finally:
        server.kill()
    for name, values in results.items():
        print(
            f"{name:9} CPU per request: median {statistics.median(values):6.1f} us "
            f"(runs: {', '.join(f'{v:.1f}' for v in values)})"
        )
    ratio = statistics.median(results["upstream"]) / statistics.median(results["aiohttp"])
    print(f"upstream / aiohttp: {ratio:.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(int(sys.argv[2]))
    else:
        sys.exit(main())
