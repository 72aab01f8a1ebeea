"""The fault-injection primitives for chaos tests, against a control plane of their own.

These tests kill, restart, pause and compact parts of a control plane, so they never
use the shared ``cluster`` fixture (other tests run against it in parallel): the
tests use ``private_cluster`` (e2e/conftest.py): a control plane of the pytest worker's
own, shared with the chaos suite's control-plane cases.

What they pin down, besides the primitives themselves (measured on kube-apiserver
v1.36.3, etcd v3.6.8):

- Watches of resources with a watch cache (everything but Events) are served from the
  cache's own window of events: compacting etcd does not expire them. A watch from a
  resourceVersion older than the cache's window gets 410 ("too old resource version:
  OLD (OLDEST)"); the window starts afresh when the API server restarts.
- Events have no watch cache (``DefaultWatchCacheSizes``), so their watches and lists
  go to etcd and get 410 right after a compaction ("The resourceVersion for the
  provided watch is too old.").
- ``resourceVersionMatch=Exact`` lists of cached resources are served from the
  cache's snapshots until the API server learns of the compaction from
  ``compact_rev_key`` (polled every 15 s), then fall through to etcd: 410.
"""

from __future__ import annotations

import contextlib
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from e2e.faultproxy import FaultProxy, proxied_kubeconfig
from e2e.helpers import CUT_CONNECTIONS_LEAK, gpu_pod, wait_until
from e2e.localcluster import LocalCluster

pytestmark = [pytest.mark.timeout(180), CUT_CONNECTIONS_LEAK]


def _api(kubeconfig: Path) -> Any:
    return config.new_client_from_config(config_file=str(kubeconfig))  # type: ignore[no-untyped-call]


@pytest.fixture
def core(private_cluster: LocalCluster) -> Iterator[Any]:
    """``CoreV1Api`` of the private cluster; a fresh connection pool per test."""
    api = _api(private_cluster.kubeconfig)
    yield client.CoreV1Api(api)
    api.close()


def _namespace(core: Any, prefix: str) -> str:
    """A new namespace, once the controllers made what they make in every namespace.

    Its ``default`` ServiceAccount (pods need it) and the ``kube-root-ca.crt``
    ConfigMap, which would otherwise land among a test's own ConfigMaps' events.
    """
    name = f"fi-{prefix}-{secrets.token_hex(3)}"
    core.create_namespace({"metadata": {"name": name}})
    wait_until(  # a 404 is retried until the service-account controller made it
        lambda: core.read_namespaced_service_account("default", name),
        timeout=30,
        what=f"ServiceAccount {name}/default",
    )
    wait_until(
        lambda: core.read_namespaced_config_map("kube-root-ca.crt", name),
        timeout=30,
        what=f"ConfigMap {name}/kube-root-ca.crt",
    )
    return name


def _config_map(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "data": {"name": name}}


def _event(namespace: str, name: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "involvedObject": {"kind": "ConfigMap", "name": name, "namespace": namespace},
        "reason": "FaultInjection",
        "message": name,
    }


def _first_event(list_call: Callable[..., Any], namespace: str, resource_version: str) -> Any:
    """The first event of a watch from ``resource_version``, or None within 3 s.

    Raises:
        ApiException: the watch's ERROR event (410 for an expired version).
    """
    watcher = watch.Watch()  # type: ignore[no-untyped-call]
    for event in watcher.stream(  # type: ignore[no-untyped-call]
        list_call, namespace, resource_version=resource_version, timeout_seconds=3
    ):
        watcher.stop()  # type: ignore[no-untyped-call]
        return event
    return None


def test_a_restarted_api_server_serves_what_was_stored_and_a_fresh_watch_cache(
    private_cluster: LocalCluster, core: Any
) -> None:
    namespace = _namespace(core, "restart")
    before = core.create_namespaced_config_map(namespace, _config_map("before"))
    old_version = before.metadata.resource_version
    core.create_namespaced_config_map(namespace, _config_map("later"))
    # Served from the watch cache's window, which began before these objects.
    assert _first_event(core.list_namespaced_config_map, namespace, old_version) is not None

    started = time.monotonic()
    private_cluster.restart("kube-apiserver")
    elapsed = time.monotonic() - started
    print(f"kube-apiserver restart (SIGTERM, 10 s grace, start) to /readyz: {elapsed:.1f} s")

    assert private_cluster.kubectl("get", "--raw", "/readyz").stdout == "ok"
    assert all(private_cluster.health().values()), private_cluster.health()
    api = _api(private_cluster.kubeconfig)
    try:
        fresh: Any = client.CoreV1Api(api)
        assert fresh.read_namespaced_config_map("before", namespace).data == {"name": "before"}
        # The new API server's watch cache starts at the current revision: a watch from
        # an older one is refused by the cache itself, although etcd was not compacted.
        with pytest.raises(ApiException) as expired:
            _first_event(fresh.list_namespaced_config_map, namespace, old_version)
        assert expired.value.status == 410
        assert "too old resource version" in str(expired.value.reason)
        # An Exact list at that version falls through to etcd, which still has it.
        listed = fresh.list_namespaced_config_map(
            namespace, resource_version=old_version, resource_version_match="Exact"
        )
        assert {item.metadata.name for item in listed.items} == {"before", "kube-root-ca.crt"}
    finally:
        api.close()


def test_writes_wait_for_a_paused_etcd_and_go_through_once_it_resumes(
    private_cluster: LocalCluster, core: Any
) -> None:
    namespace = _namespace(core, "pause")
    with private_cluster.paused("etcd"):
        assert private_cluster.is_paused("etcd")
        started = time.monotonic()
        with pytest.raises((ApiException, urllib3.exceptions.HTTPError)):
            core.create_namespaced_config_map(
                namespace, _config_map("while-paused"), _request_timeout=3
            )
        # It waited for etcd rather than failing fast.
        assert time.monotonic() - started >= 2.5
    assert not private_cluster.is_paused("etcd")
    core.create_namespaced_config_map(namespace, _config_map("after"), _request_timeout=30)

    # Resumed by the timer while the block still runs: the write just takes longer.
    with private_cluster.paused("etcd", seconds=2):
        started = time.monotonic()
        core.create_namespaced_config_map(namespace, _config_map("timed"), _request_timeout=30)
        waited = time.monotonic() - started
    assert waited >= 1.5, waited

    # A failing test inside the block leaves no stopped etcd behind.
    with pytest.raises(RuntimeError), private_cluster.paused("etcd"):
        raise RuntimeError("a failure while etcd is paused")
    assert not private_cluster.is_paused("etcd")
    core.read_namespaced_config_map("timed", namespace, _request_timeout=30)


def test_compaction_expires_old_versions_in_etcd_but_not_in_the_watch_cache(
    private_cluster: LocalCluster, core: Any
) -> None:
    namespace = _namespace(core, "compact")
    old_config_map = core.create_namespaced_config_map(namespace, _config_map("old"))
    old_event = core.create_namespaced_event(namespace, _event(namespace, "old"))
    for index in range(3):
        core.create_namespaced_config_map(namespace, _config_map(f"new-{index}"))
        core.create_namespaced_event(namespace, _event(namespace, f"new-{index}"))
    old_cm_version = old_config_map.metadata.resource_version
    old_event_version = old_event.metadata.resource_version
    assert _first_event(core.list_namespaced_event, namespace, old_event_version) is not None

    revision = private_cluster.compact_etcd()
    compacted_at = time.monotonic()
    # A watch from V starts at V + 1, which must be older than the compaction.
    assert revision > int(old_event_version) + 1
    assert private_cluster.etcd_revision() >= revision

    # Events have no watch cache: their watches and lists go to etcd, which refuses.
    with pytest.raises(ApiException) as watch_expired:
        _first_event(core.list_namespaced_event, namespace, old_event_version)
    assert watch_expired.value.status == 410
    assert "The resourceVersion for the provided watch is too old" in str(
        watch_expired.value.reason
    )
    with pytest.raises(ApiException) as list_expired:
        core.list_namespaced_event(
            namespace, resource_version=old_event_version, resource_version_match="Exact"
        )
    assert list_expired.value.status == 410

    # ConfigMaps are watched from the watch cache, whose window the compaction does
    # not touch: the watch replays what came after the old version.
    event = _first_event(core.list_namespaced_config_map, namespace, old_cm_version)
    assert event is not None and event["object"].metadata.name == "new-0"

    # Exact lists come from the cache's snapshots until the API server reads the
    # compaction from compact_rev_key (15 s poll), then from etcd: 410.
    def exact_list_status() -> int:
        try:
            core.list_namespaced_config_map(
                namespace, resource_version=old_cm_version, resource_version_match="Exact"
            )
        except ApiException as error:
            return int(error.status)
        return 200

    wait_until(lambda: exact_list_status() == 410, timeout=40, what="Exact list at 410", interval=1)
    print(f"Exact list of ConfigMaps 410 after {time.monotonic() - compacted_at:.1f} s")
    # The watch cache still serves the old version to watches.
    assert _first_event(core.list_namespaced_config_map, namespace, old_cm_version) is not None
    # Compacting again with nothing new to compact is no error.
    assert private_cluster.compact_etcd() >= revision


def test_a_cut_interrupts_a_watch_through_the_proxy_and_a_new_one_connects(
    private_cluster: LocalCluster, tmp_path: Path
) -> None:
    with FaultProxy.for_url(private_cluster.api_server) as proxy:
        kubeconfig = proxied_kubeconfig(private_cluster.kubeconfig, proxy, tmp_path / "kc")
        api = _api(kubeconfig)
        try:
            core: Any = client.CoreV1Api(api)
            # Through the proxy, with the API server's certificate verified.
            namespace = _namespace(core, "proxy")
            version = core.list_namespaced_config_map(namespace).metadata.resource_version
            outcomes: queue.Queue[tuple[str, Any]] = queue.Queue()
            first = _watch_in_thread(core, namespace, version, outcomes)
            core.create_namespaced_config_map(namespace, _config_map("first"))
            assert outcomes.get(timeout=10) == ("event", "first")

            accepted = proxy.accepted
            assert proxy.cut() >= 1
            kind, detail = outcomes.get(timeout=10)
            assert kind in ("error", "ended"), (kind, detail)
            first.join(timeout=10)
            assert proxy.connections == 0

            after = core.read_namespaced_config_map("first", namespace).metadata.resource_version
            second = _watch_in_thread(core, namespace, after, outcomes)
            proxy.wait_for_connections(1)
            core.create_namespaced_config_map(namespace, _config_map("second"))
            assert outcomes.get(timeout=10) == ("event", "second")
            assert proxy.accepted > accepted
            proxy.cut()
            second.join(timeout=10)
        finally:
            api.close()


def _watch_in_thread(
    core: Any, namespace: str, version: str, outcomes: queue.Queue[tuple[str, Any]]
) -> threading.Thread:
    """Watch ConfigMaps from ``version`` in a thread, reporting to ``outcomes``."""

    def run() -> None:
        try:
            for event in watch.Watch().stream(  # type: ignore[no-untyped-call]
                core.list_namespaced_config_map,
                namespace,
                resource_version=version,
                timeout_seconds=60,
            ):
                outcomes.put(("event", event["object"].metadata.name))
            outcomes.put(("ended", None))
        except Exception as error:
            outcomes.put(("error", repr(error)))

    thread = threading.Thread(target=run, name="watch", daemon=True)
    thread.start()
    return thread


def test_pods_wait_for_a_killed_kwok_and_run_once_it_is_back(
    private_cluster: LocalCluster, core: Any
) -> None:
    namespace = _namespace(core, "kwok")
    private_cluster.kill("kwok")
    assert private_cluster.health()["kwok"] is False
    private_cluster.kill("kwok")  # already gone: nothing to do
    core.create_namespaced_pod(namespace, gpu_pod("waits", gpus=1))

    def scheduled() -> Any:
        pod = core.read_namespaced_pod("waits", namespace)
        return pod if pod.spec.node_name else None

    pod = wait_until(scheduled, timeout=30, what="pod waits scheduled")
    assert pod.status.phase == "Pending"  # nothing plays the kubelet

    private_cluster.restart("kwok")
    assert private_cluster.health()["kwok"] is True
    wait_until(
        lambda: core.read_namespaced_pod("waits", namespace).status.phase == "Running",
        timeout=30,
        what="pod waits Running after KWOK is back",
    )


def test_a_cluster_found_through_its_state_dir_restarts_and_pauses_the_same_processes(
    private_cluster: LocalCluster,
) -> None:
    other = LocalCluster.from_state_dir(private_cluster.state_dir)
    old_pid = _pid(private_cluster, "kube-scheduler")
    other.restart("kube-scheduler")
    # The owner reads the new record from the state file: it will stop the new process.
    assert _pid(private_cluster, "kube-scheduler") != old_pid
    assert private_cluster.health()["kube-scheduler"] is True
    with other.paused("kube-controller-manager"):
        assert private_cluster.is_paused("kube-controller-manager")
    assert not private_cluster.is_paused("kube-controller-manager")
    attached = LocalCluster.attach(private_cluster.kubeconfig)
    assert attached.etcd_revision() >= private_cluster.etcd_revision() - 10
    with pytest.raises(Exception, match="no component 'etcd2'"):
        attached.kill("etcd2")


def _pid(cluster: LocalCluster, component: str) -> int:
    cluster.health()  # re-reads the state file
    assert cluster.state is not None
    return next(record.pid for record in cluster.state.processes if record.name == component)


# --- the proxy on its own, against a local echo server (no cluster) ---


@pytest.fixture
def echo_server() -> Iterator[tuple[str, int]]:
    server = socket.create_server(("127.0.0.1", 0))
    stopping = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            while data := conn.recv(4096):
                conn.sendall(data)

    def accept() -> None:
        while not stopping.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[:2]
    stopping.set()
    server.close()
    thread.join(timeout=5)


def _roundtrip(address: tuple[str, int], payload: bytes) -> bytes:
    with socket.create_connection(address, timeout=5) as conn:
        conn.sendall(payload)
        return conn.recv(4096)


def test_the_proxy_forwards_cuts_and_refuses_connections(echo_server: tuple[str, int]) -> None:
    with FaultProxy(*echo_server) as proxy:
        assert _roundtrip(proxy.address, b"hello") == b"hello"
        held = [socket.create_connection(proxy.address, timeout=5) for _ in range(2)]
        for conn in held:
            conn.sendall(b"x")
            assert conn.recv(10) == b"x"
        assert proxy.wait_for_connections(2) == 2
        assert proxy.cut() == 2
        for conn in held:
            assert conn.recv(10) == b""  # closed by the proxy
            conn.close()
        wait_until(lambda: proxy.connections == 0, timeout=5, what="no connections")
        assert _roundtrip(proxy.address, b"again") == b"again"  # still accepting

        with proxy.blocked():
            with socket.create_connection(proxy.address, timeout=5) as refused:
                with contextlib.suppress(OSError):
                    refused.sendall(b"lost")
                try:
                    reply = refused.recv(10)
                except ConnectionResetError:
                    reply = b""
                assert reply == b""
            assert proxy.refused == 1
        assert not proxy.is_blocked
        assert _roundtrip(proxy.address, b"back") == b"back"
        assert proxy.accepted == 6
