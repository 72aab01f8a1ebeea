"""Chaos of the control plane itself — the API server, etcd, expiring watches — under load.

Each case runs a drain with two operator replicas, a router and sessions sending turns
without pause (:mod:`e2e.chaos`), breaks the control plane mid-drain, and checks that
every binding survives, no pod is duplicated, holds stay up while sessions are pinned,
every session ends Bound or Finished and the router answered every turn.

These faults break every client of a cluster, so the module runs on a control plane
of the pytest worker's own (``private_cluster``, e2e/conftest.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from e2e.chaos import Scene
from e2e.helpers import CUT_CONNECTIONS_LEAK, wait_until
from e2e.localcluster import LocalCluster

pytestmark = [pytest.mark.timeout(300), CUT_CONNECTIONS_LEAK]

WAIT = {"mode": "Wait", "deadline": "10m"}


@pytest.fixture
def scene_of(
    private_cluster: LocalCluster, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Any]:
    """Make the test's scene in a fresh namespace of the chaos cluster; close it after."""
    made: list[Scene] = []
    api = private_cluster.api_client()
    core = client.CoreV1Api(api)
    namespace = f"chaos-{request.node.name[5:30].replace('_', '-')}".rstrip("-")
    core.create_namespace({"metadata": {"name": namespace}})
    wait_until(
        lambda: core.read_namespaced_service_account("default", namespace),
        timeout=30,
        what="the namespace's default ServiceAccount",
    )

    def make(case: str) -> Scene:
        scene = Scene(
            case,
            private_cluster,
            api,
            namespace,
            private_cluster.gpu_nodes,
            tmp_path,
            policy=WAIT,
        )
        made.append(scene)
        return scene

    yield make
    for scene in made:
        scene.close()
    core.delete_namespace(namespace)
    api.close()


def _recovers_and_completes_the_drain(scene: Scene, started_at: str, fault: str) -> None:
    """A leader acts again, every promise held through the fault, the drain completes."""
    scene.leader()
    recovery = scene.recovered()
    figures = scene.verdict(expect_worker="src", recovery_seconds=recovery)
    assert figures["samplesUnreachable"] > 0, f"the {fault} was not seen"
    scene.drain_completes(started_at)


def test_the_api_server_killed_and_restarted_mid_drain(
    private_cluster: LocalCluster, scene_of: Any
) -> None:
    scene: Scene = scene_of("apiserver-restart")
    started_at = scene.draining()
    private_cluster.kill("kube-apiserver")  # SIGKILL: no graceful shutdown; etcd keeps the data
    time.sleep(3)
    private_cluster.restart("kube-apiserver")
    scene.fault_ended = time.monotonic()
    _recovers_and_completes_the_drain(scene, started_at, "outage")


def test_etcd_paused_for_ten_seconds_mid_drain(
    private_cluster: LocalCluster, scene_of: Any
) -> None:
    scene: Scene = scene_of("etcd-paused")
    started_at = scene.draining()
    with private_cluster.paused("etcd", seconds=10):
        time.sleep(10)
    scene.fault_ended = time.monotonic()
    _recovers_and_completes_the_drain(scene, started_at, "pause")


def test_watches_expiring_after_etcd_is_compacted_mid_drain(
    private_cluster: LocalCluster, scene_of: Any
) -> None:
    """Compacting etcd alone expires nothing a client watches: the API server's watch
    cache serves watches from its own window (e2e/README.md). What expires them is
    the cache starting afresh while etcd no longer holds the old versions — after
    the compaction, the API server restarts, and every watch that reconnects from
    its last resourceVersion is answered 410 Gone, and must list again."""
    scene: Scene = scene_of("watches-expire")
    started_at = scene.draining()
    revision = private_cluster.compact_etcd()
    private_cluster.restart("kube-apiserver")
    scene.fault_ended = time.monotonic()
    assert private_cluster.etcd_revision() >= revision
    scene.leader()
    recovery = scene.recovered()
    scene.wait(
        lambda: scene.router is not None and "410 Gone" in scene.router.log_tail(400),
        timeout=30,
        what="the router's watch expired and relisted",
    )
    scene.verdict(expect_worker="src", recovery_seconds=recovery)
    scene.drain_completes(started_at)


def test_operators_started_while_the_api_server_is_down_watch_everything_once_it_is_back(
    private_cluster: LocalCluster, scene_of: Any
) -> None:
    """Kopf looks for the kinds it serves once, when it starts: an operator that starts
    into a down or starting API server waits until discovery lists every kind it
    watches, rather than watching no InferenceWorkers for the rest of its life."""
    scene: Scene = scene_of("started-in-outage")
    started_at = scene.draining()
    private_cluster.kill("kube-apiserver")
    for operator in scene.operators:
        operator.kill()  # both replicas crash while the API server is away
        operator.start()
    scene.wait(
        lambda: all("waiting for the API server" in o.log_tail(20) for o in scene.operators),
        timeout=30,
        what="both replicas waiting for the API server",
    )
    private_cluster.restart("kube-apiserver")
    scene.fault_ended = time.monotonic()
    _recovers_and_completes_the_drain(scene, started_at, "outage")
    for operator in scene.operators:
        assert "serves every kind the operator watches" in operator.log_path.read_text()
