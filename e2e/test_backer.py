"""The pod backer: real processes behind KWOK pods, at their pod IPs."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.helpers import gpu_pod, wait_until
from e2e.localcluster import KWOK_CUSTOM_STATUS_ANNOTATION, LocalCluster, container_id_pid

pytestmark = pytest.mark.timeout(90)

HTTP_PORT = 8000
_LOOP_SECONDS = 1.0
"""Longer than the backer takes to notice an exited process (it looks every 0.1 s)."""


def _http_server_pod(name: str) -> dict[str, Any]:
    """A backed pod running Python's HTTP server on its pod IP, with a readiness probe."""
    return gpu_pod(
        name,
        backed=True,
        command=["python3", "-m", "http.server"],
        args=["--bind", "$(POD_IP)", str(HTTP_PORT)],
        extra_container={
            "ports": [{"name": "http", "containerPort": HTTP_PORT}],
            "readinessProbe": {"httpGet": {"path": "/", "port": "http"}},
        },
    )


def _wait_ready(core: Any, api: Any, namespace: str, name: str) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        pod: dict[str, Any] = api.sanitize_for_serialization(
            core.read_namespaced_pod(name, namespace)
        )
        conditions = {c["type"]: c["status"] for c in pod["status"].get("conditions", [])}
        statuses = pod["status"].get("containerStatuses") or [{}]
        started = container_id_pid(pod) is not None
        if started and conditions.get("Ready") == "True" and statuses[0].get("ready"):
            return pod
        return None

    return wait_until(ready, timeout=30, what=f"backed pod {name} Ready")


def _wait_failed(
    core: Any, api: Any, namespace: str, name: str, *, timeout: float, what: str
) -> dict[str, Any]:
    def failed() -> dict[str, Any] | None:
        pod: dict[str, Any] = api.sanitize_for_serialization(
            core.read_namespaced_pod(name, namespace)
        )
        return pod if pod["status"]["phase"] == "Failed" else None

    return wait_until(failed, timeout=timeout, what=what)


def _pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def test_backed_pod_answers_http_at_its_pod_ip_and_fails_when_its_process_dies(
    core: Any, api: Any, namespace: str
) -> None:
    core.create_namespaced_pod(namespace, _http_server_pod("web"))
    pod = _wait_ready(core, api, namespace, "web")
    pod_ip = pod["status"]["podIP"]
    assert pod_ip.startswith("127.")
    assert pod["metadata"]["annotations"][KWOK_CUSTOM_STATUS_ANNOTATION[0]] == "custom"

    response = httpx.get(f"http://{pod_ip}:{HTTP_PORT}/", trust_env=False, timeout=5)
    assert response.status_code == 200, response.text

    pid = container_id_pid(pod)
    assert pid is not None and _pid_alive(pid)
    os.kill(pid, signal.SIGKILL)

    pod = _wait_failed(
        core, api, namespace, "web", timeout=15, what="pod web Failed after its process was killed"
    )
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 128 + signal.SIGKILL
    assert terminated["reason"] == "Error"
    conditions = {c["type"]: c["status"] for c in pod["status"]["conditions"]}
    assert conditions["Ready"] == "False"


def test_deleting_a_backed_pod_stops_its_process_then_removes_the_pod(
    core: Any, api: Any, namespace: str
) -> None:
    core.create_namespaced_pod(namespace, _http_server_pod("doomed"))
    pid = container_id_pid(_wait_ready(core, api, namespace, "doomed"))
    assert pid is not None
    core.delete_namespaced_pod("doomed", namespace)

    def gone() -> bool:
        try:
            core.read_namespaced_pod("doomed", namespace)
        except ApiException as error:
            return bool(error.status == 404)
        return False

    wait_until(gone, timeout=20, what="pod doomed removed after its process stopped")
    assert not _pid_alive(pid)


def test_backed_process_gets_the_container_env_with_kubernetes_expansion(
    core: Any, namespace: str, cluster: LocalCluster
) -> None:
    script = (
        "import os, sys; "
        "print('argv', sys.argv[1:]); "
        "print('env', os.environ['GREETING'], os.environ['POD_NAMESPACE'])"
    )
    pod = gpu_pod(
        "echo",
        gpus=0,
        backed=True,
        command=["python3", "-c", script],
        args=["$(GREETING)", "$$(POD_IP)", "$(UNDEFINED)", "--host=$(POD_IP)"],
        extra_container={
            "env": [
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {
                    "name": "POD_NAMESPACE",
                    "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
                },
                {"name": "GREETING", "value": "hello-$(POD_NAME)"},
            ]
        },
    )
    core.create_namespaced_pod(namespace, pod)

    def succeeded() -> Any:
        current = core.read_namespaced_pod("echo", namespace)
        return current if current.status.phase in ("Succeeded", "Failed") else None

    finished = wait_until(succeeded, timeout=30, what="pod echo finished")
    assert finished.status.phase == "Succeeded"
    pod_ip = finished.status.pod_ip
    log = (cluster.pod_dir(namespace, "echo") / "main.log").read_text()
    assert f"argv ['hello-echo', '$(POD_IP)', '$(UNDEFINED)', '--host={pod_ip}']" in log
    assert f"env hello-echo {namespace}" in log


def test_backed_pod_is_not_ready_until_its_readiness_probe_passes(
    core: Any, api: Any, namespace: str
) -> None:
    # The process runs but never listens, so the probe never passes.
    pod = gpu_pod(
        "deaf",
        backed=True,
        command=["sleep", "300"],
        extra_container={"readinessProbe": {"httpGet": {"path": "/", "port": HTTP_PORT}}},
    )
    core.create_namespaced_pod(namespace, pod)

    def started() -> dict[str, Any] | None:
        current: dict[str, Any] = api.sanitize_for_serialization(
            core.read_namespaced_pod("deaf", namespace)
        )
        return current if container_id_pid(current) is not None else None

    running = wait_until(started, timeout=30, what="pod deaf's process started")
    assert running["status"]["phase"] == "Running"
    for _ in range(2):
        current = api.sanitize_for_serialization(core.read_namespaced_pod("deaf", namespace))
        conditions = {c["type"]: c["status"] for c in current["status"]["conditions"]}
        assert conditions["Ready"] == "False"
        assert current["status"]["containerStatuses"][0]["ready"] is False
        time.sleep(1)


def test_a_running_pod_marked_not_ready_by_someone_else_is_ready_again(
    core: Any, api: Any, namespace: str
) -> None:
    """kube-controller-manager marks the pods of a node it takes for NotReady not Ready
    (after an API server outage, for a moment); a live kubelet writes Ready back, and
    so does the backer, or a worker would stay not Ready for the rest of the run."""
    core.create_namespaced_pod(namespace, _http_server_pod("blip"))
    before = _wait_ready(core, api, namespace, "blip")
    core.patch_namespaced_pod_status(
        "blip",
        namespace,
        {
            "status": {
                "conditions": [{"type": "Ready", "status": "False", "reason": "NodeNotReady"}]
            }
        },
    )
    after = _wait_ready(core, api, namespace, "blip")
    assert container_id_pid(after) == container_id_pid(before)  # the same process, not a new one


@pytest.mark.timeout(240)  # a control plane of its own to start, and its API server's restart
def test_the_backer_outlives_an_api_server_outage_and_then_writes_what_happened(
    private_cluster: LocalCluster,
) -> None:
    """A kubelet's processes run on while the API server is away, and it reports what
    happened meanwhile once the server is back. The backer crashed instead on its
    first write into the outage (a connection refused), taking every backed process
    with it: the engines of a chaos test that restarted the API server just as
    another test's pod was being handed back."""
    api = private_cluster.api_client()
    core: Any = client.CoreV1Api(api)
    namespace = "backer-outage"
    core.create_namespace({"metadata": {"name": namespace}})
    try:
        wait_until(
            lambda: core.read_namespaced_service_account("default", namespace),
            timeout=30,
            what="the namespace's default ServiceAccount",
        )
        for name in ("dies", "lives"):
            core.create_namespaced_pod(namespace, _http_server_pod(name))
        dies = container_id_pid(_wait_ready(core, api, namespace, "dies"))
        lives = container_id_pid(_wait_ready(core, api, namespace, "lives"))
        assert dies is not None and lives is not None

        private_cluster.kill("kube-apiserver")
        os.kill(dies, signal.SIGKILL)  # its status cannot be written now
        wait_until(lambda: not _pid_alive(dies), timeout=10, what="the killed process gone")
        time.sleep(2 * _LOOP_SECONDS)  # the backer has noticed, and failed to write it
        private_cluster.restart("kube-apiserver")

        assert private_cluster.health()["pod-backer"], "the pod backer died in the outage"
        assert _pid_alive(lives), "a backed process was stopped by the outage"

        pod = _wait_failed(
            core, api, namespace, "dies", timeout=30, what="the exit written once it is back"
        )
        terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
        assert terminated["exitCode"] == 128 + signal.SIGKILL
        assert _wait_ready(core, api, namespace, "lives")
    finally:
        core.delete_namespace(namespace)
        api.close()
