"""Shared fixtures for the unit tests: the example manifests, and the router test bed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from router_fleet import Fleet

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
EXPECT_ERROR = "sessionfleet.dev/expect-error"


def load_manifests(folder: Path) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(folder.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path.name, doc))
    return out


VALID = load_manifests(EXAMPLES)
INVALID = load_manifests(EXAMPLES / "invalid")


@pytest.fixture(params=VALID, ids=[name for name, _ in VALID])
def valid_manifest(request: pytest.FixtureRequest) -> dict[str, Any]:
    return request.param[1]  # type: ignore[no-any-return]


@pytest.fixture(params=INVALID, ids=[name for name, _ in INVALID])
def invalid_manifest(request: pytest.FixtureRequest) -> dict[str, Any]:
    return request.param[1]  # type: ignore[no-any-return]


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    fleet = Fleet()
    yield fleet
    await fleet.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session
