"""Checkpoint benchmark: save/restore time and size, and the prefill they spare.

Real simulated engines (their aiohttp servers on 127.0.0.1) and the operator's own
engine driver (``sessionfleet.operator.drivers.engine.EngineDriver``) — the same calls the
WorkerCheckpoint controller makes — measure:

1. checkpoint (export) and restore (import into a fresh engine) time and size for one
   session of about 10K, 80K and 180K simulated tokens;
2. the prompt tokens the next turn recomputes after a drain — moved through a
   checkpoint (Migrate) versus rebound without one (Wait with the deadline released) —
   and after a failure, restored from a checkpoint taken a few turns earlier versus a
   cold restart.

Run: ``.venv/bin/python bench/checkpoint/run.py`` (about 10 s).
The simulated engine stores block hashes, not KV tensors, so its sizes are those of
the snapshot format; the real KV of the same prefix is about 3.8 GB per 100K tokens
(docs/background.md, "Agentic workloads"), shown beside them for scale.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from aiohttp.test_utils import TestServer

from sessionfleet.api import EngineType
from sessionfleet.checkpoint import CheckpointTarget
from sessionfleet.engines import FORWARDED_SESSION_HEADER
from sessionfleet.operator.drivers.engine import EngineDriver
from sessionfleet.simengine.engine import EngineConfig
from sessionfleet.simengine.server import build_app
from sessionfleet.workload import CHARS_PER_TOKEN

MODEL = "bench"
KV_BYTES_PER_TOKEN = 3.8e9 / 100_000  # docs/background.md: ~3.8 GB of KV per 100K tokens
REPEATS = 5


async def start_engine(servers: list[TestServer]) -> str:
    config = EngineConfig(model=MODEL, kv_tokens=2_000_000)
    server = TestServer(build_app(config), host="127.0.0.1")
    await server.start_server()
    servers.append(server)
    return str(server.make_url("")).rstrip("/")


def text_of(tokens: int, seed: str) -> str:
    """About ``tokens`` simulated tokens of distinct text."""
    word = f"{seed}abc "
    return word * (tokens * CHARS_PER_TOKEN // len(word))


async def turn(
    http: aiohttp.ClientSession, base: str, session: str, messages: list[dict[str, str]]
) -> dict[str, Any]:
    async with http.post(
        f"{base}/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 8},
        headers={FORWARDED_SESSION_HEADER: session},
    ) as response:
        response.raise_for_status()
        return await response.json()  # type: ignore[no-any-return]


def uncached(answer: dict[str, Any]) -> int:
    usage = answer["usage"]
    return int(usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"])


def target(base: str, location: Path, sessions: tuple[str, ...] = ()) -> CheckpointTarget:
    return CheckpointTarget("bench", "w", 1, EngineType.SIM, base, str(location), sessions=sessions)


async def sizes(workdir: Path) -> list[dict[str, Any]]:
    rows = []
    servers: list[TestServer] = []
    async with aiohttp.ClientSession() as http, httpx.AsyncClient() as client:
        driver = EngineDriver(client)
        for tokens in (10_000, 80_000, 180_000):
            saves, loads, size, captured = [], [], 0, 0
            for repeat in range(REPEATS):
                source = await start_engine(servers)
                messages = [{"role": "user", "content": text_of(tokens, f"s{tokens}r{repeat}")}]
                await turn(http, source, "s", messages)
                where = workdir / f"{tokens}-{repeat}"
                saved = await driver.save(target(source, where, ("s",)))
                saves.append(saved.seconds)
                size, captured = saved.size_bytes, saved.sessions["s"]
                fresh = await start_engine(servers)
                loaded = await driver.load(target(fresh, where, ("s",)))
                loads.append(loaded.seconds)
                hit = await turn(http, fresh, "s", messages)
                assert uncached(hit) <= 32, hit["usage"]  # the restore really carried it
            rows.append(
                {
                    "tokens": captured,
                    "save_ms": 1000 * statistics.median(saves),
                    "restore_ms": 1000 * statistics.median(loads),
                    "bytes": size,
                    "kv_gb": captured * KV_BYTES_PER_TOKEN / 1e9,
                }
            )
    for server in servers:
        await server.close()
    return rows


async def recomputation(workdir: Path, turns: int = 20, checkpoint_at: int = 15) -> dict[str, int]:
    """Prompt tokens recomputed by the next turn after a drain and after a failure."""
    servers: list[TestServer] = []
    out: dict[str, int] = {}
    async with aiohttp.ClientSession() as http, httpx.AsyncClient() as client:
        driver = EngineDriver(client)
        source = await start_engine(servers)
        messages = [{"role": "system", "content": text_of(12_000, "sys")}]
        for step in range(turns):
            messages.append({"role": "user", "content": text_of(2_242, f"t{step}")})
            answer = await turn(http, source, "s", messages)
            messages.append(
                {"role": "assistant", "content": answer["choices"][0]["message"]["content"]}
            )
            if step == checkpoint_at - 1:
                periodic = workdir / "periodic"
                await driver.save(target(source, periodic))
        messages.append({"role": "user", "content": text_of(2_242, "next")})

        # Drain, Migrate: the session moves through a checkpoint taken at the boundary.
        moved = await start_engine(servers)
        await driver.save(target(source, workdir / "drain", ("s",)))
        await driver.load(target(moved, workdir / "drain", ("s",)))
        out["drain_migrate"] = uncached(await turn(http, moved, "s", messages))
        # Drain, Wait, deadline released: the pod goes, the session lands cold elsewhere.
        cold = await start_engine(servers)
        out["drain_released"] = uncached(await turn(http, cold, "s", messages))
        # Failure with the periodic checkpoint of turn `checkpoint_at`: a new epoch restores.
        restored = await start_engine(servers)
        await driver.load(target(restored, periodic))
        out["failure_checkpoint"] = uncached(await turn(http, restored, "s", messages))
        # Failure without a checkpoint: the new epoch starts empty.
        empty = await start_engine(servers)
        out["failure_cold"] = uncached(await turn(http, empty, "s", messages))
        out["prompt"] = (await turn(http, empty, "s", messages))["usage"]["prompt_tokens"]
    for server in servers:
        await server.close()
    return out


async def main() -> int:
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        rows = await sizes(Path(tmp))
        recompute = await recomputation(Path(tmp))
    print("checkpoint and restore of one session (engine driver, median of 5)")
    print(f"{'tokens':>8} {'save ms':>8} {'restore ms':>11} {'bytes':>8} {'real KV (est.)':>15}")
    for row in rows:
        print(
            f"{row['tokens']:>8,} {row['save_ms']:>8.2f} {row['restore_ms']:>11.2f} "
            f"{row['bytes']:>8,} {row['kv_gb']:>12.1f} GB"
        )
    prompt = recompute["prompt"]
    print(f"\nrecomputed prompt tokens at the next turn (20 turns, prompt {prompt:,} tokens)")
    for key, label in (
        ("drain_migrate", "drain, Migrate through a checkpoint"),
        ("drain_released", "drain, Wait with the deadline released"),
        ("failure_checkpoint", "failure, restored from the checkpoint of turn 15"),
        ("failure_cold", "failure, no checkpoint"),
    ):
        print(f"  {label:<52} {recompute[key]:>8,}  ({100 * recompute[key] / prompt:5.1f}%)")
    print(f"\n({time.monotonic() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
