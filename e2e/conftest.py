"""Fixtures of the e2e suite: one real control plane per run, a namespace per test.

The cluster comes from ``SESSIONFLEET_E2E_KUBECONFIG`` when it is set (``make
test-e2e`` starts one cluster for all pytest-xdist workers), otherwise each pytest
process starts its own and stops it at the end of the session.
"""

from __future__ import annotations

import gc
import os
import re
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.helpers import CRDS_DIR, Kubectl, wait_established, wait_until
from e2e.localcluster import (
    ENV_KUBECONFIG,
    LocalCluster,
    ToolsMissingError,
    find_tools,
    gpu_node_manifest,
)
from e2e.operator import CHART_ELECTION_ARGS, Custom, OperatorProcess


@pytest.fixture(autouse=True)
def _leaks_fail_the_test_that_made_them() -> Iterator[None]:
    """Collect garbage after each test, so that a socket or file left open fails it.

    Warnings are errors here; without this, an unclosed client is found whenever the
    collector happens to run, and fails whichever test is running then (CI once failed
    a router test for a client a chart test on another cluster had not closed).
    """
    yield
    gc.collect()


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    """The control plane: reused from ``SESSIONFLEET_E2E_KUBECONFIG`` or started here."""
    shared = os.environ.get(ENV_KUBECONFIG)
    if shared:
        yield LocalCluster.attach(Path(shared))
        return
    try:
        find_tools()
    except ToolsMissingError as error:
        pytest.fail(str(error), pytrace=False)
    started = LocalCluster.start()
    try:
        yield started
    finally:
        failed = request.session.testsfailed > 0
        # Keep the logs of a failing run; they are what explains it.
        started.stop(remove_state=False if failed else None)
        if failed:
            print(f"\ne2e cluster logs kept in {started.layout.logs}", file=sys.stderr)


@pytest.fixture
def fresh_cluster() -> Iterator[LocalCluster]:
    """A cluster of this test alone, one GPU node, with no sessionfleet CRDs in it."""
    started = LocalCluster.start(gpu_nodes=1)
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="session")
def private_cluster(request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    """A control plane of this pytest worker's own, for tests that break one.

    Killing the API server, pausing etcd or compacting it breaks every client of a
    cluster, so those tests never use the shared ``cluster``. Started on first use
    (about 9 s, 600 MB), with two GPU nodes and the CRDs; one per xdist worker that runs
    such a test, whatever the distribution of tests over workers.
    """
    try:
        find_tools()
    except ToolsMissingError as error:
        pytest.fail(str(error), pytrace=False)
    started = LocalCluster.start(gpu_nodes=2)
    try:
        started.kubectl("apply", "--server-side", "-f", str(CRDS_DIR))
        wait_established(started.kubectl)
        yield started
    finally:
        failed = request.session.testsfailed > 0
        started.stop(remove_state=False if failed else None)
        if failed:
            print(f"\nprivate cluster logs kept in {started.layout.logs}", file=sys.stderr)


@pytest.fixture(scope="session")
def api(cluster: LocalCluster) -> Iterator[Any]:
    """A ``kubernetes.client.ApiClient`` with the admin credential."""
    api_client = cluster.api_client()
    yield api_client
    api_client.close()


@pytest.fixture(scope="session")
def core(api: Any) -> Any:
    """``CoreV1Api``."""
    return client.CoreV1Api(api)


@pytest.fixture(scope="session")
def custom(api: Any) -> Any:
    """``CustomObjectsApi``."""
    return client.CustomObjectsApi(api)


@pytest.fixture(scope="session")
def kubectl(cluster: LocalCluster) -> Kubectl:
    """Run the pinned kubectl against the cluster: ``kubectl("get", "pods", check=False)``."""
    return cluster.kubectl


def _namespace_name(test_name: str) -> str:
    """A valid, unique namespace name derived from the test's name."""
    base = re.sub(r"[^a-z0-9-]+", "-", test_name.lower()).strip("-")[:40].strip("-")
    return f"e2e-{base}-{secrets.token_hex(3)}"


@pytest.fixture
def namespace(core: Any, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace for one test, ready for pods; deleted afterwards."""
    name = _namespace_name(request.node.name)
    core.create_namespace({"metadata": {"name": name, "labels": {"e2e.sessionfleet.dev": "true"}}})

    # The ServiceAccount admission plugin rejects pods until the service-account
    # controller has created `default` in the namespace (a few seconds).
    def default_service_account() -> bool:
        try:
            core.read_namespaced_service_account("default", name)
        except ApiException as error:
            if error.status == 404:
                return False
            raise
        return True

    wait_until(default_service_account, timeout=30, what=f"ServiceAccount {name}/default")
    yield name
    try:
        core.delete_namespace(name)
    except ApiException as error:
        if error.status != 404:
            raise


# --- the operator and its objects, for the tests of the operator and of checkpoints ---


@pytest.fixture(scope="session")
def crds_installed(kubectl: Kubectl) -> None:
    """The sessionfleet CRDs, applied and Established (idempotent across workers)."""
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRDS_DIR))
    wait_established(kubectl, "-l", "app.kubernetes.io/part-of=sessionfleet")


@pytest.fixture
def operator(
    cluster: LocalCluster, namespace: str, crds_installed: None, tmp_path: Path
) -> Iterator[OperatorProcess]:
    """A running operator for the test's namespace; its log is shown when a test fails."""
    process = OperatorProcess(cluster.kubeconfig, namespace, tmp_path)
    process.start()
    yield process
    process.stop()


@pytest.fixture
def steady_operator(
    cluster: LocalCluster, namespace: str, crds_installed: None, tmp_path: Path
) -> Iterator[OperatorProcess]:
    """``operator`` with the chart's Lease timings (``CHART_ELECTION_ARGS``)."""
    process = OperatorProcess(cluster.kubeconfig, namespace, tmp_path, *CHART_ELECTION_ARGS)
    process.start()
    yield process
    process.stop()


@pytest.fixture
def crs(api: Any, namespace: str) -> Custom:
    """Custom resources of the test's namespace."""
    return Custom(client.CustomObjectsApi(api), namespace)


@pytest.fixture
def own_nodes(core: Any, namespace: str) -> Iterator[list[str]]:
    """Two fake GPU nodes only this test's workers may use (a taint keeps others off)."""
    yield from _own_nodes(core, namespace, 2)


@pytest.fixture
def three_own_nodes(core: Any, namespace: str) -> Iterator[list[str]]:
    """Three such nodes, for tests that break most of a fleet's nodes at once."""
    yield from _own_nodes(core, namespace, 3)


def _own_nodes(core: Any, namespace: str, count: int) -> Iterator[list[str]]:
    names = [f"{namespace}-n{i}"[:63] for i in range(count)]
    for name in names:
        node = gpu_node_manifest(name, 4)
        node["metadata"]["labels"]["e2e.sessionfleet.dev/pool"] = namespace
        node["spec"]["taints"].append(
            {"key": "e2e.sessionfleet.dev/pool", "value": namespace, "effect": "NoSchedule"}
        )
        core.create_node(node)
    yield names
    for name in names:
        try:
            core.delete_node(name)
        except ApiException as error:
            if error.status != 404:
                raise
