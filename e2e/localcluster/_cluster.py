"""Start, attach to and stop a local Kubernetes control plane.

A cluster is etcd, kube-apiserver, kube-controller-manager, kube-scheduler, KWOK
with fake GPU nodes, and the pod backer, all on loopback ports, with every file in
one state directory: certificates, kubeconfigs, etcd data, logs and ``cluster.json``
(ports and processes), which lets ``down`` and ``status`` work from another process.

A cluster is either *owned* by the interpreter that started it (the pytest fixture,
``python e2e/localcluster run``): it is stopped by a ``finally``, an ``atexit``
hook and SIGTERM/SIGHUP handlers, and swept by the next start if its owner was
killed outright; or *detached* (``up``): it outlives the command and ``down`` stops it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from . import _components as comp
from ._kubeconfig import write_kubeconfig
from ._nodes import gpu_node_manifest, gpu_node_names
from ._pki import Pki, make_pki
from ._process import (
    ProcessRecord,
    exit_code,
    is_running,
    kwok_pod_cidrs_in_use,
    log_tail,
    spawn,
    start_ticks,
    stop,
)
from ._tools import Tools, find_tools

REPO_ROOT = Path(__file__).resolve().parents[2]
#: Where ``make cluster-up`` keeps its cluster (git-ignored).
DEFAULT_STATE_DIR = REPO_ROOT / ".e2e-state"
#: Set to a kubeconfig written by this harness to make the tests reuse that cluster.
ENV_KUBECONFIG = "SESSIONFLEET_E2E_KUBECONFIG"
#: Set to 1 to keep an owned cluster's state directory (logs) after it stops.
ENV_KEEP_STATE = "SESSIONFLEET_E2E_KEEP_STATE"

#: Bounds of each start-up wait. Measured start-up is ~10 s on 2 cores; the margins
#: cover a loaded CI machine.
_TIMEOUT_ETCD = 30.0
_TIMEOUT_APISERVER = 60.0
_TIMEOUT_COMPONENT = 60.0

Progress = Callable[[str], None]


class ClusterError(RuntimeError):
    """The cluster could not be started, found, or reached."""


def _stderr_progress(message: str) -> None:
    print(f"localcluster: {message}", file=sys.stderr, flush=True)


def runs_base() -> Path:
    """Parent directory of owned clusters' temporary state directories."""
    base = Path(tempfile.gettempdir()) / f"sessionfleet-e2e-{os.getuid()}"
    base.mkdir(mode=0o700, exist_ok=True)
    return base


@dataclass
class ClusterState:
    """What ``cluster.json`` records about a cluster."""

    state_dir: str
    api_server: str
    ports: dict[str, int]
    owner_pid: int | None
    owner_start_ticks: int | None
    started_at: float
    processes: list[ProcessRecord] = field(default_factory=list)
    gpu_nodes: list[str] = field(default_factory=list)
    pod_cidr: str = ""
    startup_seconds: float | None = None

    def save(self, path: Path) -> None:
        """Write atomically, so a concurrent ``status`` never reads half a file."""
        data = asdict(self)
        data["processes"] = [record.to_json() for record in self.processes]
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> ClusterState:
        """Read a state file written by ``save``."""
        data: dict[str, Any] = json.loads(path.read_text())
        data["processes"] = [ProcessRecord.from_json(item) for item in data["processes"]]
        return cls(**data)

    def running(self) -> list[ProcessRecord]:
        """The recorded processes that still run."""
        return [record for record in self.processes if is_running(record)]

    def owner_alive(self) -> bool:
        """Whether the interpreter that owns this cluster still runs (True if detached)."""
        if self.owner_pid is None:
            return True
        return start_ticks(self.owner_pid) == self.owner_start_ticks


# Owned clusters of this interpreter, stopped at exit or on SIGTERM/SIGHUP.
_owned: list[LocalCluster] = []
_owned_lock = threading.Lock()
_handlers_installed = False


def _stop_owned() -> None:
    with _owned_lock:
        clusters = list(_owned)
    for cluster in clusters:
        cluster.stop()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """Stop owned clusters, then die of the same signal as if unhandled."""
    _stop_owned()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _register_owned(cluster: LocalCluster) -> None:
    global _handlers_installed
    with _owned_lock:
        _owned.append(cluster)
        if _handlers_installed:
            return
        _handlers_installed = True
    atexit.register(_stop_owned)
    # Signal handlers can only be set from the main thread; elsewhere the atexit
    # hook, the caller's finally and the next start's sweep still apply.
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(signum) in (signal.SIG_DFL, None):
                signal.signal(signum, _on_signal)


def sweep_stale(progress: Progress = _stderr_progress) -> None:
    """Stop clusters left behind by owners that were killed (SIGKILL, OOM).

    Only owned clusters in ``runs_base()`` are considered; detached clusters are
    stopped by ``down``.
    """
    for state_file in runs_base().glob("*/cluster.json"):
        try:
            state = ClusterState.load(state_file)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if state.owner_alive():
            continue
        progress(f"stopping a cluster left behind by pid {state.owner_pid}: {state.state_dir}")
        LocalCluster(Path(state.state_dir), state).stop(remove_state=True)


def _https_context(pki_dir: Path | None) -> ssl.SSLContext:
    """A TLS context trusting the cluster CA with the admin client certificate.

    Without ``pki_dir`` verification is off: used only for the controller manager's
    and scheduler's self-signed /healthz endpoints on loopback.
    """
    if pki_dir is None:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    context = ssl.create_default_context(cafile=str(pki_dir / "ca.crt"))
    context.load_cert_chain(str(pki_dir / "admin.crt"), str(pki_dir / "admin.key"))
    return context


def _http_ok(url: str, context: ssl.SSLContext | None = None, expect: str | None = None) -> bool:
    """GET ``url`` (never through a proxy); True on 200 and ``expect`` in the body."""
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=context))
    opener = urllib.request.build_opener(*handlers)
    try:
        with opener.open(url, timeout=2) as response:
            body = response.read().decode(errors="replace")
            return bool(response.status == 200 and (expect is None or expect in body))
    except (urllib.error.URLError, OSError):
        return False


class LocalCluster:
    """A running local control plane, started here or found through its state dir."""

    def __init__(
        self, state_dir: Path, state: ClusterState | None = None, kubeconfig: Path | None = None
    ) -> None:
        self.layout = comp.Layout(state_dir)
        self.state = state
        self._kubeconfig = kubeconfig or self.layout.kubeconfig
        self._stopped = False

    # ----------------------------------------------------------------- access

    @property
    def state_dir(self) -> Path:
        """The directory holding everything of this cluster."""
        return self.layout.state_dir

    @property
    def kubeconfig(self) -> Path:
        """Admin kubeconfig (``system:masters``)."""
        return self._kubeconfig

    @property
    def api_server(self) -> str:
        """The API server URL, ``https://127.0.0.1:PORT``."""
        if self.state is not None:
            return self.state.api_server
        import yaml

        config = yaml.safe_load(self.kubeconfig.read_text())
        return str(config["clusters"][0]["cluster"]["server"])

    @property
    def pod_cidr(self) -> str | None:
        """The CIDR KWOK hands pod IPs out of (``127.N.0.1/16``), if known."""
        return self.state.pod_cidr if self.state is not None and self.state.pod_cidr else None

    @property
    def gpu_nodes(self) -> list[str]:
        """Names of the fake GPU nodes."""
        return list(self.state.gpu_nodes) if self.state is not None else []

    def log_file(self, component: str) -> Path:
        """Log file of a component (etcd, kube-apiserver, ..., kwok, pod-backer)."""
        return self.layout.logs / f"{component}.log"

    def tools(self) -> Tools:
        """The tool binaries this cluster runs."""
        return find_tools()

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run the pinned kubectl against this cluster and capture its output.

        Raises:
            ClusterError: if ``check`` and kubectl exits non-zero (with its stderr).
        """
        argv = [str(self.tools().kubectl), f"--kubeconfig={self.kubeconfig}", *args]
        result = subprocess.run(
            argv, input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and result.returncode != 0:
            raise ClusterError(
                f"kubectl {' '.join(args)} exited {result.returncode}: {result.stderr.strip()}"
            )
        return result

    def api_client(self) -> Any:
        """A new ``kubernetes.client.ApiClient`` for the admin kubeconfig."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))  # type: ignore[no-untyped-call]

    def pod_dir(self, namespace: str, name: str) -> Path:
        """Working directory of a backed pod's process (its log is ``<container>.log``)."""
        return self.layout.pods_dir / namespace / name

    def health(self) -> dict[str, bool]:
        """Whether each recorded process still runs."""
        if self.state is None:
            return {}
        return {record.name: is_running(record) for record in self.state.processes}

    # -------------------------------------------------------------- start/stop

    @classmethod
    def start(
        cls,
        state_dir: Path | None = None,
        *,
        owned: bool = True,
        gpu_nodes: int = 3,
        gpus_per_node: int = 4,
        progress: Progress = _stderr_progress,
    ) -> LocalCluster:
        """Start a cluster and wait until it can run pods.

        Args:
            state_dir: where to keep its files; a fresh temporary directory if None.
                Refused if a cluster recorded there still runs.
            owned: stop the cluster when this interpreter exits (see module docs).
            gpu_nodes: number of fake GPU nodes.
            gpus_per_node: ``nvidia.com/gpu`` capacity of each node.
            progress: receives one line per start-up step.

        Raises:
            ToolsMissingError: the binaries are not built (``make e2e-tools``).
            ClusterError: a component failed to start; names it and its log file.
        """
        tools = find_tools()
        sweep_stale(progress)
        if state_dir is None:
            state_dir = Path(tempfile.mkdtemp(prefix="run-", dir=runs_base()))
        else:
            _prepare_state_dir(state_dir)
        owner_pid = os.getpid() if owned else None
        cluster = cls(
            state_dir,
            ClusterState(
                state_dir=str(state_dir),
                api_server="",
                ports={},
                owner_pid=owner_pid,
                owner_start_ticks=start_ticks(owner_pid) if owner_pid else None,
                started_at=time.time(),
            ),
        )
        if owned:
            _register_owned(cluster)
        try:
            cluster._boot(tools, gpu_nodes, gpus_per_node, progress)
        except BaseException:
            progress(f"start-up failed; logs are kept in {cluster.layout.logs}")
            cluster.stop(remove_state=False)
            raise
        return cluster

    @classmethod
    def attach(cls, kubeconfig: Path) -> LocalCluster:
        """Use a running cluster through its kubeconfig (``SESSIONFLEET_E2E_KUBECONFIG``).

        When the kubeconfig sits in a state directory of this harness, the state
        (processes, backed pods' logs) is loaded too. The cluster is not owned: this
        interpreter never stops it.
        """
        kubeconfig = kubeconfig.resolve()
        if not kubeconfig.is_file():
            raise ClusterError(f"{ENV_KUBECONFIG}={kubeconfig}: no such kubeconfig")
        state_file = comp.Layout(kubeconfig.parent).state_file
        state = ClusterState.load(state_file) if state_file.is_file() else None
        return cls(kubeconfig.parent, state, kubeconfig)

    @classmethod
    def from_state_dir(cls, state_dir: Path) -> LocalCluster:
        """Find the cluster recorded in ``state_dir``.

        Raises:
            ClusterError: if no cluster is recorded there.
        """
        state_file = comp.Layout(state_dir).state_file
        if not state_file.is_file():
            raise ClusterError(f"no cluster recorded in {state_dir}")
        return cls(state_dir, ClusterState.load(state_file))

    def stop(self, *, remove_state: bool | None = None) -> None:
        """Stop every process of the cluster, newest first; idempotent.

        Args:
            remove_state: delete the state directory afterwards. By default an owned
                cluster's temporary directory is removed (unless
                ``SESSIONFLEET_E2E_KEEP_STATE=1``) and a detached cluster keeps its
                logs.
        """
        if self._stopped or self.state is None:
            return
        self._stopped = True
        with _owned_lock:
            if self in _owned:
                _owned.remove(self)
        for record in reversed(self.state.processes):
            # The backer stops the pods' processes on SIGTERM; give it time to.
            stop(record, timeout=15 if record.name == "pod-backer" else 10)
        self._stop_backed_leftovers()
        if remove_state is None:
            remove_state = self.state.owner_pid is not None and not os.environ.get(ENV_KEEP_STATE)
        if remove_state:
            shutil.rmtree(self.state_dir, ignore_errors=True)
        else:
            # Keep logs for diagnosis; drop what makes the directory look "up".
            self.layout.state_file.unlink(missing_ok=True)
            shutil.rmtree(self.layout.etcd_data, ignore_errors=True)

    def _stop_backed_leftovers(self) -> None:
        """Stop backed pod processes whose backer died before it could stop them."""
        for record_file in self.layout.pods_dir.glob("*/*/process.json"):
            with contextlib.suppress(OSError, ValueError, KeyError):
                stop(ProcessRecord.from_json(json.loads(record_file.read_text())), timeout=5)

    # ------------------------------------------------------------------ boot

    def _record(self, record: ProcessRecord) -> ProcessRecord:
        assert self.state is not None
        self.state.processes.append(record)
        self.state.save(self.layout.state_file)
        return record

    def _wait(
        self,
        what: str,
        record: ProcessRecord,
        check: Callable[[], bool],
        timeout: float,
    ) -> None:
        """Poll ``check`` until it holds, failing fast if ``record``'s process exits."""
        deadline = time.monotonic() + timeout
        last_error: Exception | None = None
        delay = 0.05
        while time.monotonic() < deadline:
            if not is_running(record):
                code = exit_code(record)
                raise ClusterError(
                    f"{record.name} exited during start-up (exit status {code}) while "
                    f"waiting for {what}; log {record.log}:\n{log_tail(record.log)}"
                )
            try:
                if check():
                    return
            except Exception as error:
                last_error = error
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)
        detail = f" (last error: {last_error})" if last_error else ""
        raise ClusterError(
            f"timed out after {timeout:.0f} s waiting for {what}{detail}; "
            f"{record.name} log {record.log}:\n{log_tail(record.log)}"
        )

    def _boot(self, tools: Tools, gpu_nodes: int, gpus_per_node: int, progress: Progress) -> None:
        assert self.state is not None
        started = time.monotonic()
        layout = self.layout

        def step(message: str) -> None:
            progress(f"[{time.monotonic() - started:5.1f} s] {message}")

        ports = comp.Ports.allocate()
        self.state.ports = asdict(ports)
        self.state.api_server = f"https://{comp.HOST}:{ports.apiserver}"
        self.state.pod_cidr = comp.choose_pod_cidr(kwok_pod_cidrs_in_use())
        pki = make_pki(layout.pki_dir)
        self._write_configs(tools, pki)
        step(f"state in {layout.state_dir}; certificates ready; pod CIDR {self.state.pod_cidr}")

        env = {key: value for key, value in os.environ.items() if key != "KUBECONFIG"}

        etcd = self._record(
            spawn("etcd", comp.etcd_argv(tools, ports, layout), self.log_file("etcd"), env=env)
        )
        self._wait(
            "etcd /health",
            etcd,
            lambda: _http_ok(
                f"http://{comp.HOST}:{ports.etcd_client}/health", expect='"health":"true"'
            ),
            _TIMEOUT_ETCD,
        )
        step(f"etcd ready on {comp.HOST}:{ports.etcd_client}")

        apiserver = self._record(
            spawn(
                "kube-apiserver",
                comp.apiserver_argv(tools, ports, layout, pki),
                self.log_file("kube-apiserver"),
                env=env,
            )
        )
        api_context = _https_context(layout.pki_dir)
        readyz = f"{self.state.api_server}/readyz"
        self._wait(
            "kube-apiserver /readyz",
            apiserver,
            lambda: _http_ok(readyz, api_context),
            _TIMEOUT_APISERVER,
        )
        step(f"kube-apiserver ready at {self.state.api_server}")

        # The rest only needs the API server and starts in parallel.
        kcm = self._record(
            spawn(
                "kube-controller-manager",
                comp.controller_manager_argv(tools, ports, layout, pki),
                self.log_file("kube-controller-manager"),
                env=env,
            )
        )
        scheduler = self._record(
            spawn(
                "kube-scheduler",
                comp.scheduler_argv(tools, ports, layout),
                self.log_file("kube-scheduler"),
                env=env,
            )
        )
        kwok = self._record(
            spawn(
                "kwok",
                comp.kwok_argv(tools, ports, layout, self.state.pod_cidr),
                self.log_file("kwok"),
                env=env,
            )
        )
        backer = self._record(
            spawn(
                "pod-backer",
                self._backer_argv(),
                self.log_file("pod-backer"),
                env={**env, "PYTHONUNBUFFERED": "1"},
                cwd=self.state_dir,
            )
        )

        api = self.api_client()
        try:
            from kubernetes import client

            core: Any = client.CoreV1Api(api)
            names = gpu_node_names(gpu_nodes)
            for name in names:
                core.create_node(gpu_node_manifest(name, gpus_per_node))
            self.state.gpu_nodes = names
            self.state.save(layout.state_file)

            insecure = _https_context(None)
            self._wait(
                "kube-controller-manager /healthz",
                kcm,
                lambda: _http_ok(
                    f"https://{comp.HOST}:{ports.controller_manager}/healthz", insecure
                ),
                _TIMEOUT_COMPONENT,
            )
            step("kube-controller-manager healthy")
            self._wait(
                "kube-scheduler /healthz",
                scheduler,
                lambda: _http_ok(f"https://{comp.HOST}:{ports.scheduler}/healthz", insecure),
                _TIMEOUT_COMPONENT,
            )
            self._wait(
                "kwok /healthz",
                kwok,
                lambda: _http_ok(f"http://{comp.HOST}:{ports.kwok}/healthz"),
                _TIMEOUT_COMPONENT,
            )
            self._wait(
                f"{gpu_nodes} GPU nodes Ready (KWOK)",
                kwok,
                lambda: _nodes_ready(core, names),
                _TIMEOUT_COMPONENT,
            )
            step(f"{gpu_nodes} GPU nodes Ready, {gpus_per_node} nvidia.com/gpu each")
            # The service-account controller creates `default` in every namespace;
            # pods cannot be admitted before it exists.
            self._wait(
                "ServiceAccount default/default (kube-controller-manager)",
                kcm,
                lambda: _service_account_exists(core, "default"),
                _TIMEOUT_COMPONENT,
            )
            step("ServiceAccount default/default created")
            self._wait(
                "the pod backer's watch",
                backer,
                lambda: (layout.state_dir / "pod-backer.ready").exists(),
                _TIMEOUT_COMPONENT,
            )
        finally:
            api.close()
        self.state.startup_seconds = round(time.monotonic() - started, 2)
        self.state.save(layout.state_file)
        step(
            f"cluster ready in {self.state.startup_seconds:.1f} s; "
            f"export KUBECONFIG={self.kubeconfig}"
        )

    def _write_configs(self, tools: Tools, pki: Pki) -> None:
        assert self.state is not None
        layout = self.layout
        server = self.state.api_server
        write_kubeconfig(
            layout.kubeconfig,
            server,
            pki.ca.cert,
            pki.admin,
            user="sessionfleet-e2e-admin",
            context="sessionfleet-e2e",
        )
        write_kubeconfig(
            layout.component_kubeconfig("kube-controller-manager"),
            server,
            pki.ca.cert,
            pki.controller_manager,
            user="system:kube-controller-manager",
            context="local",
        )
        write_kubeconfig(
            layout.component_kubeconfig("kube-scheduler"),
            server,
            pki.ca.cert,
            pki.scheduler,
            user="system:kube-scheduler",
            context="local",
        )
        layout.kwok_config.write_text(comp.kwok_stages_yaml(tools))
        layout.logs.mkdir(parents=True, exist_ok=True)

    def _backer_argv(self) -> list[str]:
        # Run by path, not with -m: see e2e/localcluster/__main__.py for why.
        return [
            sys.executable,
            str(REPO_ROOT / "e2e" / "localcluster"),
            "backer",
            f"--kubeconfig={self.kubeconfig}",
            f"--state-dir={self.state_dir}",
        ]


def _prepare_state_dir(state_dir: Path) -> None:
    """Refuse a state dir whose cluster still runs; clear a stopped one's leftovers."""
    state_file = comp.Layout(state_dir).state_file
    if state_file.is_file():
        try:
            state = ClusterState.load(state_file)
        except (OSError, ValueError, KeyError, TypeError):
            state = None
        if state is not None and state.running():
            raise ClusterError(
                f"a cluster is already up in {state_dir} (API server {state.api_server}, "
                f"kubeconfig {comp.Layout(state_dir).kubeconfig}); stop it first with "
                "`make cluster-down` or `python e2e/localcluster down`"
            )
    if state_dir.exists() and any(state_dir.iterdir()):
        # Only ever delete a directory this harness made: a mistyped --state-dir must
        # not wipe someone's files.
        if not (comp.Layout(state_dir).logs.is_dir() or (state_dir / "pki").is_dir()):
            raise ClusterError(f"{state_dir} is not empty and not a cluster state directory")
        shutil.rmtree(state_dir)
    state_dir.mkdir(parents=True, mode=0o700, exist_ok=True)


def _nodes_ready(core: Any, names: Sequence[str]) -> bool:
    ready = set()
    for node in core.list_node().items:
        for condition in node.status.conditions or []:
            if condition.type == "Ready" and condition.status == "True":
                ready.add(node.metadata.name)
    return set(names) <= ready


def _service_account_exists(core: Any, namespace: str) -> bool:
    from kubernetes.client.exceptions import ApiException

    try:
        core.read_namespaced_service_account("default", namespace)
    except ApiException as error:
        if error.status == 404:
            return False
        raise
    return True


@contextlib.contextmanager
def running_cluster(**options: Any) -> Iterator[LocalCluster]:
    """Start an owned cluster for the duration of a ``with`` block."""
    cluster = LocalCluster.start(**options)
    try:
        yield cluster
    finally:
        cluster.stop()
