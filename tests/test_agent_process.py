"""``sessionfleet agent`` as a real process on 127.0.0.1, on this machine without a GPU."""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sessionfleet.api import EngineType
from sessionfleet.checkpoint.agent_tokens import agent_ssl_context
from sessionfleet.checkpoint.driver import CheckpointTarget, DriverUnavailable
from sessionfleet.cli import build_parser
from sessionfleet.kube import Kube, KubeConfig
from sessionfleet.operator.drivers.criu import CriuDriver

SESSIONFLEET = Path(sys.executable).with_name("sessionfleet")
HOST = "127.0.0.1"
TOKEN = "t0ken"
HAS_NVIDIA_DRIVER = Path("/proc/driver/nvidia/version").exists()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


# The agent's certificate is self-signed, made at its start: nothing here can verify it.
UNVERIFIED = agent_ssl_context(None)


def get(url: str, token: str | None = None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        request = urllib.request.Request(url, headers=headers)
        with urllib.request.urlopen(request, timeout=10, context=UNVERIFIED) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def post(url: str, body: dict[str, Any], token: str | None = None) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=30, context=UNVERIFIED) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


class Running:
    def __init__(self, process: subprocess.Popen[str], url: str) -> None:
        self.process = process
        self.url = url

    def stop(self) -> str:
        """SIGTERM, wait, and return stderr."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            _, stderr = self.process.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            _, stderr = self.process.communicate(timeout=15)
        return stderr


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Running]:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    port = free_port()
    process = subprocess.Popen(
        [
            str(SESSIONFLEET),
            "agent",
            f"--host={HOST}",
            f"--port={port}",
            "--node-name=test-node",
            "--interval=0.2",
            f"--token-file={token_file}",
            f"--storage-root={tmp_path}",
            # Whatever this machine has, the criu the agent looks for is absent.
            "--criu=criu-absent-on-purpose",
        ],
        env={
            **{k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"},
        },
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    running = Running(process, f"https://{HOST}:{port}")
    deadline = time.monotonic() + 30
    while True:
        if process.poll() is not None:
            raise AssertionError(f"the agent exited with {process.returncode}: {running.stop()}")
        try:
            if get(f"{running.url}/healthz")[0] == 200:
                break
        except (urllib.error.URLError, ConnectionError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"the agent did not answer within 30 s: {running.stop()}")
        time.sleep(0.1)
    yield running
    running.stop()


def test_flags_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    from sessionfleet.agent.cli import settings_from_args

    monkeypatch.setenv("NODE_NAME", "from-env")
    settings = settings_from_args(build_parser().parse_args(["agent"]))
    assert (settings.node, settings.host, settings.port, settings.token) == (
        "from-env",
        "0.0.0.0",
        9400,
        None,
    )
    assert settings.storage_root == Path("/var/lib/sessionfleet/checkpoints")
    args = build_parser().parse_args(["agent", "--node-name=n1", "--port=9500", "--host=::"])
    assert (settings_from_args(args).node, settings_from_args(args).port) == ("n1", 9500)


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--operator=system:serviceaccount:s:op", "--token-file={token}"], "exclude each other"),
        (["--metrics-reader=system:serviceaccount:m:prom"], "needs --operator"),
        (["--tls-cert-file=/c.pem"], "go together"),
    ],
)
def test_flags_that_contradict_each_other_are_refused(
    flags: list[str], words: str, tmp_path: Path
) -> None:
    from sessionfleet.agent.cli import settings_from_args

    (tmp_path / "token").write_text("t")
    argv = ["agent", *(f.format(token=tmp_path / "token") for f in flags)]
    with pytest.raises(ValueError, match=words):
        settings_from_args(build_parser().parse_args(argv))


def test_operator_and_metrics_readers_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    from sessionfleet.agent.cli import settings_from_args

    monkeypatch.setenv("HOST_IP", "10.0.0.7")
    argv = [
        "agent",
        "--operator=system:serviceaccount:sf:op",
        "--metrics-reader=system:serviceaccount:mon:prom",
    ]
    settings = settings_from_args(build_parser().parse_args(argv))
    assert settings.operators == {"system:serviceaccount:sf:op"}
    assert settings.metrics_readers == {"system:serviceaccount:mon:prom"}
    assert settings.addresses == ("10.0.0.7",) and not settings.plain_http


@pytest.mark.parametrize(
    "flag",
    [
        "--port=0",
        "--port=65536",
        "--port=http",
        "--interval=0",
        "--interval=nan",
        "--interval=inf",
        "--interval=86401",
        "--capability-ttl=-1",
        "--storage-root=relative/dir",
    ],
)
def test_out_of_range_flags_are_refused(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["agent", flag])
    assert exited.value.code == 2
    assert flag.split("=")[0] in capsys.readouterr().err


def test_an_empty_token_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("\n")
    done = subprocess.run(
        [str(SESSIONFLEET), "agent", f"--token-file={tmp_path / 'token'}"],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ),
    )
    assert done.returncode == 2 and "is empty" in done.stderr


def test_metrics_capability_and_the_nvml_absent_path(agent: Running) -> None:
    time.sleep(1.0)  # several sampling rounds at --interval=0.2
    assert get(f"{agent.url}/metrics")[0] == 401, "its labels name pods"
    status, metrics = get(f"{agent.url}/metrics", TOKEN)
    assert status == 200
    nvml = 1.0 if HAS_NVIDIA_DRIVER else 0.0
    assert f'sessionfleet_agent_nvml_available{{node="test-node"}} {nvml}' in metrics
    assert 'sessionfleet_agent_checkpoint_capable{node="test-node"} 0.0' in metrics

    status, text = get(f"{agent.url}/readyz")
    assert status == 200 and json.loads(text)["tasks"] == ["sampling", "capability"]

    assert get(f"{agent.url}/capability")[0] == 401
    status, text = get(f"{agent.url}/capability", TOKEN)
    capability = json.loads(text)
    assert status == 200 and capability["ok"] is False and capability["node"] == "test-node"
    reasons = capability["reasons"]
    assert any(r.startswith("criu is not installed") for r in reasons)
    assert any(r.startswith("no NVIDIA driver") for r in reasons) != HAS_NVIDIA_DRIVER

    stderr = agent.stop()
    assert agent.process.returncode == 0
    if not HAS_NVIDIA_DRIVER:
        said = [line for line in stderr.splitlines() if "serving without GPU telemetry" in line]
        assert len(said) == 1, stderr  # once, however many rounds sampled


def test_checkpoints_are_refused_with_the_reasons(agent: Running, tmp_path: Path) -> None:
    body = {
        "imagesDir": str(tmp_path / "agents" / "c1"),
        "namespace": "agents",
        "endpoint": "http://127.0.0.1:9",
        "podUID": "0b0c1c8e-3b1a-4c7e-9d1e-7f1e2d3c4b5a",
        "containerID": "containerd://" + "a" * 64,
    }
    status, answer = post(f"{agent.url}/checkpoint", body)
    assert status == 401
    status, answer = post(f"{agent.url}/checkpoint", body, TOKEN)
    assert status == 503
    assert any(r.startswith("criu is not installed") for r in answer["reasons"])
    assert not (tmp_path / "agents").exists()
    # Outside the storage root: refused before the node is even asked.
    status, answer = post(f"{agent.url}/checkpoint", {**body, "imagesDir": "/etc/c1"}, TOKEN)
    assert status == 400 and "storage root" in answer["error"]


async def test_the_operator_driver_hears_the_reasons(agent: Running, tmp_path: Path) -> None:
    async def locate(node: str) -> str:
        return agent.url

    target = CheckpointTarget(
        namespace="agents",
        worker="w",
        epoch=2,
        engine=EngineType.VLLM,
        endpoint="http://127.0.0.1:9",
        location=str(tmp_path / "agents" / "c1"),
        pod="w-2",
        node="test-node",
    )
    async with (
        httpx.AsyncClient(verify=agent_ssl_context(None)) as http,
        Kube(KubeConfig(server="http://127.0.0.1:9")) as kube,
    ):
        driver = CriuDriver(http, kube, locate=locate, token=TOKEN)
        with pytest.raises(DriverUnavailable, match="node test-node: .*criu is not installed"):
            await driver.load(target)


def test_the_agent_speaks_only_tls_with_a_certificate_naming_its_node(agent: Running) -> None:
    """The token never travels in clear text: plain HTTP gets no answer, and the
    certificate the agent made at start names its node."""
    port = int(agent.url.rsplit(":", 1)[1])
    with pytest.raises((urllib.error.URLError, ConnectionError, httpx.HTTPError)):
        httpx.get(f"http://{HOST}:{port}/healthz", timeout=5).raise_for_status()
    pem = ssl.get_server_certificate((HOST, port))
    from cryptography import x509

    certificate = x509.load_pem_x509_certificate(pem.encode())
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert names.value.get_values_for_type(x509.DNSName) == ["test-node"]
    assert certificate.issuer == certificate.subject, "self-signed"
