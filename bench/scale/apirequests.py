"""The API client's CPU per request: its own connections against httpx's pool.

An aiohttp server in a process of its own answers every PATCH after ``--delay``
seconds (an API server's latency) with a session's worth of JSON; the client sends
status PATCHes open loop at ``--rate`` a second for ``--seconds``, first through
httpx's transport and its connection pool (what ``Kube`` used before; up to 64
connections, as it had), then through ``Kube`` itself. Plain HTTP on loopback, so
what differs is the client's own work: the pool's bookkeeping and the request's
building. It reports the client's CPU per request (``time.process_time``), in pairs
run back to back.

    .venv/bin/python bench/scale/apirequests.py [--delay 0.005] [--rate 200] [--seconds 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

from bench.scale.memory import agent_session  # noqa: E402
from sessionfleet.kube import SESSIONS, Kube, KubeConfig  # noqa: E402

ANSWER = json.dumps(agent_session(0)).encode()


def serve(port: int, delay: float) -> None:
    """Answer every PATCH after ``delay`` seconds with one session's JSON."""

    async def patch(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(delay)
        return web.Response(body=ANSWER, content_type="application/json")

    app = web.Application()
    app.router.add_route("PATCH", "/{tail:.*}", patch)
    web.run_app(app, host="127.0.0.1", port=port, print=None, handle_signals=False)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


Send = Callable[[int], Awaitable[Any]]


async def through_httpx_pool(server: str) -> tuple[Send, Callable[[], Awaitable[None]]]:
    """A status PATCH as ``Kube`` sent it before: an httpx request to the pool (64)."""
    transport = httpx.AsyncHTTPTransport(
        limits=httpx.Limits(max_connections=64, max_keepalive_connections=32)
    )
    body = json.dumps({"status": {"phase": "Bound"}}).encode()

    async def send(i: int) -> Any:
        request = httpx.Request(
            "PATCH",
            f"{server}{SESSIONS.path('ns', f's{i}')}/status?fieldManager=sessionfleet",
            content=body,
            headers={
                "User-Agent": "bench",
                "Accept": "application/json",
                "Accept-Encoding": "gzip, deflate",
                "Content-Type": "application/merge-patch+json",
            },
        )
        response = await transport.handle_async_request(request)
        try:
            await response.aread()
        finally:
            await response.aclose()
        return response.json()

    return send, transport.aclose


async def through_kube(server: str) -> tuple[Send, Callable[[], Awaitable[None]]]:
    """The same PATCH through ``Kube``: its own connections."""
    kube = Kube(KubeConfig(server=server), user_agent="bench")

    async def send(i: int) -> Any:
        return await kube.patch(
            SESSIONS, f"s{i}", {"status": {"phase": "Bound"}}, "ns", status=True
        )

    return send, kube.aclose


async def measure(
    make: Callable[[str], Awaitable[tuple[Send, Callable[[], Awaitable[None]]]]],
    server: str,
    rate: float,
    seconds: float,
) -> dict[str, float]:
    """Send open loop at ``rate``; return the client's CPU per request and what it kept."""
    send, close = await make(server)
    tasks: list[asyncio.Task[Any]] = []
    started = time.monotonic()
    cpu_started = time.process_time()
    sent = 0
    while time.monotonic() - started < seconds:
        tasks.append(asyncio.create_task(send(sent)))
        sent += 1
        await asyncio.sleep(max(0.0, started + sent / rate - time.monotonic()))
    await asyncio.gather(*tasks)
    cpu = time.process_time() - cpu_started
    wall = time.monotonic() - started
    await close()
    return {
        "requests": sent,
        "achieved_per_second": round(sent / wall, 1),
        "cpu_ms_per_request": round(1000 * cpu / sent, 3),
    }


def main() -> int:
    """Run the pairs; print and optionally write the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay", type=float, default=0.005, help="server latency, seconds")
    parser.add_argument("--rate", type=float, default=200.0, help="requests a second")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    port = free_port()
    server_process = multiprocessing.Process(target=serve, args=(port, args.delay), daemon=True)
    server_process.start()
    server = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    results: dict[str, list[dict[str, float]]] = {"httpx_pool": [], "kube": []}
    try:
        for _ in range(args.pairs):
            for name, make in (("httpx_pool", through_httpx_pool), ("kube", through_kube)):
                figures = asyncio.run(measure(make, server, args.rate, args.seconds))
                results[name].append(figures)
                print(name, figures, flush=True)
    finally:
        server_process.terminate()
    report = {"delay_seconds": args.delay, "rate": args.rate, **results}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
