"""The pod backer: a real local process behind each KWOK pod that opts in.

KWOK makes pods Running without running anything. For a pod labelled
``sessionfleet.dev/backed: "true"`` the backer acts as that pod's kubelet:

* when KWOK has made the pod Running with a pod IP, it takes over the pod's status
  (the annotation ``kwok.x-k8s.io/status: custom``, which KWOK is started to
  disregard) and starts the first container's ``command`` + ``args`` as a local
  process, with ``$(VAR)`` expansion and the container's ``env`` (literal values,
  the downward API, ConfigMap/Secret keys). The venv's ``bin`` comes first on PATH.
  Any 127.x address is bindable, so a process told ``--host=$(POD_IP)`` serves at
  the pod IP. The container status gets ``containerID: process://<pid>``. A container
  without a ``command`` of one of vLLM's images runs the real vLLM (CPU build) that
  ``make e2e-vllm-tools`` installs, with the pod's arguments mapped in ``_vllm.py``;
* an ``httpGet`` readiness probe, if declared, holds the pod not-Ready until the
  process answers it (probed every 0.25 s: faster than a kubelet, to keep tests fast);
  once Ready, a pod that someone else marks not Ready (kube-controller-manager does,
  for a node it takes for NotReady) is made Ready again, as a live kubelet does;
* when the process exits, the container is marked terminated (exit code, or
  128 + signal) and the pod Failed (Succeeded on exit 0), through the status
  subresource. Like ``restartPolicy: Never``: the process is not restarted;
* when the pod is deleted, the process gets SIGTERM, SIGKILL after the grace period
  (at most 30 s);
* once the process is gone the pod is handed back to KWOK (annotation removed): KWOK
  finishes a pending deletion, as a kubelet confirms one, and recycles the pod IP
  when the pod is deleted. No KWOK stage matches a Failed pod, so its status stays;
* while the API server is away (stopped, restarting, not ready yet) the processes run
  on, as under a kubelet, and what the backer could not write it writes once the
  server answers again, in the order it happened.

It runs as its own process, started by the cluster harness next to KWOK, rather than
as a thread of the test process: a cluster started by ``make cluster-up`` serves
every later test run, the demo and pytest-xdist workers alike, and exactly one
backer acts on each pod. Each backed process runs in its own session (so it and its
children can be signalled as a group) with its log in
``<state-dir>/pods/<namespace>/<pod>/<container>.log`` and its identity in
``process.json`` next to it, which ``down`` uses to stop leftovers.

Run: ``python e2e/localcluster backer --kubeconfig=... --state-dir=...`` (the harness does).
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import logging
import os
import queue
import shutil
import signal
import subprocess
import sysconfig
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from ._components import BACKED_LABEL, KWOK_CUSTOM_STATUS_ANNOTATION, Layout
from ._podspec import (
    HttpProbe,
    PodSpecError,
    container_argv,
    container_env,
    expand,
    readiness_probe,
)
from ._process import ProcessRecord, start_ticks
from ._vllm import (
    VllmInstall,
    is_vllm_image,
    lower_priority,
    scratch_dir,
    vllm_argv,
    vllm_env,
    vllm_root,
)

BACKED_SELECTOR = f"{BACKED_LABEL}=true"
CONTAINER_ID_PREFIX = "process://"
READY_FILE = "pod-backer.ready"

_MAX_GRACE_SECONDS = 30.0
_HAND_BACK_TIMEOUT = 10.0
_PROBE_INTERVAL = 0.25
_LOOP_TICK = 0.1
_RETRY_SECONDS = 1.0
"""How long writes wait for an API server that did not answer before the next try."""

logger = logging.getLogger("pod-backer")

Pod = dict[str, Any]


def _now() -> str:
    """RFC 3339 UTC timestamp with second precision, as the API server stores them."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def api_away(error: BaseException) -> bool:
    """Whether a request failed because the API server is away, not because of the request.

    Refused or broken connections, and the answers of a server that is starting or
    stopping (429 "storage is (re)initializing", 5xx): the same write may go through later.
    """
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    if isinstance(error, ApiException):
        return not error.status or error.status == 429 or error.status >= 500
    return isinstance(error, HTTPError | OSError)


def container_id_pid(pod: Mapping[str, Any]) -> int | None:
    """The pid of a backed pod's process from its first container status, if any."""
    statuses = pod.get("status", {}).get("containerStatuses") or []
    container_id = str(statuses[0].get("containerID", "")) if statuses else ""
    if container_id.startswith(CONTAINER_ID_PREFIX):
        return int(container_id.removeprefix(CONTAINER_ID_PREFIX))
    return None


@dataclass
class BackedPod:
    """A pod this backer owns, and its process."""

    namespace: str
    name: str
    uid: str
    container: str
    process: subprocess.Popen[bytes] | None
    started_at: str
    probe: HttpProbe | None = None
    ready: bool = False
    next_probe: float = 0.0
    finished: bool = False
    deleting: bool = False
    gone: bool = False
    kill_at: float | None = None
    handed_back_at: float | None = None
    force_deleted: bool = False

    @property
    def key(self) -> str:
        """``namespace/name`` for log lines."""
        return f"{self.namespace}/{self.name}"


class PodBacker:
    """Watches backed pods and keeps a local process behind each Running one."""

    def __init__(self, kubeconfig: Path, state_dir: Path) -> None:
        from kubernetes import config

        # Two clients: the watch thread holds a streaming connection of its own.
        self._api: Any = config.new_client_from_config(config_file=str(kubeconfig))  # type: ignore[no-untyped-call]
        self._watch_api: Any = config.new_client_from_config(config_file=str(kubeconfig))  # type: ignore[no-untyped-call]
        self._layout = Layout(state_dir)
        self._events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._pods: dict[str, BackedPod] = {}
        self._unwritten: deque[tuple[str, Callable[[], None]]] = deque()
        """Writes the API server did not take, oldest first: written once it is back."""
        self._retry_at = 0.0
        self._stop = threading.Event()
        self._path = os.pathsep.join(
            [sysconfig.get_path("scripts"), os.environ.get("PATH", "/usr/bin:/bin")]
        )

    # ------------------------------------------------------------- lifecycle

    def run(self) -> None:
        """Serve until ``stop()``; then stop every backed process."""
        watcher = threading.Thread(target=self._watch, name="pod-watch", daemon=True)
        watcher.start()
        try:
            while not self._stop.is_set():
                try:
                    kind, payload = self._events.get(timeout=_LOOP_TICK)
                except queue.Empty:
                    pass
                else:
                    self._dispatch(kind, payload)
                try:
                    self._write_unwritten()
                    self._tick()
                except Exception:  # a kubelet outlives any one failure
                    logger.exception("tick failed")
        finally:
            self._shutdown()

    def stop(self) -> None:
        """Ask ``run`` to return (safe from a signal handler)."""
        self._stop.set()

    def _shutdown(self) -> None:
        """Stop all processes; pod statuses are left alone (the cluster is going away)."""
        (self._layout.state_dir / READY_FILE).unlink(missing_ok=True)
        for backed in self._pods.values():
            self._signal(backed, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for backed in self._pods.values():
            if backed.process is None:
                continue
            try:
                backed.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._signal(backed, signal.SIGKILL)
                backed.process.wait(timeout=5)
            self._forget_process(backed)
        logger.info("stopped")

    # ----------------------------------------------------------------- watch

    def _watch(self) -> None:
        """List, then watch backed pods, re-listing when the watch expires."""
        from kubernetes import client, watch
        from kubernetes.client.exceptions import ApiException

        core: Any = client.CoreV1Api(self._watch_api)
        resource_version: str | None = None
        while not self._stop.is_set():
            try:
                if resource_version is None:
                    listing = self._watch_api.sanitize_for_serialization(
                        core.list_pod_for_all_namespaces(label_selector=BACKED_SELECTOR)
                    )
                    resource_version = listing["metadata"]["resourceVersion"]
                    self._events.put(("SYNC", listing.get("items") or []))
                    (self._layout.state_dir / READY_FILE).touch()
                stream = watch.Watch().stream(  # type: ignore[no-untyped-call]
                    core.list_pod_for_all_namespaces,
                    label_selector=BACKED_SELECTOR,
                    resource_version=resource_version,
                    allow_watch_bookmarks=True,
                    timeout_seconds=60,
                    deserialize=False,
                )
                for event in stream:
                    pod = event["object"]
                    resource_version = pod["metadata"]["resourceVersion"]
                    if event["type"] != "BOOKMARK":
                        self._events.put((event["type"], pod))
                    if self._stop.is_set():
                        return
            except ApiException as error:
                if error.status == 410:
                    resource_version = None  # expired: list again
                else:
                    logger.warning("watch failed: %s; retrying", error)
                    time.sleep(1)
            except Exception as error:  # keep watching whatever happened
                # List again: an expired version can also surface here (the client
                # fails on the 410 ERROR event of an undeserialized stream), and a
                # fresh SYNC is right after any interruption.
                logger.warning("watch interrupted: %r; listing again", error)
                resource_version = None
                time.sleep(1)

    def _dispatch(self, kind: str, payload: Any) -> None:
        try:
            if kind == "SYNC":
                present = {pod["metadata"]["uid"] for pod in payload}
                for uid in [uid for uid in self._pods if uid not in present]:
                    self._on_gone(self._pods[uid])
                for pod in payload:
                    self._on_pod(pod)
            elif kind == "DELETED":
                backed = self._pods.get(payload["metadata"]["uid"])
                if backed is not None:
                    self._on_gone(backed)
            else:
                self._on_pod(payload)
        except Exception:  # one pod's failure must not stop the others
            logger.exception("handling %s event failed", kind)

    # ------------------------------------------------------------ pod events

    def _on_pod(self, pod: Pod) -> None:
        metadata = pod["metadata"]
        backed = self._pods.get(metadata["uid"])
        if metadata.get("deletionTimestamp"):
            if backed is not None:
                self._begin_delete(backed, pod)
            elif self._owns_status(pod):
                # Backed by an earlier backer of this cluster, whose process is gone:
                # hand the pod back so that KWOK finishes its deletion.
                orphan = BackedPod(
                    metadata["namespace"],
                    metadata["name"],
                    metadata["uid"],
                    "",
                    None,
                    _now(),
                    finished=True,
                    deleting=True,
                )
                self._pods[orphan.uid] = orphan
            return
        status = pod.get("status", {})
        if backed is None and status.get("phase") == "Running" and status.get("podIP"):
            self._start(pod)
        elif backed is not None and self._ready_taken_away(backed, pod):
            # A kubelet's status manager puts back the status it knows when someone
            # else changed it: kube-controller-manager marks every pod of a node it
            # takes for NotReady not Ready (after an API server outage, its view of
            # the node leases is stale for a moment), and a live kubelet undoes that.
            logger.info("%s: marked not Ready by someone else; Ready again", backed.key)
            self._write_running(backed, pod)

    def _ready_taken_away(self, backed: BackedPod, pod: Pod) -> bool:
        """Whether the pod says not Ready while its process runs and passed its probe."""
        if not backed.ready or backed.deleting or backed.finished or backed.process is None:
            return False
        if not self._owns_status(pod):
            return False
        conditions = (pod.get("status") or {}).get("conditions") or ()
        return any(c.get("type") == "Ready" and c.get("status") != "True" for c in conditions)

    @staticmethod
    def _owns_status(pod: Pod) -> bool:
        annotations = pod["metadata"].get("annotations") or {}
        key, value = KWOK_CUSTOM_STATUS_ANNOTATION
        return bool(annotations.get(key) == value)

    def _on_gone(self, backed: BackedPod) -> None:
        """The pod object is gone: forget it, killing its process first if it runs."""
        backed.gone = True
        if backed.finished or backed.process is None:
            self._pods.pop(backed.uid, None)
            return
        logger.info("%s: pod gone; stopping its process", backed.key)
        backed.deleting = True
        self._signal(backed, signal.SIGTERM)
        backed.kill_at = time.monotonic() + 2

    def _begin_delete(self, backed: BackedPod, pod: Pod) -> None:
        if backed.deleting:
            return
        backed.deleting = True
        if backed.finished:
            return  # the process is already gone; the tick hands the pod back
        grace = pod["metadata"].get("deletionGracePeriodSeconds")
        grace_seconds = min(float(grace if grace is not None else 30), _MAX_GRACE_SECONDS)
        logger.info("%s: pod deleted; SIGTERM, grace %.0f s", backed.key, grace_seconds)
        self._signal(backed, signal.SIGTERM)
        backed.kill_at = time.monotonic() + grace_seconds

    # ----------------------------------------------------------------- start

    def _start(self, pod: Pod) -> None:
        metadata = pod["metadata"]
        namespace, name, uid = metadata["namespace"], metadata["name"], metadata["uid"]
        container = pod["spec"]["containers"][0]
        backed = BackedPod(namespace, name, uid, container["name"], None, _now())
        self._pods[uid] = backed
        # From here on KWOK leaves this pod's status to us.
        take_over = {KWOK_CUSTOM_STATUS_ANNOTATION[0]: KWOK_CUSTOM_STATUS_ANNOTATION[1]}
        self._write(
            f"{backed.key}: take over its status",
            lambda: self._patch_metadata(backed, {"annotations": take_over}),
        )
        try:
            variables = container_env(pod, container, self._resolve_ref)
            argv, added_env = self._argv(pod, container, variables)
            backed.probe = readiness_probe(pod, container)
            executable = argv[0] if "/" in argv[0] else shutil.which(argv[0], path=self._path)
            if executable is None:
                raise PodSpecError(f"executable {argv[0]!r} not found in PATH {self._path}")
        except PodSpecError as error:
            logger.warning("%s: cannot start: %s", backed.key, error)
            backed.finished = True
            self._write_terminated(backed, pod, 128, "StartError", str(error))
            self._hand_back(backed)
            return
        except Exception as error:
            if not api_away(error):  # reading a ConfigMap or Secret of its env
                raise
            # Started from the next listing, which follows the watch's reconnection.
            logger.warning("%s: not started, the API server is away: %r", backed.key, error)
            self._pods.pop(uid, None)
            return

        pod_dir = self._layout.pods_dir / namespace / name
        pod_dir.mkdir(parents=True, exist_ok=True)
        working_dir = container.get("workingDir")
        env = {
            "PATH": self._path,
            "HOME": os.environ.get("HOME", "/root"),
            "LANG": os.environ.get("LANG", "C.UTF-8"),
            "HOSTNAME": name,
            "PYTHONUNBUFFERED": "1",
            **added_env,
            **variables,
        }
        log_path = pod_dir / f"{backed.container}.log"
        with log_path.open("ab") as log:
            log.write(f"--- {backed.started_at} {' '.join(argv)}\n".encode())
            log.flush()
            try:
                backed.process = subprocess.Popen(
                    [executable, *argv[1:]],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=working_dir if working_dir and Path(working_dir).is_dir() else pod_dir,
                    start_new_session=True,
                    close_fds=True,
                )
            except OSError as error:
                logger.warning("%s: cannot start %s: %s", backed.key, executable, error)
                backed.finished = True
                self._write_terminated(backed, pod, 128, "StartError", str(error))
                self._hand_back(backed)
                return
        pid = backed.process.pid
        if not container.get("command") and is_vllm_image(str(container.get("image", ""))):
            lower_priority(pid)
        record = ProcessRecord(f"{namespace}/{name}", pid, start_ticks(pid) or 0, str(log_path))
        (pod_dir / "process.json").write_text(json.dumps(record.to_json()) + "\n")
        logger.info("%s: started pid %d: %s", backed.key, pid, " ".join(argv))
        backed.ready = backed.probe is None
        self._write_running(backed, pod)

    def _argv(
        self, pod: Pod, container: Mapping[str, Any], variables: Mapping[str, str]
    ) -> tuple[list[str], Mapping[str, str]]:
        """What to run for the container, and the environment this machine adds to its own.

        A container with a ``command`` runs it. One without runs its image's entrypoint,
        which the backer knows only for vLLM's images (``_vllm.py`` says how).
        """
        image = str(container.get("image", ""))
        if container.get("command") or not is_vllm_image(image):
            return container_argv(container, variables), {}
        install = VllmInstall(vllm_root())
        if (missing := install.missing()) is not None:
            raise PodSpecError(missing)
        args = [expand(arg, variables) for arg in container.get("args") or []]
        pod_ip = str(pod.get("status", {}).get("podIP") or "127.0.0.1")
        scratch = scratch_dir(str(pod["metadata"]["uid"]))
        return vllm_argv(install, args, pod_ip), vllm_env(install, scratch, self._layout.state_dir)

    def _resolve_ref(self, kind: str, namespace: str, name: str, key: str) -> str | None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        core = client.CoreV1Api(self._api)
        try:
            if kind == "ConfigMap":
                data = core.read_namespaced_config_map(name, namespace).data or {}
                return data.get(key)
            secret = core.read_namespaced_secret(name, namespace).data or {}
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        encoded = secret.get(key)
        return base64.b64decode(encoded).decode() if encoded is not None else None

    # ------------------------------------------------------------------ tick

    def _tick(self) -> None:
        """Probe readiness, notice exited processes and hand finished pods back."""
        now = time.monotonic()
        for backed in list(self._pods.values()):
            process = backed.process
            if process is not None and not backed.finished:
                code = process.poll()
                if code is None:
                    if backed.deleting and backed.kill_at is not None and now >= backed.kill_at:
                        logger.info("%s: grace period over; SIGKILL", backed.key)
                        self._signal(backed, signal.SIGKILL)
                        backed.kill_at = None
                    elif not backed.ready and not backed.deleting and now >= backed.next_probe:
                        self._probe(backed)
                    continue
                backed.finished = True
                # Kill what the process left behind in its group (forked workers).
                self._signal(backed, signal.SIGKILL)
                self._forget_process(backed)
                if backed.gone:
                    self._pods.pop(backed.uid, None)
                    continue
                if not backed.deleting:
                    exit_code = code if code >= 0 else 128 - code
                    logger.info("%s: process exited with %d", backed.key, exit_code)
                    reason = "Completed" if exit_code == 0 else "Error"
                    self._write_terminated(backed, None, exit_code, reason, "")
                self._hand_back(backed)
            elif backed.finished and backed.deleting:
                self._hand_back(backed)
                self._delete_if_stuck(backed, now)

    def _probe(self, backed: BackedPod) -> None:
        assert backed.probe is not None
        backed.next_probe = time.monotonic() + _PROBE_INTERVAL
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(backed.probe.url, timeout=1) as response:
                healthy = 200 <= response.status < 400
        except (urllib.error.URLError, OSError):
            healthy = False
        if healthy:
            backed.ready = True
            logger.info("%s: readiness probe %s passed", backed.key, backed.probe.url)
            self._write_running(backed, None)

    def _hand_back(self, backed: BackedPod) -> None:
        """Return a pod whose process is gone to KWOK, which manages it from then on.

        KWOK finishes a pending deletion (its pod-delete stage) and, when the pod is
        deleted, returns the pod IP to its pool: it recycles no IP of a pod whose
        status it disregards, so without this every backed pod would leak its IP.
        No KWOK stage matches a Failed or Succeeded pod, so the status stays ours.
        """
        if backed.handed_back_at is not None:
            return
        backed.handed_back_at = time.monotonic()
        self._write(
            f"{backed.key}: hand back",
            lambda: self._patch_metadata(
                backed, {"annotations": {KWOK_CUSTOM_STATUS_ANNOTATION[0]: None}}
            ),
        )

    def _delete_if_stuck(self, backed: BackedPod, now: float) -> None:
        """Remove the pod ourselves if KWOK has not finished its deletion in time."""
        if backed.force_deleted or backed.handed_back_at is None:
            return
        if now - backed.handed_back_at < _HAND_BACK_TIMEOUT:
            return
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        backed.force_deleted = True
        logger.warning("%s: KWOK did not remove the pod; deleting it now", backed.key)

        def delete() -> None:
            try:
                client.CoreV1Api(self._api).delete_namespaced_pod(
                    backed.name,
                    backed.namespace,
                    body=client.V1DeleteOptions(
                        grace_period_seconds=0,
                        preconditions=client.V1Preconditions(uid=backed.uid),
                    ),
                )
            except ApiException as error:
                if error.status in (404, 409):
                    return
                if api_away(error):
                    raise
                logger.warning("%s: removing the pod failed: %s", backed.key, error)

        self._write(f"{backed.key}: delete", delete)

    # ---------------------------------------------------------------- status

    @staticmethod
    def _conditions(ready: bool) -> list[dict[str, str]]:
        now = _now()
        value = "True" if ready else "False"
        return [
            {"type": "Ready", "status": value, "lastTransitionTime": now},
            {"type": "ContainersReady", "status": value, "lastTransitionTime": now},
        ]

    def _container_statuses(
        self, backed: BackedPod, pod: Pod | None, state: dict[str, Any], ready: bool
    ) -> list[dict[str, Any]]:
        """The pod's container statuses with the first container's replaced.

        ``containerStatuses`` has no merge key, so a patch must carry the whole list.
        """
        if pod is None:
            pod = self._read_pod(backed) or {}
        statuses = list(pod.get("status", {}).get("containerStatuses") or [])
        mine = next((item for item in statuses if item.get("name") == backed.container), None)
        if mine is None:
            mine = {"name": backed.container, "image": "", "imageID": "", "restartCount": 0}
            statuses.insert(0, mine)
        index = statuses.index(mine)
        updated = {**mine, "state": state, "ready": ready, "started": "running" in state}
        if backed.process is not None:
            updated["containerID"] = f"{CONTAINER_ID_PREFIX}{backed.process.pid}"
        statuses[index] = updated
        return statuses

    def _write_running(self, backed: BackedPod, pod: Pod | None) -> None:
        state = {"running": {"startedAt": backed.started_at}}
        self._write(
            f"{backed.key}: Running, ready {backed.ready}",
            lambda: self._patch_status(
                backed,
                {
                    "containerStatuses": self._container_statuses(backed, pod, state, backed.ready),
                    "conditions": self._conditions(backed.ready),
                },
            ),
        )

    def _write_terminated(
        self, backed: BackedPod, pod: Pod | None, exit_code: int, reason: str, message: str
    ) -> None:
        terminated: dict[str, Any] = {
            "exitCode": exit_code,
            "reason": reason,
            "startedAt": backed.started_at,
            "finishedAt": _now(),
        }
        if message:
            terminated["message"] = message
        if backed.process is not None:
            terminated["containerID"] = f"{CONTAINER_ID_PREFIX}{backed.process.pid}"
        self._write(
            f"{backed.key}: terminated, exit code {exit_code}",
            lambda: self._patch_status(
                backed,
                {
                    "phase": "Succeeded" if exit_code == 0 else "Failed",
                    "containerStatuses": self._container_statuses(
                        backed, pod, {"terminated": terminated}, False
                    ),
                    "conditions": self._conditions(False),
                },
            ),
        )

    def _write(self, what: str, write: Callable[[], None]) -> None:
        """Make one write to the API server now, or once it is back if it is away.

        Writes wait in the order they were made, so that a pod's status goes through
        the same states as its process did (Running, then terminated); while one waits,
        every later one waits behind it.
        """
        if not self._unwritten:
            try:
                write()
                return
            except Exception as error:
                if not api_away(error):
                    raise
                logger.warning("the API server is away (%r); writes wait for it", error)
                self._retry_at = time.monotonic() + _RETRY_SECONDS
        self._unwritten.append((what, write))

    def _write_unwritten(self) -> None:
        """Write what waited for the API server, oldest first, until one fails again."""
        if not self._unwritten or time.monotonic() < self._retry_at:
            return
        while self._unwritten:
            what, write = self._unwritten[0]
            try:
                write()
            except Exception as error:
                if api_away(error):
                    self._retry_at = time.monotonic() + _RETRY_SECONDS
                    return
                logger.exception("%s: not written", what)
            else:
                logger.info("%s: written now that the API server is back", what)
            self._unwritten.popleft()

    def _read_pod(self, backed: BackedPod) -> Pod | None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        try:
            pod = client.CoreV1Api(self._api).read_namespaced_pod(backed.name, backed.namespace)
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        result: Pod = self._api.sanitize_for_serialization(pod)
        return result

    def _patch_status(self, backed: BackedPod, status: dict[str, Any]) -> None:
        """Strategic-merge-patch the status subresource (conditions merge by type)."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        body = {"metadata": {"uid": backed.uid}, "status": status}
        try:
            client.CoreV1Api(self._api).patch_namespaced_pod_status(
                backed.name,
                backed.namespace,
                body,
                _content_type="application/strategic-merge-patch+json",
            )
        except ApiException as error:
            if error.status in (404, 409):
                return
            if api_away(error):
                raise
            logger.warning("%s: status patch failed: %s", backed.key, error)

    def _patch_metadata(self, backed: BackedPod, metadata: dict[str, Any]) -> None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        body = {"metadata": {"uid": backed.uid, **metadata}}
        try:
            client.CoreV1Api(self._api).patch_namespaced_pod(
                backed.name,
                backed.namespace,
                body,
                _content_type="application/strategic-merge-patch+json",
            )
        except ApiException as error:
            if error.status in (404, 409):
                return
            if api_away(error):
                raise
            logger.warning("%s: metadata patch failed: %s", backed.key, error)

    # ------------------------------------------------------------- processes

    @staticmethod
    def _signal(backed: BackedPod, signum: int) -> None:
        if backed.process is None:
            return
        try:
            os.killpg(backed.process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def _forget_process(self, backed: BackedPod) -> None:
        """Drop the leftover record once the process is reaped."""
        record = self._layout.pods_dir / backed.namespace / backed.name / "process.json"
        record.unlink(missing_ok=True)
        shutil.rmtree(scratch_dir(backed.uid), ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python e2e/localcluster backer``."""
    parser = argparse.ArgumentParser(description="Run local processes behind backed KWOK pods.")
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--state-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    backer = PodBacker(args.kubeconfig, args.state_dir)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        backer.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    logger.info("watching pods labelled %s", BACKED_SELECTOR)
    backer.run()


if __name__ == "__main__":
    main()
