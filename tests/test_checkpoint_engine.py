"""The engine driver against real simulated engines over HTTP on 127.0.0.1."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from aiohttp.test_utils import TestServer

from sessionfleet.api import EngineType
from sessionfleet.checkpoint import CheckpointTarget, DriverError
from sessionfleet.checkpoint.driver import NotLeadingDriver
from sessionfleet.engines import FORWARDED_SESSION_HEADER
from sessionfleet.operator.drivers.engine import EngineDriver
from sessionfleet.resources.names import session_object_name
from sessionfleet.simengine.engine import EngineConfig
from sessionfleet.simengine.server import build_app

MODEL = "m"
PROMPT = [
    {"role": "system", "content": "You are a coding agent. " * 200},
    {"role": "user", "content": "Fix the failing test in parser.py."},
]

Start = Callable[[], Awaitable[str]]


@pytest.fixture
async def start() -> AsyncIterator[Start]:
    servers: list[TestServer] = []

    async def _start() -> str:
        server = TestServer(build_app(EngineConfig(model=MODEL)), host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        return str(server.make_url("")).rstrip("/")

    yield _start
    for server in servers:
        await server.close()


async def turn(base: str, session: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:
        async with http.post(
            f"{base}/v1/chat/completions",
            json={"model": MODEL, "messages": PROMPT, "max_tokens": 8},
            headers={FORWARDED_SESSION_HEADER: session},
        ) as response:
            assert response.status == 200
            return await response.json()  # type: ignore[no-any-return]


def target(base: str, location: Path, sessions: tuple[str, ...] = ()) -> CheckpointTarget:
    return CheckpointTarget(
        namespace="ns",
        worker="w",
        epoch=1,
        engine=EngineType.SIM,
        endpoint=base,
        location=str(location),
        sessions=sessions,
    )


async def test_a_whole_worker_checkpoint_restores_into_a_fresh_engine(
    start: Start, tmp_path: Path
) -> None:
    source = await start()
    first = await turn(source, "s1")
    prompt_tokens = first["usage"]["prompt_tokens"]
    async with httpx.AsyncClient() as http:
        driver = EngineDriver(http)
        saved = await driver.save(target(source, tmp_path / "ckpt"))
        assert saved.sessions["s1"] >= prompt_tokens - 16
        assert saved.size_bytes > 0 and saved.total_tokens == saved.sessions["s1"]
        fresh = await start()
        assert (await turn(fresh, "s1"))["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        other = await start()
        loaded = await driver.load(target(other, tmp_path / "ckpt"))
        assert loaded.sessions == saved.sessions
    again = await turn(other, "s1")
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt_tokens - 16


async def test_a_deposed_operator_never_calls_the_engine(start: Start, tmp_path: Path) -> None:
    """Save, load and KV-store control are refused unsent once the gate has closed."""
    source = await start()
    await turn(source, "s1")
    async with httpx.AsyncClient() as http:
        driver = EngineDriver(http, write_gate=lambda: False)
        for call in (driver.save, driver.load):
            with pytest.raises(NotLeadingDriver, match="not the leader"):
                await call(target(source, tmp_path / "ckpt"))
        with pytest.raises(NotLeadingDriver):
            await driver.store_control(target(source, tmp_path / "ckpt"), {"op": "retain"})
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("session", ["s1", "../escape", "/etc/x"])
async def test_a_per_session_checkpoint_moves_only_that_session(
    start: Start, tmp_path: Path, session: str
) -> None:
    source, destination = await start(), await start()
    await turn(source, session)
    location = tmp_path / "ckpt"
    async with httpx.AsyncClient() as http:
        driver = EngineDriver(http)
        saved = await driver.save(target(source, location, (session,)))
        assert set(saved.sessions) == {session}
        # The session's directory is named like its AgentSession, never by the raw id.
        assert list(tmp_path.iterdir()) == [location]
        assert list(location.iterdir()) == [location / session_object_name(session)]
        await driver.load(target(destination, location, (session,)))
    moved = await turn(destination, session)
    assert moved["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_restore_args_and_errors(start: Start, tmp_path: Path) -> None:
    async with httpx.AsyncClient() as http:
        driver = EngineDriver(http)
        assert driver.restore_args(EngineType.SIM, "/c/x") == ["--import-cache=/c/x"]
        assert driver.restore_args(EngineType.VLLM, "/c/x") == []
        base = await start()
        # A session with no turn on the engine has nothing to save; the others in the
        # batch are saved (a drain batch once failed whole for one such session).
        await turn(base, "known")
        saved = await driver.save(target(base, tmp_path / "b", ("unknown-session", "known")))
        assert set(saved.sessions) == {"known"} and saved.sessions["known"] > 0
        nothing = await driver.save(target(base, tmp_path / "c", ("unknown-session",)))
        assert nothing.sessions == {} and nothing.size_bytes == 0
        # A 404 that is not the engine's own (no such route) is still an error.
        with pytest.raises(DriverError, match="404"):
            await driver._call(target(base, tmp_path), "/no/such/route", {"session": "s"})
        with pytest.raises(DriverError, match="unreachable"):
            await driver.save(target("http://127.0.0.1:9", tmp_path))
