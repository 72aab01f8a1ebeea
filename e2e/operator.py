"""The operator as a real process against the e2e cluster, and worker manifests for it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from e2e.helpers import wait_until
from e2e.localcluster import BACKED_LABEL, gpu_pod_tolerations

REPO_ROOT = Path(__file__).resolve().parents[1]
SESSIONFLEET = Path(sys.executable).parent / "sessionfleet"
GROUP, VERSION = "sessionfleet.dev", "v1alpha1"
WORKER_LABEL = "sessionfleet.dev/worker"
ELECTION_ARGS = ("--lease-duration=6s", "--renew-deadline=4s", "--retry-period=1s")
"""Shorter than the defaults (15 s, 10 s, 2 s), so a replaced operator leads sooner."""
CHART_ELECTION_ARGS = ("--lease-duration=15s", "--renew-deadline=10s", "--retry-period=2s")
"""The chart's timings, for tests that run for minutes on a busy machine and test no
failover: with a 4 s renew deadline one slow renewal stops the operator mid-test (a
leader that loses its Lease exits), leaving its holds up."""


def free_port() -> int:
    """A free TCP port on every address (kopf's health endpoint binds 0.0.0.0)."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


class OperatorProcess:
    """``sessionfleet operator`` serving one namespace, with its own metrics port."""

    def __init__(
        self,
        kubeconfig: Path,
        namespace: str,
        log_dir: Path,
        *extra: str,
        binary: Path = SESSIONFLEET,
        env: dict[str, str] | None = None,
    ) -> None:
        self.binary = binary
        self.env = env or {}
        self.kubeconfig = kubeconfig
        self.namespace = namespace
        self.log_path = log_dir / f"operator-{namespace}.log"
        self.metrics_port = free_port()
        self.health_port = free_port()
        self.extra = extra
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        """Start the process (appending to its log)."""
        argv = [
            str(self.binary),
            "operator",
            f"--namespace={self.namespace}",
            f"--kubeconfig={self.kubeconfig}",
            f"--metrics-port={self.metrics_port}",
            f"--health-port={self.health_port}",
            "--resync=0.5",
            "--scrape-interval=2",
            "--node-not-ready-toleration=5s",
            # Every e2e operator elects itself on a Lease in its namespace, so the
            # election runs in every test; a restarted one waits out its old life's lease.
            "--leader-elect",
            f"--leader-election-namespace={self.namespace}",
            *ELECTION_ARGS,
            *self.extra,
        ]
        env = {**os.environ, **self.env}
        with self.log_path.open("ab") as log:  # the child keeps its own descriptor
            log.write(f"--- start {self.starts}: {' '.join(argv)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.starts += 1

    def kill(self) -> None:
        """Kill the process at once, as a crash or a node loss would."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        """Stop the process gracefully, or kill it after 10 s."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()

    def role(self) -> str | None:
        """The replica's role from its readiness answer (leader, standby), if it answers."""
        try:
            answer = httpx.get(f"http://127.0.0.1:{self.health_port}/readyz", timeout=2)
        except httpx.HTTPError:
            return None
        return str(answer.json().get("role")) if answer.status_code == 200 else None

    def metrics(self) -> str:
        """The operator's /metrics text."""
        return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text

    def log_tail(self, lines: int = 40) -> str:
        """The end of the operator's log, for failure messages."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def sim_worker(name: str, model: str = "m", **spec: Any) -> dict[str, Any]:
    """An InferenceWorker running the simulated engine behind a backed KWOK pod."""
    template = spec.pop("template", {})
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceWorker",
        "metadata": {"name": name, "labels": spec.pop("labels", {})},
        "spec": {
            "model": model,
            "engine": {"type": "sim"},
            "gpus": 1,
            "template": {
                "labels": {BACKED_LABEL: "true"},
                "tolerations": gpu_pod_tolerations(),
                **template,
            },
            **spec,
        },
    }


def session(name: str, model: str = "m", **spec: Any) -> dict[str, Any]:
    """An AgentSession as a router would create it."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "AgentSession",
        "metadata": {"name": name},
        "spec": {"sessionId": f"id-{name}", "model": model, **spec},
    }


def drain_policy(name: str, **spec: Any) -> dict[str, Any]:
    """A DrainPolicy."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "DrainPolicy",
        "metadata": {"name": name},
        "spec": spec,
    }


class Custom:
    """Short calls on the custom resources of one namespace."""

    def __init__(self, api: Any, namespace: str) -> None:
        self.api = api
        self.namespace = namespace

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        plural = body["kind"].lower() + ("s" if body["kind"] != "DrainPolicy" else "")
        if body["kind"] == "DrainPolicy":
            plural = "drainpolicies"
        return self.api.create_namespaced_custom_object(  # type: ignore[no-any-return]
            GROUP, VERSION, self.namespace, plural, body
        )

    def get(self, plural: str, name: str) -> dict[str, Any]:
        return self.api.get_namespaced_custom_object(  # type: ignore[no-any-return]
            GROUP, VERSION, self.namespace, plural, name
        )

    def list(self, plural: str) -> list[dict[str, Any]]:
        return list(
            self.api.list_namespaced_custom_object(GROUP, VERSION, self.namespace, plural)["items"]
        )

    def patch(self, plural: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.api.patch_namespaced_custom_object(  # type: ignore[no-any-return]
            GROUP, VERSION, self.namespace, plural, name, body
        )

    def status(self, plural: str, name: str) -> dict[str, Any]:
        return dict(self.get(plural, name).get("status") or {})

    def phases(self, plural: str) -> dict[str, str | None]:
        return {
            o["metadata"]["name"]: (o.get("status") or {}).get("phase") for o in self.list(plural)
        }

    def all_in_phase(self, plural: str, phase: str, count: int) -> Callable[[], bool]:
        def check() -> bool:
            phases = self.phases(plural)
            return len(phases) == count and all(p == phase for p in phases.values())

        return check


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    """One condition of a status, or an empty dict."""
    return next((c for c in status.get("conditions") or [] if c.get("type") == kind), {})


def on_own_nodes(worker: dict[str, Any], namespace: str, node: str | None = None) -> dict[str, Any]:
    """Confine a worker to the test's own nodes (one of them when ``node`` is given)."""
    template = worker["spec"]["template"]
    template["tolerations"] = [
        *gpu_pod_tolerations(),
        {"key": "e2e.sessionfleet.dev/pool", "operator": "Exists", "effect": "NoSchedule"},
    ]
    template["nodeSelector"] = (
        {"kubernetes.io/hostname": node} if node else {"e2e.sessionfleet.dev/pool": namespace}
    )
    return worker


def wait_for(operator: OperatorProcess, check: Any, *, timeout: float, what: str) -> Any:
    """``wait_until``, with the operator's log appended when the wait fails."""
    try:
        return wait_until(check, timeout=timeout, what=what)
    except AssertionError as error:
        raise AssertionError(f"{error}\n--- operator log ---\n{operator.log_tail()}") from None


def worker_pods(core: Any, namespace: str, worker: str) -> list[Any]:
    return list(
        core.list_namespaced_pod(
            namespace, label_selector=f"{'sessionfleet.dev/worker'}={worker}"
        ).items
    )


def ready_workers(crs: Custom, count: int, operator: OperatorProcess) -> None:
    wait_for(
        operator,
        crs.all_in_phase("inferenceworkers", "Ready", count),
        timeout=60,
        what="{count} Ready workers",
    )


def bound_to(crs: Custom) -> dict[str, str | None]:
    return {
        o["metadata"]["name"]: (o.get("status") or {}).get("worker")
        for o in crs.list("agentsessions")
    }


class Process:
    """A ``sessionfleet`` subcommand as a process with its log in a file."""

    def __init__(self, argv: list[str], log_path: Path) -> None:
        self.argv = argv
        self.log_path = log_path
        with log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(os.environ),
            )

    def wait_http(self, url: str, timeout: float = 30) -> None:
        def answers() -> bool:
            if self.popen.poll() is not None:
                raise AssertionError(f"{self.argv[1]} exited:\n{self.log_tail()}")
            try:
                # verify=False: a node agent's certificate is self-signed, made at its start.
                return httpx.get(url, timeout=1, verify=False).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(answers, timeout=timeout, what=url)

    def stop(self) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)
        return self.popen.returncode

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def start_router(
    kubeconfig: Path,
    namespace: str,
    replica: str,
    logs: Path,
    *extra: str,
    ready_within: float = 30,
) -> tuple[str, Process]:
    """``sessionfleet router`` for one namespace on a free loopback port, once it is ready.

    ``extra`` flags are appended (``--hold-timeout=2``, ``--retry-after=1``, ...).
    """
    port = free_port()
    router = Process(
        [
            str(SESSIONFLEET),
            "router",
            "--host=127.0.0.1",
            f"--port={port}",
            f"--namespace={namespace}",
            f"--kubeconfig={kubeconfig}",
            f"--replica={replica}",
            "--flush-interval=1",
            "--create-timeout=30",
            *extra,
        ],
        logs / f"router-{replica}.log",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        router.wait_http(f"{url}/readyz", timeout=ready_within)
    except BaseException:
        router.stop()  # not left running behind a failed start
        raise
    return url, router


def via_router(
    url: str, session_id: str, history: list[dict[str, str]], text: str
) -> httpx.Response:
    """One turn through a router, with the generic session header."""
    history.append({"role": "user", "content": text})
    response = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "m", "messages": history, "max_tokens": 16},
        headers={"X-Session-Id": session_id},
        timeout=60,
    )
    response.raise_for_status()
    history.append(
        {"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]}
    )
    return response
