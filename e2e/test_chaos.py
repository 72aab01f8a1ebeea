"""Chaos on the shared cluster: faults of our own processes, under load.

Each case runs a drain or a migration with two operator replicas, a router and
sessions sending turns without pause (:mod:`e2e.chaos`), injects one fault, and checks
that every binding survives, no pod is duplicated, holds stay up while sessions are
pinned, every session ends Bound or Finished and the router answered every turn.
Faults of the control plane itself (the API server, etcd) break every test sharing a
cluster, so they run on a private one: e2e/test_chaos_control_plane.py.
"""

from __future__ import annotations

import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.chaos import Scene
from e2e.faultproxy import FaultProxy, proxied_kubeconfig
from e2e.localcluster import LocalCluster
from e2e.operator import SESSIONFLEET, Process, free_port

pytestmark = pytest.mark.timeout(240)

MIGRATE = {"mode": "Migrate", "deadline": "5m"}
WAIT = {"mode": "Wait", "deadline": "10m"}


@pytest.fixture
def scene_args(
    cluster: LocalCluster, api: Any, namespace: str, own_nodes: list[str], crds_installed: None
) -> dict[str, Any]:
    return {"cluster": cluster, "api": api, "namespace": namespace, "nodes": own_nodes}


@pytest.fixture
def scenes() -> Iterator[list[Scene]]:
    made: list[Scene] = []
    yield made
    for scene in made:
        scene.close()


def migrations_of(scene: Scene) -> dict[str, int]:
    return {
        s["metadata"]["name"]: len((s.get("status") or {}).get("migrations") or [])
        for s in scene.crs.list("agentsessions")
        if s["metadata"]["name"] in scene.session_names.values()
    }


def test_the_leader_killed_mid_migration_the_standby_completes_it(
    scene_args: dict[str, Any], scenes: list[Scene], tmp_path: Path
) -> None:
    scene = Scene("leader-killed-mid-migration", **scene_args, logs=tmp_path, policy=MIGRATE)
    scenes.append(scene)
    leader = scene.leader()
    standby = next(o for o in scene.operators if o is not leader)
    scene.drain()
    scene.wait(
        lambda: "Migrating" in scene.phases().values() or "dst" in scene.bindings().values(),
        timeout=60,
        what="the migration under way",
    )
    leader.kill()
    scene.fault_ended = time.monotonic()
    assert scene.leader() is standby
    scene.wait(
        lambda: (
            set(scene.bindings().values()) == {"dst"} and set(scene.phases().values()) == {"Bound"}
        ),
        timeout=90,
        what="every session moved to dst by the new leader",
    )
    recovery = scene.recovered()
    scene.verdict(expect_worker="dst", recovery_seconds=recovery)
    # Moved once each: nobody bound a session twice.
    assert set(migrations_of(scene).values()) == {1}, migrations_of(scene)
    assert scene.crs.status("inferenceworkers", "src")["phase"] == "Drained"


def test_both_replicas_killed_mid_drain_and_started_again(
    scene_args: dict[str, Any], scenes: list[Scene], tmp_path: Path
) -> None:
    scene = Scene("both-replicas-killed", **scene_args, logs=tmp_path, policy=WAIT)
    scenes.append(scene)
    started_at = scene.draining()
    for operator in scene.operators:
        operator.kill()
    time.sleep(5)  # nobody leads: the hold is an object, the router routes on its own
    for operator in scene.operators:
        operator.start()
    scene.fault_ended = time.monotonic()
    scene.leader()
    recovery = scene.recovered()
    figures = scene.verdict(expect_worker="src", recovery_seconds=recovery)
    assert figures["servedBy"].keys() == {"src"}
    scene.drain_completes(started_at)


def test_a_routers_watch_cut_while_it_serves_turns_of_a_migration(
    cluster: LocalCluster, scene_args: dict[str, Any], scenes: list[Scene], tmp_path: Path
) -> None:
    with FaultProxy.for_url(cluster.api_server) as proxy:
        kubeconfig = proxied_kubeconfig(cluster.kubeconfig, proxy, tmp_path / "router.kubeconfig")
        scene = Scene(
            "router-watch-cut",
            **scene_args,
            logs=tmp_path,
            policy=MIGRATE,
            router_kubeconfig=kubeconfig,
        )
        scenes.append(scene)
        scene.drain()
        cuts = 0
        deadline = time.monotonic() + 12
        while time.monotonic() < deadline:  # cut through the whole handshake
            cuts += proxy.cut()
            time.sleep(1.5)
        scene.fault_ended = time.monotonic()
        assert cuts > 0
        scene.wait(
            lambda: (
                set(scene.bindings().values()) == {"dst"}
                and set(scene.phases().values()) == {"Bound"}
            ),
            timeout=90,
            what="every session moved to dst",
        )
        recovery = scene.recovered()
        figures = scene.verdict(expect_worker="dst", recovery_seconds=recovery)
        figures["connectionsCut"] = cuts
        # The router relisted and follows the bindings: its last turns went to dst.
        assert figures["servedBy"].get("dst", 0) > 0
        assert set(migrations_of(scene).values()) == {1}


def test_the_node_agent_killed_during_a_checkpoint(
    cluster: LocalCluster, scene_args: dict[str, Any], scenes: list[Scene], tmp_path: Path
) -> None:
    """A real ``sessionfleet agent`` serves the node; the criu driver's request is in
    flight (the agent is stopped) when the agent is killed. On this machine the agent
    could not checkpoint anyway (no GPU, no CRIU): the test is that the operator marks
    the checkpoint Failed, keeps every session bound and served, and goes on."""
    token = tmp_path / "agent-token"
    token.write_text(secrets.token_hex(16))
    port = free_port()
    agent_argv = [
        str(SESSIONFLEET),
        "agent",
        "--host=127.0.0.1",
        f"--port={port}",
        f"--token-file={token}",
        f"--storage-root={tmp_path / 'checkpoints'}",
    ]
    (tmp_path / "checkpoints").mkdir()
    agent = Process(agent_argv, tmp_path / "agent.log")
    agent.wait_http(f"https://127.0.0.1:{port}/healthz")
    try:
        scene = Scene(
            "node-agent-killed",
            **scene_args,
            logs=tmp_path,
            policy=WAIT,
            operator_args=(f"--agent-token-file={token}", f"--agent-port={port}"),
            worker_spec={
                "checkpoint": {"driver": "criu", "storage": {"path": str(tmp_path / "checkpoints")}}
            },
        )
        scenes.append(scene)
        agent.popen.send_signal(signal.SIGSTOP)
        scene.crs.create(
            {
                "apiVersion": "sessionfleet.dev/v1alpha1",
                "kind": "WorkerCheckpoint",
                "metadata": {"name": "by-hand"},
                "spec": {"worker": "src"},
            }
        )
        scene.wait(
            lambda: scene.crs.status("workercheckpoints", "by-hand").get("phase") == "Running",
            timeout=30,
            what="the checkpoint running",
        )
        agent.popen.send_signal(signal.SIGKILL)
        agent.popen.wait(timeout=10)
        scene.fault_ended = time.monotonic()
        failed = scene.wait(
            lambda: (
                (s := scene.crs.status("workercheckpoints", "by-hand")).get("phase") == "Failed"
                and s
            ),
            timeout=60,
            what="the checkpoint Failed",
        )
        # Failed because its agent went away, not for want of a GPU: it was in flight.
        assert "unreachable" in failed["error"], failed
        recovery = scene.recovered()
        scene.verdict(expect_worker="src", recovery_seconds=recovery)
        assert scene.crs.status("inferenceworkers", "src")["phase"] == "Ready"

        # The agent comes back; the next checkpoint is tried, and refused for a reason
        # of this machine's (no GPU, no CRIU), with nothing left Running.
        agent = Process(agent_argv, tmp_path / "agent.log")
        agent.wait_http(f"https://127.0.0.1:{port}/healthz")
        scene.crs.create(
            {
                "apiVersion": "sessionfleet.dev/v1alpha1",
                "kind": "WorkerCheckpoint",
                "metadata": {"name": "after"},
                "spec": {"worker": "src"},
            }
        )
        again = scene.wait(
            lambda: (
                (s := scene.crs.status("workercheckpoints", "after")).get("phase")
                in ("Failed", "Succeeded")
                and s
            ),
            timeout=60,
            what="the next checkpoint ended",
        )
        assert "unreachable" not in again.get("error", ""), again
    finally:
        if agent.popen.poll() is None:
            agent.popen.kill()
            agent.popen.wait(timeout=10)
