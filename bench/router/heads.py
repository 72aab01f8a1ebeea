"""Header floods against a router process: its resident memory with 500 held requests.

Each connection sends a request head as large as the server lets it, announces
``Content-Length: 10`` and sends no body: the request then waits for its body (30 s by
default), holding its head. Two head shapes: "aiohttp-max", the most aiohttp's parser
accepts (128 headers of 8,190 bytes: about 1 MiB), and "router-max", the most the
router accepts since issue 29 (just under ``--max-header-bytes``, 32 KiB). Each is run
with API keys off and on (the flood sends no key).

The router is a real process serving on 127.0.0.1 with the router's own listener
(``serve``), default limits, a simulated engine in the same process and the in-memory
Kubernetes API of the unit tests; a fresh process for each case. Figures: the process's
resident memory before the flood, after it (all heads sent, 2 s later) and at its peak
(VmHWM), and how each connection was answered.

    .venv/bin/python bench/router/heads.py --out build/bench-router-heads.json
    .venv/bin/python bench/router/heads.py --source /tmp/old   # another checkout's router
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
AIOHTTP_MAX_FIELD = 8190
AIOHTTP_MAX_HEADERS = 128
ROUTER_MAX_HEAD = 32 << 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def head(shape: str) -> bytes:
    """The flood's request head: the largest of its shape, Content-Length 10, no body."""
    lines = ["POST /v1/chat/completions HTTP/1.1", "Host: x", "Content-Length: 10"]
    if shape == "aiohttp-max":
        for i in range(AIOHTTP_MAX_HEADERS - 2):
            name = f"X-F{i}"
            lines.append(f"{name}: " + "a" * (AIOHTTP_MAX_FIELD - len(name)))
    else:
        size = len("\r\n".join(lines)) + 4
        i = 0
        while size < ROUTER_MAX_HEAD - 8200:
            lines.append(f"X-F{i}: " + "a" * 8000)
            size += len(lines[-1]) + 2
            i += 1
        lines.append("X-Last: " + "a" * (ROUTER_MAX_HEAD - size - 12))
    data = ("\r\n".join(lines) + "\r\n\r\n").encode()
    return data


def memory_mib(pid: int) -> tuple[float, float]:
    """A process's resident memory now and at its peak (VmRSS, VmHWM), in MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


def serve(port: int, keys_dir: str | None) -> None:
    """The router process (run with ``--serve``).

    Like the fuzz suite's router process, but self-contained on purpose: it runs the
    router of any checkout (``--source``), including ones older than a shared helper.
    """
    import logging

    from aiohttp.test_utils import TestServer
    from router_fakes import FakeKube
    from router_fleet import MODEL, worker_object

    from sessionfleet.kube import WORKERS
    from sessionfleet.router.server import RouterSettings
    from sessionfleet.router.server import serve as serve_router
    from sessionfleet.simengine.engine import EngineConfig
    from sessionfleet.simengine.server import build_app

    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)

    async def main() -> None:
        kube = FakeKube()
        engine = TestServer(build_app(EngineConfig(model=MODEL)), host="127.0.0.1")
        await engine.start_server()
        endpoint = str(engine.make_url("")).rstrip("/")
        kube.put(WORKERS.plural, worker_object("w1", endpoint, max_sessions=1_000_000))
        settings = RouterSettings(
            namespace="default",
            replica="bench",
            api_keys_dir=Path(keys_dir) if keys_dir else None,
            flush_tick=3600,
        )
        await serve_router(kube, settings, "127.0.0.1", port)  # type: ignore[arg-type]

    asyncio.run(main())


async def flood(port: int, data: bytes, connections: int) -> tuple[list[Any], Counter[str]]:
    """Open the connections, send each the head; return them and the errors met sending."""
    errors: Counter[str] = Counter()
    opened: list[Any] = []
    gate = asyncio.Semaphore(64)

    async def one() -> None:
        async with gate:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                opened.append((reader, writer))
                writer.write(data)
                await writer.drain()
            except OSError as error:
                errors[type(error).__name__] += 1

    await asyncio.gather(*(one() for _ in range(connections)))
    return opened, errors


async def answers(opened: list[Any]) -> Counter[str]:
    """How each connection was answered so far: a status, closed, or nothing (held)."""
    tally: Counter[str] = Counter()

    async def one(reader: asyncio.StreamReader) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 0.5)
        except TimeoutError:
            tally["held (no answer)"] += 1
            return
        except OSError:
            tally["reset"] += 1
            return
        status = line.split(b" ")[1].decode() if line.count(b" ") >= 2 else "closed"
        tally[status] += 1

    await asyncio.gather(*(one(reader) for reader, _ in opened))
    return tally


def run_case(
    source: Path, shape: str, keys: bool, connections: int, settle: float
) -> dict[str, Any]:
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{source / 'operator'}:{source / 'tests'}"
    with tempfile.TemporaryDirectory() as folder:
        keys_dir = None
        if keys:
            keys_dir = folder
            (Path(folder) / "team-a").write_text("k" * 48 + "\n")
        argv = [sys.executable, __file__, "--serve", str(port)]
        if keys_dir:
            argv += ["--keys-dir", keys_dir]
        process = subprocess.Popen(argv, env=env, cwd=source)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), 1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline or process.poll() is not None:
                        raise RuntimeError("the router process did not start") from None
                    time.sleep(0.1)
            time.sleep(1)
            before, _ = memory_mib(process.pid)

            async def attack() -> tuple[Counter[str], Counter[str], float, float]:
                opened, errors = await flood(port, head(shape), connections)
                await asyncio.sleep(settle)
                after, peak = memory_mib(process.pid)
                tally = await answers(opened)
                for _, writer in opened:
                    writer.close()
                return tally, errors, after, peak

            tally, errors, after, peak = asyncio.run(attack())
            alive = process.poll() is None
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
    return {
        "shape": shape,
        "head_bytes": len(head(shape)),
        "api_keys": keys,
        "connections": connections,
        "rss_before_mib": round(before, 1),
        "rss_after_mib": round(after, 1),
        "rss_peak_mib": round(peak, 1),
        "answers": dict(tally),
        "send_errors": dict(errors),
        "router_alive": alive,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--keys-dir", help=argparse.SUPPRESS)
    parser.add_argument("--source", type=Path, default=ROOT, help="checkout whose router runs")
    parser.add_argument("--connections", type=int, default=500)
    parser.add_argument("--settle", type=float, default=2.0, help="seconds after the flood")
    parser.add_argument("--shape", choices=["aiohttp-max", "router-max"], action="append")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.keys_dir)
        return 0
    results = []
    for shape in args.shape or ["aiohttp-max", "router-max"]:
        for keys in (False, True):
            result = run_case(args.source.resolve(), shape, keys, args.connections, args.settle)
            print(json.dumps(result), flush=True)
            results.append(result)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"source": str(args.source), "cases": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
