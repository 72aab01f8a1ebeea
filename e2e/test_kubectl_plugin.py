"""``kubectl sessionfleet`` against the real API server, a real operator and sim workers.

The plugin runs as the installed console script, ``kubectl-sessionfleet``, in a
subprocess, and through the pinned kubectl with the virtual environment's bin on PATH:
that kubectl finds the plugin there and runs it is part of what is tested.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from e2e.localcluster import LocalCluster
from e2e.operator import (
    Custom,
    OperatorProcess,
    bound_to,
    condition,
    drain_policy,
    ready_workers,
    session,
    sim_worker,
    wait_for,
)

pytestmark = pytest.mark.timeout(180)

BIN = Path(sys.executable).parent
PLUGIN = BIN / "kubectl-sessionfleet"


def show(argv: list[str], result: subprocess.CompletedProcess[str]) -> None:
    """Print a command and its output as a transcript (``pytest -s`` shows it)."""
    print(f"\n$ {' '.join(argv)}\n{result.stdout}{result.stderr}", end="")


def plugin(
    cluster: LocalCluster, *args: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run the console script itself, with the cluster's kubeconfig named by flag."""
    argv = [str(PLUGIN), f"--kubeconfig={cluster.kubeconfig}", *args]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    show(["kubectl-sessionfleet", *args], result)
    return result


def via_kubectl(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``kubectl <args>`` with the venv's bin first on PATH and $KUBECONFIG set."""
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "KUBECONFIG": str(cluster.kubeconfig),
    }
    argv = [str(cluster.tools().kubectl), *args]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, check=False)
    show(["kubectl", *args], result)
    return result


def row(output: str, first: str) -> list[str]:
    """The cells of the table row whose first cell is ``first``."""
    return next(line.split() for line in output.splitlines() if line.split()[:1] == [first])


def test_status_and_sessions_through_kubectl_show_ready_workers_and_their_sessions(
    operator: OperatorProcess, crs: Custom, namespace: str, cluster: LocalCluster
) -> None:
    for name in ("wa", "wb"):
        crs.create(sim_worker(name))
    ready_workers(crs, 2, operator)
    for i in range(4):
        crs.create(session(f"s{i}"))
    wait_for(operator, crs.all_in_phase("agentsessions", "Bound", 4), timeout=30, what="4 Bound")
    per_worker = {w: list(bound_to(crs).values()).count(w) for w in ("wa", "wb")}

    listed = via_kubectl(cluster, "plugin", "list")
    assert listed.returncode == 0, listed.stderr
    assert str(PLUGIN) in listed.stdout

    for result in (
        via_kubectl(cluster, "sessionfleet", "status", "-n", namespace),
        plugin(cluster, "-n", namespace, "status"),
    ):
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert lines[:4] == [
            f"Namespace:  {namespace}",
            "Workers:    2 (Ready 2)",
            "Sessions:   4 (Bound 4)",
            "Drains:     none",
        ]
        for name in ("wa", "wb"):
            cells = row(result.stdout, name)
            assert cells[1:3] == ["m", "Ready"]
            assert cells[3] == "1"  # epoch
            assert cells[4] == str(per_worker[name])  # pinned sessions
            assert cells[-3:] == ["default", "-", "-"]  # policy, drain, deadline

    status = json.loads(plugin(cluster, "status", "-n", namespace, "-o", "json").stdout)
    assert {w["name"]: w["pinnedSessions"] for w in status["workers"]} == per_worker
    assert status["sessions"] == {"total": 4, "byPhase": {"Bound": 4}}

    sessions = via_kubectl(cluster, "sessionfleet", "sessions", "-n", namespace)
    assert sessions.returncode == 0, sessions.stderr
    assert sessions.stdout.splitlines()[0].split() == [
        "ID", "PHASE", "WORKER", "TURNS", "CONTEXT", "HIT%", "AGE"
    ]  # fmt: skip
    for i in range(4):
        cells = row(sessions.stdout, f"id-s{i}")
        assert cells[1] == "Bound" and cells[2] == bound_to(crs)[f"s{i}"]
    only = json.loads(
        plugin(cluster, "sessions", "-n", namespace, "--worker", "wa", "-o", "json").stdout
    )
    assert len(only) == per_worker["wa"] and {s["worker"] for s in only} <= {"wa"}
    missing = plugin(cluster, "sessions", "-n", namespace, "--worker", "ghost")
    assert missing.returncode == 1
    assert (
        missing.stderr == f'error: InferenceWorker "ghost" not found in namespace "{namespace}"\n'
    )


def _load_output(argv: list[str]) -> Any:
    """Run the plugin by path and return its output's document (JSON is YAML too)."""
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    show(["kubectl-sessionfleet", *argv[1:]], result)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def kubeconfig_elsewhere(cluster: LocalCluster, namespace: str, path: Path) -> str:
    """Copy the cluster's kubeconfig with its context's namespace set to ``namespace`` and a
    second context, the current one, at an address where nothing listens; return the
    cluster's context name."""
    config = yaml.safe_load(cluster.kubeconfig.read_text())
    real = config["current-context"]
    (context,) = [c for c in config["contexts"] if c["name"] == real]
    context["context"]["namespace"] = namespace
    config["clusters"].append(
        {
            "name": "nowhere",
            "cluster": {"server": "https://127.0.0.1:9", "insecure-skip-tls-verify": True},
        }
    )
    config["contexts"].append(
        {"name": "elsewhere", "context": {"cluster": "nowhere", "user": context["context"]["user"]}}
    )
    config["current-context"] = "elsewhere"
    path.write_text(yaml.safe_dump(config))
    return str(real)


def test_json_and_yaml_output_and_the_context_flag(
    operator: OperatorProcess, crs: Custom, namespace: str, cluster: LocalCluster, tmp_path: Path
) -> None:
    crs.create(sim_worker("w"))
    ready_workers(crs, 1, operator)
    for i in range(2):
        crs.create(session(f"s{i}"))
    crs.create(session("lonely", model="nope"))
    wait_for(
        operator,
        lambda: crs.phases("agentsessions") == {"s0": "Bound", "s1": "Bound", "lonely": "Pending"},
        timeout=30,
        what="two Bound, one Pending",
    )

    for fmt, load in (("json", json.loads), ("yaml", yaml.safe_load)):
        result = plugin(cluster, "status", "-n", namespace, "-o", fmt)
        assert result.returncode == 0, result.stderr
        status = load(result.stdout)
        assert status["namespace"] == namespace
        (listed,) = status["workers"]
        assert (listed["name"], listed["phase"], listed["pinnedSessions"]) == ("w", "Ready", 2)
        assert listed["policy"] in (None, "default") and listed["drain"]["state"] is None
        assert status["sessions"] == {"total": 3, "byPhase": {"Pending": 1, "Bound": 2}}

        result = via_kubectl(cluster, "sessionfleet", "sessions", "-n", namespace, "-o", fmt)
        assert result.returncode == 0, result.stderr
        sessions = {s["id"]: s for s in load(result.stdout)}
        assert set(sessions) == {"id-s0", "id-s1", "id-lonely"}
        assert sessions["id-s0"]["worker"] == "w" and sessions["id-s0"]["phase"] == "Bound"
        assert sessions["id-lonely"] | {"ageSeconds": 0, "createdAt": ""} == {
            "namespace": namespace,
            "name": "lonely",
            "id": "id-lonely",
            "model": "nope",
            "phase": "Pending",
            "worker": None,
            "turns": 0,
            "contextTokens": 0,
            "hitRatePercent": None,
            "createdAt": "",
            "ageSeconds": 0,
        }

        result = plugin(cluster, "explain", "session", "id-lonely", "-n", namespace, "-o", fmt)
        assert result.returncode == 0, result.stderr
        explained = load(result.stdout)
        assert (explained["phase"], explained["ready"]["reason"]) == ("Pending", "NoReadyWorker")
        assert explained["placementNow"]["worker"] is None
        assert isinstance(explained["events"], list)

    # --context picks the cluster's context of a kubeconfig whose current context points
    # where nothing listens; the context's namespace is the default for -n.
    config = tmp_path / "kubeconfig"
    context = kubeconfig_elsewhere(cluster, namespace, config)
    plain = [str(PLUGIN), f"--kubeconfig={config}"]
    astray = subprocess.run(
        [*plain, "status", "-o", "json"], capture_output=True, text=True, timeout=60, check=False
    )
    assert astray.returncode == 1 and "cannot reach the API server at https://127.0.0.1:9" in (
        astray.stderr
    ), astray.stderr
    in_context, listed_there, explained_there = (
        _load_output([*plain, *argv])
        for argv in (
            [f"--context={context}", "status", "-o", "yaml"],
            ["sessions", "--context", context, "-o", "yaml"],
            ["explain", "session", "lonely", "--context", context, "-o", "json"],
        )
    )
    assert in_context["namespace"] == namespace and len(in_context["workers"]) == 1
    assert {s["namespace"] for s in listed_there} == {namespace} and len(listed_there) == 3
    assert (explained_there["namespace"], explained_there["name"]) == (namespace, "lonely")
    unknown = subprocess.run(
        [*plain, "--context=nope", "status"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert unknown.returncode == 1
    assert unknown.stderr.startswith("error: cannot load the Kubernetes configuration"), (
        unknown.stderr
    )


def test_drain_sets_spec_drain_and_the_operator_drains_undrain_clears_it(
    operator: OperatorProcess, crs: Custom, namespace: str, cluster: LocalCluster
) -> None:
    crs.create(drain_policy("hold", mode="Wait", deadline="5m"))
    crs.create(sim_worker("w"))
    ready_workers(crs, 1, operator)
    for i in range(2):
        crs.create(session(f"s{i}", workerPin="w"))
    wait_for(operator, crs.all_in_phase("agentsessions", "Bound", 2), timeout=30, what="Bound")

    dry = plugin(cluster, "drain", "w", "-n", namespace, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "spec.drain would be set to true (dry run)" in dry.stdout
    assert crs.get("inferenceworkers", "w")["spec"].get("drain") is not True

    drained = via_kubectl(cluster, "sessionfleet", "drain", "w", "-n", namespace)
    assert drained.returncode == 0, drained.stderr
    text = drained.stdout
    assert text.splitlines()[0] == f"InferenceWorker {namespace}/w: spec.drain set to true"
    assert "Policy:       DrainPolicy hold (its selector matches the worker's labels)" in text
    assert "Mode:         Wait: Hold the drain until the pinned sessions finish" in text
    assert "Deadline:     5m" in text
    assert "Pinned sessions (2), waited for until they finish, at most 5m:" in text
    assert "id-s0" in text and "id-s1" in text
    assert crs.get("inferenceworkers", "w")["spec"]["drain"] is True

    wait_for(
        operator,
        lambda: (
            condition(crs.status("inferenceworkers", "w"), "Draining").get("reason")
            == "SessionsPinned"
        ),
        timeout=30,
        what="the worker Draining with its sessions pinned",
    )
    status = plugin(cluster, "status", "-n", namespace)
    assert status.returncode == 0, status.stderr
    cells = row(status.stdout, "w")  # the deadline cell, "in 4m58s", is two words here
    assert cells[2] == "Draining" and cells[4] == "2"
    assert cells[-4:-1] == ["hold", "SessionsPinned", "in"]
    assert re.fullmatch(r"[45]m(\d+s)?", cells[-1]), cells
    assert "Drains:     1 in progress" in status.stdout
    assert "triggered by DrainRequested under DrainPolicy hold" in status.stdout

    undrained = plugin(cluster, "undrain", "w", "-n", namespace)
    assert undrained.returncode == 0, undrained.stderr
    assert "spec.drain set to false" in undrained.stdout
    assert "the drain stops" in undrained.stdout
    assert crs.get("inferenceworkers", "w")["spec"]["drain"] is False
    wait_for(
        operator,
        lambda: crs.status("inferenceworkers", "w").get("phase") == "Ready",
        timeout=30,
        what="the worker Ready again",
    )
    assert set(bound_to(crs).values()) == {"w"}

    ghost = plugin(cluster, "drain", "ghost", "-n", namespace)
    assert ghost.returncode == 1 and ghost.stdout == ""
    assert ghost.stderr == f'error: InferenceWorker "ghost" not found in namespace "{namespace}"\n'


def test_explain_says_why_a_session_is_pending(
    operator: OperatorProcess, crs: Custom, namespace: str, cluster: LocalCluster
) -> None:
    crs.create(sim_worker("w"))
    ready_workers(crs, 1, operator)
    crs.create(session("lonely", model="nope"))
    wait_for(
        operator,
        lambda: (
            condition(crs.status("agentsessions", "lonely"), "Ready").get("reason")
            == "NoReadyWorker"
        ),
        timeout=30,
        what="the session Pending for want of a worker",
    )

    for result in (
        via_kubectl(cluster, "sessionfleet", "explain", "session", "id-lonely", "-n", namespace),
        plugin(cluster, "explain", "session", "lonely", "-n", namespace),
    ):
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert "Session:     id-lonely" in lines
        assert "Phase:       Pending" in lines
        assert "Why:         not bound: NoReadyWorker: no Ready worker serves nope" in lines
        assert (
            f"Workers:     no worker in {namespace} serves nope; the workers here serve m" in lines
        )
        assert any(line.split()[:3] == ["Ready", "False", "NoReadyWorker"] for line in lines)
        events = result.stdout.split("\nEvents:\n")[1]
        assert events.strip() == "no events" or events.splitlines()[0].split()[0] == "TYPE"

    unknown = plugin(cluster, "explain", "session", "nobody", "-n", namespace)
    assert unknown.returncode == 1
    assert f'AgentSession "nobody" not found in namespace "{namespace}"' in unknown.stderr


def checkpointed_worker(name: str, storage: Path, driver: str = "engine") -> dict[str, Any]:
    return sim_worker(name, checkpoint={"driver": driver, "storage": {"path": str(storage)}})


def test_checkpoint_waits_for_success_and_a_failure_exits_1(
    operator: OperatorProcess, crs: Custom, namespace: str, cluster: LocalCluster, tmp_path: Path
) -> None:
    crs.create(checkpointed_worker("cw", tmp_path))
    crs.create(checkpointed_worker("none", tmp_path, driver="none"))
    ready_workers(crs, 2, operator)
    # One turn straight to the engine, so that the checkpoint holds a session.
    endpoint = crs.status("inferenceworkers", "cw")["endpoint"]
    httpx.post(
        f"{endpoint}/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hello " * 200}]},
        headers={"X-Sessionfleet-Session-Id": "sid-1"},
        timeout=30,
    ).raise_for_status()

    taken = via_kubectl(
        cluster, "sessionfleet", "checkpoint", "cw", "-n", namespace, "--timeout", "60s"
    )
    assert taken.returncode == 0, taken.stdout + taken.stderr
    lines = taken.stdout.splitlines()
    match = re.fullmatch(
        rf"WorkerCheckpoint {namespace}/(cw-manual-\w+) created for worker cw \(reason Manual\)",
        lines[0],
    )
    assert match, lines[0]
    name = match.group(1)
    phases = [line.split()[1] for line in lines[1:] if re.match(r"\s*\d+\.\d+s\s+\w+$", line)]
    assert phases[0] == "Pending" and phases[-1] == "Succeeded"
    assert f"location: {tmp_path}/{namespace}/cw/{name}" in lines
    assert ", 1 session(s), " in taken.stdout
    saved = crs.get("workercheckpoints", name)
    assert saved["spec"]["reason"] == "Manual" and saved["status"]["phase"] == "Succeeded"

    refused = plugin(cluster, "checkpoint", "none", "-n", namespace, "--timeout", "60s")
    assert refused.returncode == 1
    assert "failed: DriverUnsupported: driver none cannot checkpoint here" in refused.stdout

    ghost = plugin(cluster, "checkpoint", "ghost", "-n", namespace)
    assert ghost.returncode == 1 and "not found" in ghost.stderr
    assert len(crs.list("workercheckpoints")) == 2  # none was created for ghost
