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
import base64
import contextlib
import json
import os
import re
import shutil
import signal
import socket
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
from ._pki import Pki, make_pki, pki_files
from ._process import (
    ProcessRecord,
    exit_code,
    is_running,
    is_stopped,
    kwok_pod_cidrs_in_use,
    log_tail,
    spawn,
    start_ticks,
    stop,
)
from ._process import kill as kill_process
from ._process import pause as pause_process
from ._process import resume as resume_process
from ._tools import Tools, find_tools
from .backer import READY_FILE

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

#: The etcd key in which the API server records the revision it last compacted at
#: (k8s.io/apiserver/pkg/storage/etcd3/compact.go).
_COMPACT_REV_KEY = "compact_rev_key"

#: Where nodes' heartbeat Leases live.
_NODE_LEASES = "kube-node-lease"

#: The components, in start-up order, by the names they are recorded under.
COMPONENTS = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
    "pod-backer",
)

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


@dataclass(frozen=True)
class _Component:
    """How one component is started and how to tell it is ready.

    Built from the cluster's state (ports, pod CIDR) and state directory alone, so
    that start-up and ``restart`` use the same definition, also for a cluster found
    through its state directory.
    """

    name: str
    argv: list[str]
    #: What ``ready`` waits for, for messages: "etcd /health".
    what: str
    ready: Callable[[], bool]
    timeout: float
    extra_env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    #: Run before the process starts: clears what a former process left behind.
    prepare: Callable[[], None] | None = None


def _stop_timeout(name: str) -> float:
    """How long a component gets between SIGTERM and SIGKILL."""
    # The backer stops the pods' processes on SIGTERM; give it time to.
    return 15.0 if name == "pod-backer" else 10.0


#: Components that were paused through a cluster of this interpreter and not resumed
#: yet: resumed at exit, since a stopped etcd or API server breaks every later user.
_paused: dict[tuple[int, int], ProcessRecord] = {}
_paused_lock = threading.Lock()


def _forget_paused(record: ProcessRecord) -> None:
    with _paused_lock:
        _paused.pop((record.pid, record.start_ticks), None)


def _pause_record(record: ProcessRecord) -> None:
    """SIGSTOP ``record``'s group and remember it, to be resumed at exit at the latest."""
    if not is_running(record):
        raise ClusterError(f"cannot pause {record.name}: it is not running")
    with _paused_lock:
        _paused[(record.pid, record.start_ticks)] = record
    if not pause_process(record):
        _resume_record(record)
        raise ClusterError(f"{record.name} (pid {record.pid}) did not stop on SIGSTOP")


def _resume_record(record: ProcessRecord) -> None:
    """SIGCONT ``record``'s group (if it still runs) and forget that it was paused."""
    _forget_paused(record)
    if not resume_process(record):
        raise ClusterError(f"{record.name} (pid {record.pid}) still stopped after SIGCONT")


@atexit.register
def _resume_paused() -> None:
    with _paused_lock:
        records = list(_paused.values())
    for record in records:
        with contextlib.suppress(ClusterError):
            _resume_record(record)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


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
        """Whether each recorded process still runs (re-read from the state file)."""
        if self.state is None:
            return {}
        return {record.name: is_running(record) for record in self._reload_processes()}

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
        # Another LocalCluster of the same state dir may have restarted a component.
        records = self._reload_processes()
        # A paused etcd would hold up the API server's shutdown: continue all first.
        for record in records:
            resume_process(record)
            _forget_paused(record)
        for record in reversed(records):
            stop(record, timeout=_stop_timeout(record.name))
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

    # -------------------------------------------------------- fault injection

    def kill(self, component: str) -> None:
        """SIGKILL a component's process group and wait until the process is gone.

        ``component`` is a recorded name: "etcd", "kube-apiserver",
        "kube-controller-manager", "kube-scheduler", "kwok" or "pod-backer". The
        process is reaped when this interpreter started it; the record stays in the
        state (``health()`` shows it False) until ``restart``. A component that is
        already gone is left alone. Killing the pod backer leaves its pods' processes
        running, as a crashed kubelet would.

        Raises:
            ClusterError: unknown component, or still running 10 s after SIGKILL.
        """
        _, record = self._find(component)
        if not kill_process(record):
            raise ClusterError(f"{component} (pid {record.pid}) still runs 10 s after SIGKILL")
        _forget_paused(record)

    def restart(self, component: str, *, timeout: float = 60, grace: float | None = None) -> None:
        """Stop a component if it runs, start it again and wait until it is healthy.

        The process gets SIGTERM, then SIGKILL after ``grace`` seconds (by default
        10, 15 for the pod backer, as in ``stop``; kube-apiserver v1.36.3 stops
        listening at once on SIGTERM but does not exit, so it takes the whole grace),
        and is started again with the same command line, environment and log file
        (appended to). Its record in the state is replaced in place and the state
        file saved, so ``stop``, ``status`` and other ``LocalCluster`` objects of the
        same state directory find the new process. It is ready as at start-up: etcd
        ``/health``, kube-apiserver ``/readyz``, controller manager and scheduler
        ``/healthz``, KWOK ``/healthz``, the pod backer's watch. etcd keeps its data
        directory; only the process is new. A restarted KWOK takes its nodes over at
        once: the node Leases of the former one are released first (see
        ``_release_kwok_leases``).

        Args:
            component: a name from ``COMPONENTS``.
            timeout: bound of the readiness wait, in seconds.
            grace: seconds between SIGTERM and SIGKILL; 0 kills at once, like
                ``kill`` followed by ``restart``.

        Raises:
            ClusterError: unknown component, the new process exited, or it was not
                ready within ``timeout`` (with the tail of its log).
        """
        state = self._require_state()
        index, old = self._find(component)
        spec = self._component(component)
        stop(old, timeout=_stop_timeout(component) if grace is None else grace)
        _forget_paused(old)
        record = self._spawn(spec)
        state.processes[index] = record
        state.save(self.layout.state_file)
        self._wait(spec.what, record, spec.ready, timeout)

    def pause(self, component: str) -> None:
        """SIGSTOP a component's process group; returns once the process is stopped.

        Prefer ``paused``, which resumes on every way out of its block. Whatever is
        paused through this interpreter and not resumed is resumed at its exit
        (``atexit``; not after SIGKILL or ``os._exit``). ``stop`` and ``restart``
        continue a paused component themselves.

        Raises:
            ClusterError: unknown component, not running, or not stopped within 5 s.
        """
        _, record = self._find(component)
        _pause_record(record)

    def resume(self, component: str) -> None:
        """SIGCONT a component's process group; a no-op if it is not stopped or gone.

        Raises:
            ClusterError: unknown component, or still stopped 5 s after SIGCONT.
        """
        _, record = self._find(component)
        _resume_record(record)

    def is_paused(self, component: str) -> bool:
        """Whether a component's process runs but is stopped (SIGSTOP)."""
        _, record = self._find(component)
        return is_stopped(record)

    @contextlib.contextmanager
    def paused(self, component: str, seconds: float | None = None) -> Iterator[None]:
        """Pause a component for a ``with`` block: SIGSTOP now, SIGCONT at the end.

        The component is resumed however the block ends (an exception, a failed
        assertion, pytest-timeout's signal). With ``seconds`` it is resumed after that
        long even if the block still runs, from a timer thread, which lets the block
        issue a request that waits for the component and then goes through::

            with cluster.paused("etcd", seconds=3):
                core.create_namespaced_config_map(...)   # returns after ~3 s

        Raises:
            ClusterError: as ``pause``.
        """
        _, record = self._find(component)
        _pause_record(record)
        timer: threading.Timer | None = None
        if seconds is not None:
            timer = threading.Timer(seconds, _resume_record, (record,))
            timer.daemon = True
            timer.start()
        try:
            yield
        finally:
            if timer is not None:
                timer.cancel()
            _resume_record(record)

    def etcd_revision(self) -> int:
        """etcd's current revision (its keyspace's ``header.revision``).

        Raises:
            ClusterError: etcd did not answer within 10 s.
        """
        reply = self._etcd("/v3/kv/range", {"key": _b64("/"), "count_only": True})
        return int(reply["header"]["revision"])

    def compact_etcd(self, *, tell_apiserver: bool = True) -> int:
        """Compact etcd's keyspace at its current revision, physically; returns it.

        After this, etcd refuses to read or watch at any older revision. It goes
        straight to etcd's JSON gateway on its plain-HTTP client port. With
        ``tell_apiserver`` the revision is first written to ``compact_rev_key``, as
        the API server's own compactor (every 5 minutes) does: the API server watches
        that key, and its watch cache drops its list snapshots older than the
        revision within its 15 s poll, so ``resourceVersionMatch=Exact`` lists at an
        older version then fail with 410 as after a real compaction. Watches served
        by the watch cache are not affected either way (see e2e/README.md). A
        revision that is already compacted is not an error.

        Raises:
            ClusterError: etcd did not answer within 10 s, or refused otherwise.
        """
        revision = self.etcd_revision()
        if tell_apiserver:
            # What the API server's compactor stores (a decimal string); the write
            # also moves the key's version on, which makes the API server's next
            # compare-and-swap adopt ours instead of compacting at the same time.
            self._etcd("/v3/kv/put", {"key": _b64(_COMPACT_REV_KEY), "value": _b64(str(revision))})
        try:
            self._etcd("/v3/kv/compaction", {"revision": str(revision), "physical": True})
        except ClusterError as error:
            if "required revision has been compacted" not in str(error):
                raise
        return revision

    def _etcd(self, path: str, body: dict[str, Any], timeout: float = 10) -> dict[str, Any]:
        """POST to etcd's gRPC-JSON gateway; the decoded reply."""
        state = self._require_state()
        url = f"http://{comp.HOST}:{state.ports['etcd_client']}{path}"
        request = urllib.request.Request(
            url,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(request, timeout=timeout) as response:
                reply: dict[str, Any] = json.loads(response.read())
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")
            raise ClusterError(f"etcd {path}: HTTP {error.code}: {detail}") from error
        except (urllib.error.URLError, OSError) as error:
            raise ClusterError(f"etcd {path}: {error}") from error
        return reply

    def _require_state(self) -> ClusterState:
        if self.state is None:
            raise ClusterError(
                f"no state of this cluster: {self.kubeconfig} is not in a state directory "
                "of this harness, so its processes are unknown"
            )
        return self.state

    def _reload_processes(self) -> list[ProcessRecord]:
        """The process records, re-read from the state file when there is one."""
        state = self._require_state()
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            state.processes = ClusterState.load(self.layout.state_file).processes
        return state.processes

    def _find(self, component: str) -> tuple[int, ProcessRecord]:
        """Position and record of a component, as the state file has it now."""
        for index, record in enumerate(self._reload_processes()):
            if record.name == component:
                return index, record
        raise ClusterError(
            f"no component {component!r} in the cluster of {self.state_dir} "
            f"(known: {', '.join(COMPONENTS)})"
        )

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

    def _component(self, name: str, tools: Tools | None = None) -> _Component:
        """How component ``name`` is started and checked, from the recorded state."""
        state = self._require_state()
        tools = tools or find_tools()
        ports = comp.Ports(**state.ports)
        layout = self.layout
        pki = pki_files(layout.pki_dir)
        host = comp.HOST
        insecure = _https_context(None)
        if name == "etcd":
            health = f"http://{host}:{ports.etcd_client}/health"
            return _Component(
                name,
                comp.etcd_argv(tools, ports, layout),
                "etcd /health",
                lambda: _http_ok(health, expect='"health":"true"'),
                _TIMEOUT_ETCD,
            )
        if name == "kube-apiserver":
            readyz = f"{state.api_server}/readyz"
            api_context = _https_context(layout.pki_dir)
            return _Component(
                name,
                comp.apiserver_argv(tools, ports, layout, pki),
                "kube-apiserver /readyz",
                lambda: _http_ok(readyz, api_context),
                _TIMEOUT_APISERVER,
            )
        if name == "kube-controller-manager":
            kcm_healthz = f"https://{host}:{ports.controller_manager}/healthz"
            return _Component(
                name,
                comp.controller_manager_argv(tools, ports, layout, pki),
                "kube-controller-manager /healthz",
                lambda: _http_ok(kcm_healthz, insecure),
                _TIMEOUT_COMPONENT,
            )
        if name == "kube-scheduler":
            scheduler_healthz = f"https://{host}:{ports.scheduler}/healthz"
            return _Component(
                name,
                comp.scheduler_argv(tools, ports, layout),
                "kube-scheduler /healthz",
                lambda: _http_ok(scheduler_healthz, insecure),
                _TIMEOUT_COMPONENT,
            )
        if name == "kwok":
            kwok_healthz = f"http://{host}:{ports.kwok}/healthz"
            return _Component(
                name,
                comp.kwok_argv(tools, ports, layout, state.pod_cidr),
                "kwok /healthz",
                lambda: _http_ok(kwok_healthz),
                _TIMEOUT_COMPONENT,
                prepare=self._release_kwok_leases,
            )
        if name == "pod-backer":
            ready_file = layout.state_dir / READY_FILE
            return _Component(
                name,
                self._backer_argv(),
                "the pod backer's watch",
                ready_file.exists,
                _TIMEOUT_COMPONENT,
                extra_env={"PYTHONUNBUFFERED": "1"},
                cwd=self.state_dir,
                prepare=lambda: ready_file.unlink(missing_ok=True),
            )
        raise ClusterError(f"no component {name!r} (known: {', '.join(COMPONENTS)})")

    def _spawn(self, component: _Component) -> ProcessRecord:
        """Start a component's process, its output appended to its log file."""
        if component.prepare is not None:
            component.prepare()
        env = {key: value for key, value in os.environ.items() if key != "KUBECONFIG"}
        return spawn(
            component.name,
            component.argv,
            self.log_file(component.name),
            env={**env, **component.extra_env},
            cwd=component.cwd,
        )

    def _release_kwok_leases(self) -> None:
        """Delete the node Leases held by a former KWOK, so a new one takes over at once.

        KWOK manages a node only while it holds the node's Lease, under an identity
        new to each process (``<hostname>_<uuid>``), and takes another holder's Lease
        over only once it expires (``--node-lease-duration-seconds=40``): without
        this, a restarted KWOK leaves the nodes and their pods alone for up to 40 s.
        A kubelet that restarts keeps its identity and carries on at once, which this
        restores. Best effort: nothing is deleted while the API server is down.
        """
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        holder = re.compile(re.escape(socket.gethostname()) + r"_[0-9a-f-]{36}")
        api = self.api_client()
        try:
            leases: Any = client.CoordinationV1Api(api)
            for lease in leases.list_namespaced_lease(_NODE_LEASES, _request_timeout=5).items:
                if holder.fullmatch(lease.spec.holder_identity or ""):
                    with contextlib.suppress(ApiException):
                        leases.delete_namespaced_lease(
                            lease.metadata.name, _NODE_LEASES, _request_timeout=5
                        )
        except (ApiException, HTTPError, OSError):
            pass
        finally:
            api.close()

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

        components = {name: self._component(name, tools) for name in COMPONENTS}
        records: dict[str, ProcessRecord] = {}

        def launch(*names: str) -> None:
            for name in names:
                records[name] = self._record(self._spawn(components[name]))

        def ready(name: str) -> None:
            component = components[name]
            self._wait(component.what, records[name], component.ready, component.timeout)

        launch("etcd")
        ready("etcd")
        step(f"etcd ready on {comp.HOST}:{ports.etcd_client}")
        launch("kube-apiserver")
        ready("kube-apiserver")
        step(f"kube-apiserver ready at {self.state.api_server}")
        # The rest only needs the API server and starts in parallel.
        launch("kube-controller-manager", "kube-scheduler", "kwok", "pod-backer")

        api = self.api_client()
        try:
            from kubernetes import client

            core: Any = client.CoreV1Api(api)
            names = gpu_node_names(gpu_nodes)
            for name in names:
                core.create_node(gpu_node_manifest(name, gpus_per_node))
            self.state.gpu_nodes = names
            self.state.save(layout.state_file)

            ready("kube-controller-manager")
            step("kube-controller-manager healthy")
            ready("kube-scheduler")
            ready("kwok")
            self._wait(
                f"{gpu_nodes} GPU nodes Ready (KWOK)",
                records["kwok"],
                lambda: _nodes_ready(core, names),
                _TIMEOUT_COMPONENT,
            )
            step(f"{gpu_nodes} GPU nodes Ready, {gpus_per_node} nvidia.com/gpu each")
            # The service-account controller creates `default` in every namespace;
            # pods cannot be admitted before it exists.
            self._wait(
                "ServiceAccount default/default (kube-controller-manager)",
                records["kube-controller-manager"],
                lambda: _service_account_exists(core, "default"),
                _TIMEOUT_COMPONENT,
            )
            step("ServiceAccount default/default created")
            ready("pod-backer")
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
        layout.audit_policy.write_text(comp.audit_policy_yaml())
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
