"""Bodies come from the API models: no hand-typed camelCase keys in controllers or router.

Every status patch and object the operator and the router write is built by a pure
builder in ``sessionfleet.resources`` from the pydantic models, whose aliases give the
wire names. A camelCase string key in a dict literal in the controllers or the router
would be a body typed by hand again, free to drift from the CRDs.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CHECKED = [
    *sorted((REPO / "controllers/sessionfleet/controllers").glob("*.py")),
    *sorted((REPO / "operator/sessionfleet/operator").glob("*.py")),
    *sorted((REPO / "operator/sessionfleet/router").glob("*.py")),
    *sorted((REPO / "operator/sessionfleet/fronts").glob("*.py")),
]
CAMEL = re.compile(r"^[a-z]+[A-Z][A-Za-z0-9]*$")


def camel_keys(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Dict):
            for key in node.keys:
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    if CAMEL.match(key.value):
                        found.append(f"{path.relative_to(REPO)}:{key.lineno}: {key.value!r}")
    return found


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: p.name)
def test_no_hand_typed_camel_case_keys(path: Path) -> None:
    assert not camel_keys(path)


def test_the_check_finds_one() -> None:
    sample = REPO / "build" / "camel_sample.py"
    sample.parent.mkdir(exist_ok=True)
    sample.write_text('BODY = {"status": {"pinnedSessions": 1}}\n')
    try:
        assert camel_keys(sample) == ["build/camel_sample.py:1: 'pinnedSessions'"]
    finally:
        sample.unlink()
