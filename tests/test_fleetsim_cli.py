"""``sessionfleet simulate``: the table, JSON, trace files, drains, plots and errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from sessionfleet.cli import main
from sessionfleet.fleetsim import STRATEGIES

SMALL = ["simulate", "--sessions", "120", "--workers", "4", "--no-progress"]


def test_prints_the_strategy_comparison(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(SMALL) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("strategy"))
    for column in ("hit rate", "recomputed", "TTFT mean", "TTFT p95", "drain", "lost cache"):
        assert column in header
    for name in STRATEGIES:
        assert f"\n{name}" in out
    # Two drains and a failure are injected by default.
    assert out.count("  drain of worker-") == 2 and out.count("  failure of worker-") == 1


def test_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--strategies", "affinity,operator", "--json", "-"]) == 0
    out = capsys.readouterr().out
    document = json.loads(out[out.index("\n[") + 1 :])
    assert [row["strategy"] for row in document] == [
        "affinity",
        "operator (WaitThenMigrate ckpt every 300s)",
    ]
    assert all(0 < row["hit_rate"] < 1 and row["sessions"] == 120 for row in document)
    assert len(document[1]["drains"]) == 2 and len(document[1]["failures"]) == 1


def test_operator_rows_per_drain_mode_and_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    args = [*SMALL, "--strategies", "operator", "--drain-mode", "all", "--checkpoint", "both"]
    assert main([*args, "--json", str(out)]) == 0
    labels = [row["strategy"] for row in json.loads(out.read_text())]
    assert len(labels) == 6
    assert "operator (Wait no-ckpt)" in labels
    assert "operator (Migrate ckpt every 300s)" in labels


def test_explicit_drains_and_failures(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    args = [*SMALL, "--strategies", "operator", "--drain", "5m:1", "--fail", "400:2:node"]
    assert main([*args, "--json", str(out), "--drain-mode", "Migrate"]) == 0
    (row,) = json.loads(out.read_text())
    assert [d["worker"] for d in row["drains"]] == ["worker-01"]
    assert row["drains"][0]["started_s"] == 300
    assert [f["worker"] for f in row["failures"]] == ["worker-02"]


def test_replays_a_trace_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.jsonl"
    rows = [
        {
            "id": n,
            "conversations": [
                {"from": "human", "value": "instructions " * 300 + f"task {n}"},
                {"from": "gpt", "value": "a" * 300},
                {"from": "human", "value": "result " * 400},
                {"from": "gpt", "value": "b" * 300},
            ],
        }
        for n in range(30)
    ]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main([*SMALL, "--trace", str(trace), "--drains", "0", "--failures", "0"]) == 0
    out = capsys.readouterr().out
    assert f"30 sessions from {trace}" in out
    assert "60 turns per strategy" in out


def test_progress_bar_on_request(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL[:-1], "--strategies", "affinity", "--progress"]) == 0
    err = capsys.readouterr().err
    assert "affinity" in err and "120/120 sessions" in err


def test_no_progress_bar_when_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--sessions", "40", "--strategies", "affinity"]) == 0
    assert capsys.readouterr().err == ""


def test_plot_without_matplotlib_says_how_to_get_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes the import fail
    png = tmp_path / "out.png"
    assert main([*SMALL, "--strategies", "affinity", "--plot", str(png)]) == 2
    assert "pip install 'sessionfleet[plot]'" in capsys.readouterr().err
    assert not png.exists()


def test_plot_writes_a_png(tmp_path: Path) -> None:
    # matplotlib is in the dev extra, so this runs wherever the tests do.
    png = tmp_path / "out.png"
    assert main([*SMALL, "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--grace", "20m", "--deadline", "10m"], "gracePeriod must not be longer than deadline"),
        (["--drain", "100:9"], "worker 9 does not exist"),
        (["--trace", "/nonexistent/trace.json"], "No such file"),
    ],
)
def test_bad_settings_exit_2_with_the_reason(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*SMALL, *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "args",
    [
        ["--strategies", "random"],
        ["--drain-mode", "Later"],
        ["--drain", "soon"],
        ["--sessions", "0"],
    ],
)
def test_bad_arguments_are_refused_by_the_parser(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*SMALL, *args])
    assert exit_info.value.code == 2
    assert "simulate: error:" in capsys.readouterr().err


def test_steady_state_table_behind_one_admission_cap(capsys: pytest.CaptureFixture[str]) -> None:
    """--steady with a cap prints the fair table: admission, goodput, utilisation columns."""
    args = [*SMALL, "--rate", "2", "--admission-cap", "10", "--client-timeout", "5m", "--steady"]
    assert main([*args, "--strategies", "affinity,llm-d,operator"]) == 0
    out = capsys.readouterr().out
    assert "admission cap 10, client timeout 300s" in out
    fair = out[out.index("steady state:") :]
    header = next(line for line in fair.splitlines() if line.startswith("strategy"))
    for column in ("TTFT p50", "admit p50", "queue mean/max", "on target", "prefill util"):
        assert column in header
    assert "\nllm-d" in fair


def test_sweep_finds_a_sustained_rate_per_strategy(capsys: pytest.CaptureFixture[str]) -> None:
    """Round-robin sustains less than affinity on the same fleet; each gets a row."""
    args = ["simulate", "--sessions", "200", "--workers", "2", "--no-progress"]
    args += ["--prefill-tokens-per-second", "20000", "--strategies", "round-robin,affinity"]
    assert main([*args, "--sweep", "0.01:2", "--ttft-target", "2"]) == 0
    rows = {
        line.split()[0]: line.split()[1]
        for line in capsys.readouterr().out.splitlines()
        if line.startswith(("round-robin ", "affinity "))
    }
    rate = {name: float(text.strip("</s")) for name, text in rows.items() if text != "<"}
    assert set(rows) == {"round-robin", "affinity"}
    assert rate.get("round-robin", 0.0) < rate["affinity"]


@pytest.mark.parametrize("sweep", ["2:1", "fast", "0:1"])
def test_a_bad_sweep_is_a_clear_error(sweep: str, capsys: pytest.CaptureFixture[str]) -> None:
    """LOW:HIGH with 0 < LOW < HIGH, or exit status 2 with a message."""
    assert main([*SMALL, "--sweep", sweep]) == 2
    assert "--sweep wants" in capsys.readouterr().err


def test_replay_prints_the_recorded_hit_rate(capsys: pytest.CaptureFixture[str]) -> None:
    """Each replay strategy's hit rate, then the trace's own."""
    trace = Path(__file__).parent / "fixtures" / "traces" / "mooncake.jsonl"
    assert main(["simulate", "--replay", str(trace), "--workers", "2", "--json", "-"]) == 0
    out = capsys.readouterr().out
    assert "(recorded)" in out
    document = json.loads(out.splitlines()[-1])
    assert 0 < document["recorded_hit_rate"] < 1
    assert {row["strategy"] for row in document["results"]} >= {"affinity", "operator"}


def test_replay_of_a_bad_file_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not a trace: exit status 2 and the file named."""
    bad = tmp_path / "conversation.json"
    bad.write_text("[1, 2]")
    assert main(["simulate", "--replay", str(bad)]) == 2
    assert "conversation.json" in capsys.readouterr().err
