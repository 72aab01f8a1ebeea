"""The command line: version, and CRD generation with its drift check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sessionfleet import __version__
from sessionfleet.cli import main

REPO = Path(__file__).resolve().parent.parent


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version"]) == 0
    assert capsys.readouterr().out.strip() == f"sessionfleet {__version__}"


def test_crds_writes_then_check_passes(tmp_path: Path) -> None:
    assert main(["crds", "--output-dir", str(tmp_path)]) == 0
    assert len(list(tmp_path.glob("*.sessionfleet.dev.yaml"))) == 4
    assert main(["crds", "--output-dir", str(tmp_path), "--check"]) == 0


def test_check_fails_on_a_hand_edit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["crds", "--output-dir", str(tmp_path)])
    target = tmp_path / "drainpolicies.sessionfleet.dev.yaml"
    target.write_text(target.read_text().replace("default: 10m", "default: 99m"))
    capsys.readouterr()
    assert main(["crds", "--output-dir", str(tmp_path), "--check"]) == 1
    out = capsys.readouterr().out
    assert "-                default: 99m" in out and "drift from the models" in out


def test_check_fails_on_a_stray_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["crds", "--output-dir", str(tmp_path)])
    (tmp_path / "old.sessionfleet.dev.yaml").write_text("x")
    assert main(["crds", "--output-dir", str(tmp_path), "--check"]) == 1
    assert "no model generates this file" in capsys.readouterr().out


def test_committed_crds_match_the_models() -> None:
    assert main(["crds", "--output-dir", str(REPO / "crds"), "--check"]) == 0


def test_unknown_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["fly"])
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["elsewhere", "root"])
def test_python_dash_m(tmp_path: Path, where: str) -> None:
    # From the repository root too, with no environment variable: no folder there
    # shadows the standard library (the old top-level `operator/` package did).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import operator, sys; operator.eq; sys.argv[0] = 'x'; "
            "from sessionfleet.cli import main; main(['version'])",
        ]
        if where == "root"
        else [sys.executable, "-m", "sessionfleet", "version"],
        cwd=REPO if where == "root" else tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == f"sessionfleet {__version__}"
