"""The sessionfleet image, built from the committed Dockerfile, run as the chart runs it.

``e2e/tools/build-image.sh`` builds the image with Debian's buildah (chroot isolation, no
Docker engine) on a minbase Debian 12 base; an unchanged build context reuses the image.
The operator and the router then run FROM THE IMAGE (``buildah run --isolation chroot``)
with the chart's rendered container: the image's entrypoint (the chart sets no
``command``), the pod's ``runAsUser:runAsGroup``, the container's environment and its
arguments from ``helm template``. Three things differ from a pod, and only these: the
ports (the host's network is shared with the other tests, so the port flags get free
ports), ``--kubeconfig`` (outside a pod there is no in-cluster account) and the
``fieldRef`` environment (resolved to the names a pod would have). A simulated worker
becomes Ready, and a turn through the router binds a session and is served.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client

from e2e.chart import REPO_ROOT, by_kind, render
from e2e.helpers import exclusive, wait_until
from e2e.localcluster import LocalCluster
from e2e.operator import Custom, free_port, sim_worker

pytestmark = pytest.mark.timeout(600)

BUILD_IMAGE = REPO_ROOT / "e2e" / "tools" / "build-image.sh"
CACHE = Path.home() / ".cache" / "sessionfleet"
RUN_DIR = CACHE / "image-run"
"""Where the kubeconfig handed to the image lives: not under /tmp, which chroot isolation
replaces with its own."""
PORT_FLAGS = ("--metrics-port=", "--health-port=", "--port=")


@pytest.fixture(scope="session")
def image() -> str:
    """The image built from the committed Dockerfile (reused when its context is unchanged)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with exclusive(CACHE / "build-image.lock", timeout=900):
        built = subprocess.run(
            [str(BUILD_IMAGE)], capture_output=True, text=True, timeout=900, check=False
        )
    if built.returncode != 0:
        pytest.fail(f"{BUILD_IMAGE} exited {built.returncode}:\n{built.stderr[-4000:]}")
    return built.stdout.strip().splitlines()[-1]


def buildah(*args: str) -> str:
    """Run buildah; its stdout."""
    done = subprocess.run(
        ["buildah", *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, f"buildah {' '.join(args)}: {done.stderr}"
    return done.stdout.strip()


def image_config(image: str) -> dict[str, Any]:
    """The image's OCI config (entrypoint, user, environment)."""
    config: dict[str, Any] = json.loads(buildah("inspect", "--type", "image", image))
    return dict(config["OCIv1"]["config"])


class FromImage:
    """One chart Deployment's container, run from the image with ``buildah run``."""

    def __init__(
        self,
        image: str,
        deployment: dict[str, Any],
        kubeconfig_dir: Path,
        log_path: Path,
        ports: dict[str, int],
    ) -> None:
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        security = pod["securityContext"]
        self.user = f"{security['runAsUser']}:{security['runAsGroup']}"
        entrypoint = container.get("command") or image_config(image)["Entrypoint"]
        self.args = [self.port_arg(arg, ports) for arg in container["args"]]
        fields = {
            "metadata.name": f"{deployment['metadata']['name']}-0",
            "metadata.namespace": deployment["metadata"]["namespace"],
        }
        self.env = {
            item["name"]: item["value"]
            if "value" in item
            else fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
            for item in container.get("env", [])
        }
        self.log_path = log_path
        self.container = buildah("from", "--name", f"sf-e2e-{secrets.token_hex(4)}", image)
        argv = [
            "buildah",
            "run",
            "--isolation",
            "chroot",
            "--user",
            self.user,
            "--volume",
            f"{kubeconfig_dir}:/kc:ro",
            *(f"--env={name}={value}" for name, value in self.env.items()),
            self.container,
            "--",
            *entrypoint,
            *self.args,
            "--kubeconfig=/kc/config",
        ]
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    @staticmethod
    def port_arg(arg: str, ports: dict[str, int]) -> str:
        flag = next((f for f in PORT_FLAGS if arg.startswith(f)), None)
        return f"{flag}{ports[flag]}" if flag else arg

    def stop(self) -> None:
        """Stop the process group it started, then remove its container."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        subprocess.run(["buildah", "rm", self.container], capture_output=True, check=False)

    def uids(self) -> set[str]:
        """The real UIDs of the ``sessionfleet`` processes in its process group.

        buildah itself runs as root; the entrypoint it starts must not.
        """
        found = set()
        for proc in Path("/proc").iterdir():
            try:
                stat = (proc / "stat").read_text()
                status = (proc / "status").read_text()
            except (OSError, ValueError):
                continue
            comm_end = stat.rindex(")")
            pgid = int(stat[comm_end + 2 :].split()[2])
            if pgid == self.process.pid and stat[: comm_end + 1].endswith("(sessionfleet)"):
                uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
                found.add(uid_line.split()[1])
        return found

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


@pytest.fixture
def kubeconfig_dir(cluster: LocalCluster) -> Iterator[Path]:
    """The admin kubeconfig, readable by the image's unprivileged user; removed afterwards."""
    folder = RUN_DIR / secrets.token_hex(4)
    folder.mkdir(parents=True)
    folder.chmod(0o755)
    config = folder / "config"
    shutil.copyfile(cluster.kubeconfig, config)
    config.chmod(0o644)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_the_image_runs_the_operator_and_the_router_as_the_chart_does(
    image: str,
    api: Any,
    namespace: str,
    crds_installed: None,
    kubeconfig_dir: Path,
    tmp_path: Path,
) -> None:
    # The image and the chart agree on the identity: the chart's pod runs as the
    # image's USER, and the image starts `sessionfleet`.
    config = image_config(image)
    assert config["Entrypoint"] == ["sessionfleet"]
    release = f"sf{secrets.token_hex(3)}"
    deployments = by_kind(
        render(f"operator.watchNamespaces={{{namespace}}}", namespace=namespace, release=release),
        "Deployment",
    )
    operator_deployment = deployments[f"{release}-sessionfleet-operator"]
    router_deployment = deployments[f"{release}-sessionfleet-router"]
    for deployment in (operator_deployment, router_deployment):
        security = deployment["spec"]["template"]["spec"]["securityContext"]
        assert config["User"] == f"{security['runAsUser']}:{security['runAsGroup']}"

    health, router_port = free_port(), free_port()
    operator = FromImage(
        image,
        operator_deployment,
        kubeconfig_dir,
        tmp_path / "operator.log",
        {"--metrics-port=": free_port(), "--health-port=": health},
    )
    router: FromImage | None = None

    def fail(what: str) -> str:
        tails = [f"--- operator ---\n{operator.log_tail()}"]
        if router is not None:
            tails.append(f"--- router ---\n{router.log_tail()}")
        return "\n".join([what, *tails])

    try:
        assert operator.user == "65532:65532"
        assert f"--namespace={namespace}" in operator.args
        assert operator.env["POD_NAMESPACE"] == namespace
        try:
            wait_until(
                lambda: (
                    httpx.get(f"http://127.0.0.1:{health}/healthz", timeout=2).status_code == 200
                ),
                timeout=60,
                what="the operator's /healthz (from the image)",
            )
            crs = Custom(client.CustomObjectsApi(api), namespace)
            crs.create(sim_worker("w"))
            wait_until(
                lambda: crs.status("inferenceworkers", "w").get("phase") == "Ready",
                timeout=120,
                what="worker w Ready",
            )
            router = FromImage(
                image,
                router_deployment,
                kubeconfig_dir,
                tmp_path / "router.log",
                {"--port=": router_port},
            )
            url = f"http://127.0.0.1:{router_port}"
            wait_until(
                lambda: httpx.get(f"{url}/readyz", timeout=2).status_code == 200,
                timeout=60,
                what="the router ready (from the image)",
            )
        except AssertionError as error:
            raise AssertionError(fail(str(error))) from None

        # Both run as the chart's user, not as root.
        assert operator.uids() == {"65532"} and router.uids() == {"65532"}
        answer = httpx.post(
            f"{url}/v1/chat/completions",
            json={
                "model": "m",
                "messages": [{"role": "user", "content": "Fix the failing test."}],
                "max_tokens": 16,
            },
            headers={"X-Session-Id": "from-the-image"},
            timeout=30,
        )
        assert answer.status_code == 200, fail(answer.text)
        assert answer.headers["X-Sessionfleet-Worker"] == "w"
        assert answer.json()["choices"], answer.text

        def bound() -> bool:
            sessions = [
                s for s in crs.list("agentsessions") if s["spec"]["sessionId"] == "from-the-image"
            ]
            return bool(sessions) and sessions[0].get("status", {}).get("phase") == "Bound"

        try:
            wait_until(bound, timeout=30, what="the session Bound")
        except AssertionError as error:
            raise AssertionError(fail(str(error))) from None
    finally:
        if router is not None:
            router.stop()
        operator.stop()
