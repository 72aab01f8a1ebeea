"""``make demo`` in its fast mode, on a cluster of its own, and the report's invariants.

The demo starts its own control plane in a temporary state dir (its drain must not
disturb the shared cluster's tests) and is always stopped, whatever happens. One run
with ``--checkpoints both`` kills two engines: one of a worker with checkpoints (its
sessions resume from the restored cache) and one without (they recompute). Another
runs two of its workers on the real vLLM (``--engine vllm``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.helpers import VLLM_LANE_WAIT, one_vllm_lane_at_a_time
from e2e.localcluster._process import ProcessRecord, start_ticks

REPO = Path(__file__).resolve().parents[1]
RUN = REPO / "demo" / "run.py"
ENV = dict(os.environ)
SLACK = 64  # the engine caches whole blocks


def demo(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(RUN), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
        cwd=REPO,
        check=False,
    )


@pytest.fixture
def fast_run(tmp_path: Path) -> Iterator[tuple[dict[str, Any], str]]:
    base = tmp_path
    state, out = base / "state", base / "out"
    try:
        result = demo(
            "up",
            "--fast",
            "--checkpoints=both",
            f"--state-dir={state}",
            f"--out-dir={out}",
            "--down-after",
            timeout=160,
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
        the_router_held_its_lease_slot(state)
        yield json.loads((out / "report.json").read_text()), result.stdout
    finally:
        demo("down", f"--state-dir={state}", timeout=60)


def the_router_held_its_lease_slot(state: Path) -> None:
    """The router's Lease slot was granted: the chart's admission policy allows only its
    own slots, and without one the operator moves sessions without the router's
    turn-boundary acknowledgement (a turn in flight on a drained worker then fails)."""
    log = (state / "logs" / "router.log").read_text()
    assert "cannot renew lease" not in log, log[-2000:]


def _every_session_finished_and_no_turn_was_lost(fast_run: tuple[dict[str, Any], str]) -> None:
    report, stdout = fast_run
    totals = report["totals"]
    assert totals["sessions"] >= 10 and totals["child_sessions"] >= 1
    assert totals["sessions_ok"] == totals["sessions"], [
        s for s in report["sessions"] if not s["ok"]
    ]
    assert totals["turns"] == totals["planned_turns"]
    assert {"ClaudeCode", "Codex", "OpenCode"} <= set(totals["clients"])
    assert 0.5 < totals["hit_rate"] < 1.0
    assert "=== sessionfleet demo report ===" in stdout


def _the_drain_was_held_then_completed_and_moved_sessions_hit_the_cache(
    fast_run: tuple[dict[str, Any], str],
) -> None:
    drain = fast_run[0]["drain"]
    assert drain["pinned_at_start"] >= 1
    assert drain["held"], "the eviction of a worker pod was refused while sessions were pinned"
    assert drain["completed"] and drain["duration_seconds"] > 0
    assert drain["waited"] + drain["migrated"] + drain["released"] >= drain["pinned_at_start"]
    for moved in drain["migrated_turns"]:
        assert moved["from_cache"], moved
        assert moved["cached_tokens"] >= moved["prefix_tokens"] - SLACK, moved


def _a_restored_worker_serves_from_cache_and_one_without_checkpoints_recomputes(
    fast_run: tuple[dict[str, Any], str],
) -> None:
    by_mode = {r["checkpoints"]: r for r in fast_run[0]["recoveries"]}
    restored, lost = by_mode["on"], by_mode["off"]
    for recovery in (restored, lost):
        assert recovery["epoch_after"] == recovery["epoch_before"] + 1, recovery
        assert recovery["ready"] is not None and recovery["recovery_seconds"] > 0
    assert restored["restore_count"] == 1 and lost["restore_count"] == 0
    assert restored["sessions"], "a session of the restored worker had a turn after the kill"
    assert restored["tokens_not_recomputed"] > 0
    assert lost["sessions"], "a session of the worker without checkpoints had a turn after it"
    for turn in lost["sessions"]:
        assert turn["recomputed_tokens"] > turn["prefix_tokens"] // 2, turn


def _the_report_files_and_the_simulator_comparison(
    fast_run: tuple[dict[str, Any], str],
) -> None:
    report_md = fast_run[1]
    assert "report:" in report_md and "report.md" in report_md
    simulator = {s["strategy"]: s for s in fast_run[0]["simulator"]}
    assert simulator["round-robin"]["hit_rate"] < simulator["affinity"]["hit_rate"]


@pytest.mark.timeout(200)
def test_fast_demo_report_invariants(fast_run: tuple[dict[str, Any], str]) -> None:
    # One test: under pytest-xdist, tests of a module may land on different workers,
    # and each would start its own demo.
    _every_session_finished_and_no_turn_was_lost(fast_run)
    _the_drain_was_held_then_completed_and_moved_sessions_hit_the_cache(fast_run)
    _a_restored_worker_serves_from_cache_and_one_without_checkpoints_recomputes(fast_run)
    _the_report_files_and_the_simulator_comparison(fast_run)


@pytest.mark.timeout(400 + VLLM_LANE_WAIT)
def test_the_fast_demo_with_two_workers_on_real_vllm(tmp_path: Path) -> None:
    # DEMO_ENGINE=vllm: w-0 (drained) and w-1 (killed) run the real vLLM with their KV
    # store (checkpoints on); the other three the simulated engine.
    state, out = tmp_path / "state", tmp_path / "out"
    try:
        with one_vllm_lane_at_a_time():
            result = demo(
                "up",
                "--fast",
                "--engine=vllm",
                f"--state-dir={state}",
                f"--out-dir={out}",
                "--down-after",
                timeout=360,
            )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
        the_router_held_its_lease_slot(state)
        report = json.loads((out / "report.json").read_text())
    finally:
        demo("down", f"--state-dir={state}", timeout=60)
    pods = state / "cluster" / "pods" / "sessionfleet-demo"
    for pod in ("w-0-1", "w-1-1", "w-1-2"):
        first_line = (pods / pod / "engine.log").read_text().splitlines()[0]
        assert "vllm serve" in first_line, first_line
    assert "sim-engine" in (pods / "w-2-1" / "engine.log").read_text().splitlines()[0]
    totals = report["totals"]
    assert totals["sessions_ok"] == totals["sessions"]
    assert totals["turns"] == totals["planned_turns"]
    drain = report["drain"]
    assert drain["held"] and drain["completed"], drain
    (recovery,) = report["recoveries"]
    assert recovery["worker"] == "w-1" and recovery["checkpoints"] == "on", recovery
    assert recovery["epoch_after"] == recovery["epoch_before"] + 1 and recovery["ready"]
    for turn in recovery["sessions"]:
        # A new vLLM process loads the prefix the killed one saved, as vLLM reports it.
        assert turn["recomputed_tokens"] < turn["prefix_tokens"] // 2, turn


@pytest.mark.timeout(60)
def test_a_second_demo_while_one_is_up_says_so(tmp_path: Path) -> None:
    # A demo whose recorded process (this test's own) still runs.
    record = ProcessRecord("operator", os.getpid(), start_ticks(os.getpid()) or 0, "x.log")
    (tmp_path / "demo.json").write_text(
        json.dumps({"processes": [record.to_json()], "kubeconfig": "/k/config"})
    )
    result = demo("up", "--fast", f"--state-dir={tmp_path}", timeout=50)
    assert result.returncode == 2
    assert "already up" in result.stderr and "make demo-down" in result.stderr
    # Nothing was started or stopped: the record is intact.
    assert json.loads((tmp_path / "demo.json").read_text())["kubeconfig"] == "/k/config"
