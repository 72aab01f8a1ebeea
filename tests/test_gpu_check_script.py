"""scripts/gpu/cuda_checkpoint_check.py: its flow against the stand-in libcuda, and no GPU.

The script is for GPU machines; here it must say clearly that there is no GPU, and its
whole flow (child, lock, checkpoint, restore, unlock, verify, report) must run against
the stand-in library, whose "GPU memory" is host memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cuda_standin import build, compiler

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu" / "cuda_checkpoint_check.py"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )


def report(done: subprocess.CompletedProcess[str]) -> dict[str, object]:
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_without_a_gpu_it_says_so_and_exits_2() -> None:
    done = run("--libcuda=/nonexistent/libcuda.so.1")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no usable GPU here" in done.stdout
    assert "driver >= 570" in done.stdout


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if compiler() is None:
        pytest.fail("needs a C compiler (cc or gcc) for the stand-in libcuda")
    return build(tmp_path_factory.mktemp("libcuda"))


def test_the_whole_cycle_runs_and_reports(standin: Path) -> None:
    done = run(f"--libcuda={standin}", "--mib=2", "--lock-timeout-ms=1234")
    assert done.returncode == 0, done.stdout + done.stderr
    figures = report(done)
    assert figures["ok"] is True and figures["failures"] == []
    assert figures["bytes"] == 2 << 20 and figures["remapped"] is False
    for key in ("lockSeconds", "checkpointSeconds", "restoreSeconds", "unlockSeconds"):
        assert isinstance(figures[key], float)
    assert "[ok] GPU memory is intact after the cycle" in done.stdout


def test_a_remap_that_did_not_move_the_process_fails(standin: Path) -> None:
    # The stand-in's child always reports its first "GPU", so the remap check must fail.
    done = run(f"--libcuda={standin}", "--mib=1", "--remap")
    assert done.returncode == 1, done.stdout + done.stderr
    assert report(done)["failures"] == ["the child now runs on the second GPU"]
