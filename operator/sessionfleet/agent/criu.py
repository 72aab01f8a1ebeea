"""The node half of the ``criu`` driver: checkpoint a GPU process with the CUDA API and CRIU.

The agent (``sessionfleet agent``) runs :class:`NodeCheckpointer`: it refuses with the
node's reasons when :mod:`.capability` says no, finds the engine's process, and walks
the state machine of :mod:`.criu_machine` with an executor (:class:`ProcessCheckpointer`)
that performs each action through three small interfaces — :class:`CudaControl`
(``cuCheckpointProcess*`` through ctypes, :mod:`.cuda`), :class:`CriuRunner` (the
``criu`` command) and :class:`EngineControl` (the engine's ``/pause?mode=keep`` and
``/resume``). The operator's half, :class:`~sessionfleet.operator.drivers.criu.CriuDriver`,
asks this agent over HTTPS (``POST /checkpoint``, ``POST /restore``).

The order matters: the engine is paused first (``mode=keep``: in-flight requests freeze
between steps and the KV cache stays), the CUDA API then moves GPU memory to host memory
(it does not stop CPU threads), and CRIU dumps the process last. CRIU's CUDA plugin
skips a process it finds already CHECKPOINTED and leaves it in that state, so the images
hold the host copy of the GPU memory, and a restored process comes back CHECKPOINTED for
the executor to restore and unlock. None of this has run on a GPU here; see
docs/checkpoints.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import stat
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx

from sessionfleet.agent.capability import MIN_DRIVER_REMAP, Capability
from sessionfleet.agent.criu_machine import (
    SUCCEEDED,
    Action,
    Operation,
    Outcome,
    Phase,
    State,
    Step,
    start,
    step,
)
from sessionfleet.agent.cuda import ProcessState, uuid_bytes
from sessionfleet.checkpoint.agent_api import (
    DEFAULT_LOCK_TIMEOUT_MS,
    METADATA_FILE,
    NAMESPACE_NAME,
)
from sessionfleet.checkpoint.driver import (
    DriverUnavailable,
)
from sessionfleet.checkpoint.paths import checked_path

log = logging.getLogger(__name__)


# --- the three interfaces the executor acts through -------------------------------------


class CudaControl(Protocol):
    """The CUDA checkpoint calls on another process; blocking, run in a thread."""

    def state(self, pid: int) -> ProcessState:
        """Return the process's checkpoint state."""
        ...

    def lock(self, pid: int, timeout_ms: int) -> None:
        """Lock it (RUNNING → LOCKED); a timeout leaves the process RUNNING."""
        ...

    def checkpoint(self, pid: int) -> None:
        """Move device memory to host memory (LOCKED → CHECKPOINTED)."""
        ...

    def restore(self, pid: int, gpu_pairs: Sequence[tuple[str, str]] = ()) -> None:
        """Move memory back to the device (CHECKPOINTED → LOCKED), remapping GPUs by UUID."""
        ...

    def unlock(self, pid: int) -> None:
        """Unlock it (LOCKED → RUNNING)."""
        ...


class CriuRunner(Protocol):
    """CRIU, dumping and restoring a process tree."""

    async def dump(self, pid: int, images: Path, *, leave_running: bool) -> int:
        """Dump the tree rooted at ``pid`` into ``images``; return the bytes written."""
        ...

    async def restore(self, images: Path) -> int:
        """Restore the tree saved in ``images``; return its root's PID."""
        ...


class EngineControl(Protocol):
    """The engine's quiesce endpoints."""

    async def pause(self) -> None:
        """Hold new and in-flight requests, keeping the KV cache."""
        ...

    async def resume(self) -> None:
        """Serve again."""
        ...


class CriuError(Exception):
    """A ``criu`` run failed; the message carries the end of its log."""


class EngineError(Exception):
    """The engine refused or did not answer a pause or resume."""


# --- real implementations -----------------------------------------------------------

DUMP_OPTIONS = ("--tcp-established", "--ext-unix-sk", "--file-locks", "--link-remap")
"""Dump clients' open connections and the engine's sockets, locks and unlinked files."""
RESTORE_OPTIONS = ("--tcp-close", "--ext-unix-sk", "--file-locks", "--link-remap")
"""Restore connections closed: their peers are gone, or see another address, by now."""


class CriuCli:
    """Runs the ``criu`` command without blocking the event loop."""

    def __init__(
        self,
        criu: str = "criu",
        *,
        timeout: float = 900.0,
        dump_options: Sequence[str] = DUMP_OPTIONS,
        restore_options: Sequence[str] = RESTORE_OPTIONS,
    ) -> None:
        self.criu = criu
        self.timeout = timeout
        self.dump_options = tuple(dump_options)
        self.restore_options = tuple(restore_options)

    def dump_argv(self, pid: int, images: Path, *, leave_running: bool) -> list[str]:
        """Return the ``criu dump`` command line."""
        argv = [self.criu, "dump", "--tree", str(pid), "--images-dir", str(images)]
        argv += ["--log-file", "dump.log", "-v4", *self.dump_options]
        return argv + (["--leave-running"] if leave_running else [])

    def restore_argv(self, images: Path, pidfile: Path) -> list[str]:
        """Return the ``criu restore`` command line (detached: the agent is not its parent)."""
        argv = [self.criu, "restore", "--images-dir", str(images), "--restore-detached"]
        return (
            argv
            + ["--pidfile", str(pidfile), "--log-file", "restore.log", "-v4"]
            + list(self.restore_options)
        )

    async def _run(self, argv: list[str], log_file: Path) -> None:
        try:
            process = await asyncio.create_subprocess_exec(
                *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
            )
        except OSError as error:
            raise CriuError(f"cannot run {argv[0]}: {error}") from error
        try:
            output, _ = await asyncio.wait_for(process.communicate(), self.timeout)
        except TimeoutError:
            process.kill()
            await process.wait()
            raise CriuError(f"criu {argv[1]} timed out after {self.timeout:g} s") from None
        if process.returncode != 0:
            tail = await asyncio.to_thread(_log_tail, log_file)
            said = output.decode(errors="replace").strip()[-500:]
            raise CriuError(
                f"criu {argv[1]} exited {process.returncode}: {tail or said or 'no output'}"
            )

    async def dump(self, pid: int, images: Path, *, leave_running: bool) -> int:
        """Dump the process tree; return the images' size in bytes."""
        await asyncio.to_thread(images.mkdir, parents=True, exist_ok=True)
        await self._run(
            self.dump_argv(pid, images, leave_running=leave_running), images / "dump.log"
        )
        return await asyncio.to_thread(directory_bytes, images)

    async def restore(self, images: Path) -> int:
        """Restore the process tree; return its root's PID."""
        pidfile = images / "restored.pid"
        await asyncio.to_thread(pidfile.unlink, missing_ok=True)
        await self._run(self.restore_argv(images, pidfile), images / "restore.log")
        text = await asyncio.to_thread(_read_no_link, pidfile, 64)
        return int(text.strip())


def _read_no_link(path: Path, limit: int) -> str:
    """Return up to ``limit`` bytes of ``path``, refusing a symlink planted in its place."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with open(descriptor, encoding="utf-8", errors="replace") as file:
        return file.read(limit)


MAX_LOG_BYTES = 1 << 20
"""The end of a CRIU log that is read for its errors."""


def _log_tail(path: Path, lines: int = 5) -> str:
    """Return the last error lines of a CRIU log (its ``Error`` lines, else its end)."""
    try:
        size = os.stat(path, follow_symlinks=False).st_size
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with open(descriptor, "rb") as file:
            file.seek(max(0, size - MAX_LOG_BYTES))
            text = file.read(MAX_LOG_BYTES).decode(errors="replace")
    except OSError:
        return ""
    kept = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in kept if "Error" in line or "error" in line]
    return " / ".join((errors or kept)[-lines:])


def directory_bytes(path: Path) -> int:
    """Return the total size of the regular files under ``path``, never following a link."""
    total = 0
    # fwalk descends through descriptors: a directory swapped for a link meanwhile is
    # not followed out of the tree.
    for _, _, files, directory in os.fwalk(path, follow_symlinks=False):
        for name in files:
            found = os.stat(name, dir_fd=directory, follow_symlinks=False)
            if stat.S_ISREG(found.st_mode):
                total += found.st_size
    return total


class HttpEngine:
    """Pauses and resumes an engine over HTTP (vLLM's and the simulated engine's API)."""

    def __init__(self, http: httpx.AsyncClient, endpoint: str, timeout: float = 30.0) -> None:
        self.http = http
        self.endpoint = endpoint.rstrip("/")
        self.timeout = timeout

    async def _post(self, path: str, params: Mapping[str, str] | None = None) -> None:
        url = f"{self.endpoint}{path}"
        try:
            response = await self.http.post(url, params=params, timeout=self.timeout)
        except httpx.HTTPError as error:
            raise EngineError(f"engine at {self.endpoint} unreachable: {error!r}") from error
        if response.is_error:
            raise EngineError(f"POST {url} answered {response.status_code}: {response.text[:300]}")

    async def pause(self) -> None:
        """``POST /pause?mode=keep``: in-flight requests freeze, the KV cache stays."""
        await self._post("/pause", {"mode": "keep"})

    async def resume(self) -> None:
        """``POST /resume``."""
        await self._post("/resume")


def kill_process(pid: int) -> None:
    """SIGKILL ``pid``; a process already gone is fine."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# --- the executor -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One performed action."""

    action: Action
    ok: bool
    seconds: float
    detail: str = ""


@dataclass
class Run:
    """What one checkpoint or restore did."""

    operation: Operation
    phase: Phase
    pid: int | None
    images: Path
    error: str = ""
    size_bytes: int = 0
    seconds: float = 0.0
    steps: list[StepRecord] = field(default_factory=list)
    gpus: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """Whether the machine ended in success (Resumed or Stopped)."""
        return self.phase in SUCCEEDED

    def to_json(self) -> dict[str, Any]:
        """Return the agent's answer."""
        return {
            "operation": self.operation.value,
            "phase": self.phase.value,
            "ok": self.ok,
            "pid": self.pid,
            "imagesDir": str(self.images),
            "error": self.error,
            "sizeBytes": self.size_bytes,
            "seconds": round(self.seconds, 6),
            "gpus": list(self.gpus),
            "steps": [
                {
                    "action": s.action.value,
                    "ok": s.ok,
                    "seconds": round(s.seconds, 6),
                    **({"detail": s.detail} if s.detail else {}),
                }
                for s in self.steps
            ],
        }


class ProcessCheckpointer:
    """Performs the state machine's actions on one process through the three interfaces."""

    def __init__(
        self,
        cuda: CudaControl,
        criu: CriuRunner,
        engine: EngineControl,
        *,
        kill: Callable[[int], None] = kill_process,
        lock_timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cuda = cuda
        self.criu = criu
        self.engine = engine
        self.kill = kill
        self.lock_timeout_ms = lock_timeout_ms
        self.clock = clock

    async def checkpoint(self, pid: int, images: Path, *, leave_running: bool = True) -> Run:
        """Pause, lock, checkpoint GPU memory, dump; then resume unless ``leave_running`` is off."""
        run = Run(Operation.CHECKPOINT, Phase.RUNNING, pid, images)
        return await self._drive(run, start(Operation.CHECKPOINT, leave_running=leave_running), ())

    async def restore(self, images: Path, gpu_pairs: Sequence[tuple[str, str]] = ()) -> Run:
        """CRIU restore, GPU memory back (remapped), unlock, resume."""
        run = Run(Operation.RESTORE, Phase.IMAGES, None, images)
        return await self._drive(run, start(Operation.RESTORE), gpu_pairs)

    async def _drive(self, run: Run, first: Step, gpu_pairs: Sequence[tuple[str, str]]) -> Run:
        began = self.clock()
        state: State = first.state
        actions: tuple[Action, ...] = first.actions
        while not state.done:
            outcome = await self._perform_all(run, state, actions, gpu_pairs)
            following = step(state, outcome)
            state, actions = following.state, following.actions
        run.phase, run.error = state.phase, state.error
        run.seconds = self.clock() - began
        if not run.ok:
            log.warning("%s of pid %s ended %s: %s", run.operation, run.pid, run.phase, run.error)
        return run

    async def _perform_all(
        self,
        run: Run,
        state: State,
        actions: tuple[Action, ...],
        gpu_pairs: Sequence[tuple[str, str]],
    ) -> Outcome:
        for action in actions:
            began = self.clock()
            try:
                await self._perform(run, state, action, gpu_pairs)
            # Any failure, whatever its type, must reach the machine: an exception that
            # escaped here would leave the process paused or locked with nobody to undo.
            except Exception as error:
                detail = str(error) or repr(error)
                run.steps.append(StepRecord(action, False, self.clock() - began, detail))
                return Outcome(False, detail)
            run.steps.append(StepRecord(action, True, self.clock() - began))
        return Outcome(True)

    def _expect(self, pid: int, wanted: ProcessState, after: str) -> None:
        found = self.cuda.state(pid)
        if found is not wanted:
            raise RuntimeError(f"after {after} the process is {found.name}, not {wanted.name}")

    def _lock(self, pid: int) -> None:
        self.cuda.lock(pid, self.lock_timeout_ms)
        self._expect(pid, ProcessState.LOCKED, "cuCheckpointProcessLock")

    def _checkpoint(self, pid: int) -> None:
        self.cuda.checkpoint(pid)
        self._expect(pid, ProcessState.CHECKPOINTED, "cuCheckpointProcessCheckpoint")

    def _restore_gpu(self, pid: int, pairs: Sequence[tuple[str, str]], undoing: bool) -> None:
        found = self.cuda.state(pid)
        if found is ProcessState.LOCKED and undoing:
            return  # the checkpoint failed before memory left the device
        if found is not ProcessState.CHECKPOINTED:
            raise RuntimeError(f"cannot restore GPU memory of a {found.name} process")
        self.cuda.restore(pid, pairs)
        self._expect(pid, ProcessState.LOCKED, "cuCheckpointProcessRestore")

    def _unlock(self, pid: int, undoing: bool) -> None:
        found = self.cuda.state(pid)
        if found is ProcessState.RUNNING and undoing:
            return  # the lock timed out and left the process running
        if found is not ProcessState.LOCKED:
            raise RuntimeError(f"cannot unlock a {found.name} process")
        self.cuda.unlock(pid)
        self._expect(pid, ProcessState.RUNNING, "cuCheckpointProcessUnlock")

    async def _perform(
        self, run: Run, state: State, action: Action, gpu_pairs: Sequence[tuple[str, str]]
    ) -> None:
        pid = run.pid
        if action is Action.PAUSE_ENGINE:
            await self.engine.pause()
        elif action is Action.RESUME_ENGINE:
            await self.engine.resume()
        elif action is Action.CRIU_RESTORE:
            run.pid = await self.criu.restore(run.images)
        elif action is Action.KILL:
            if pid is not None:
                await asyncio.to_thread(self.kill, pid)
        elif pid is None:
            raise RuntimeError(f"{action.value} needs a process and there is none")
        elif action is Action.DUMP:
            leave_running = state.leave_running
            run.size_bytes = await self.criu.dump(pid, run.images, leave_running=leave_running)
        elif action is Action.LOCK:
            await asyncio.to_thread(self._lock, pid)
        elif action is Action.CHECKPOINT_GPU:
            await asyncio.to_thread(self._checkpoint, pid)
        elif action is Action.RESTORE_GPU:
            await asyncio.to_thread(self._restore_gpu, pid, gpu_pairs, state.undoing)
        elif action is Action.UNLOCK:
            await asyncio.to_thread(self._unlock, pid, state.undoing)


# --- the node side: what the agent's endpoints call ---------------------------------


def gpu_pairs(saved: Sequence[str], target: Sequence[str]) -> list[tuple[str, str]]:
    """Return the ``(old, new)`` GPU UUID pairs that move a process onto ``target``.

    Empty when no target is named or the GPUs are the same; positional otherwise, and
    only the GPUs that change. The process must land on as many GPUs as it used.
    """
    if not target:
        return []
    if len(saved) != len(target):
        raise ValueError(
            f"the checkpoint used {len(saved)} GPU(s) and the restore names {len(target)}"
        )
    return [(old, new) for old, new in zip(saved, target, strict=True) if old != new]


MAX_LOCK_TIMEOUT_SECONDS = 600.0
"""The longest lock a request may ask for: the engine's requests are frozen meanwhile."""
MIN_LOCK_TIMEOUT_SECONDS = 0.001
"""The shortest: the CUDA API takes a timeout of 0 ms as no timeout at all."""
MAX_ENDPOINT_CHARS = 2048
MAX_GPUS = 64
"""More GPU UUIDs than any node has."""

_POD_UID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$", re.I)
# What a pod status's containerID holds: a runtime scheme and the 64 hex digits that the
# container's cgroup names (agent.cgroups), so nothing else could match a process anyway.
_CONTAINER_ID = re.compile(r"^(?:[a-z][a-z0-9+.-]{0,31}://)?[0-9a-f]{64}$", re.I)
_NAME_THE_CONTAINER = "podUID and containerID must name the engine's container"


@dataclass(frozen=True, slots=True)
class CheckpointRequest:
    """The body of the agent's ``POST /checkpoint``.

    The process is named by its pod's UID and its container's runtime ID, never by a
    raw PID: the agent acts only on containers of pods, found through their cgroups.
    ``images_dir`` is checked lexically here (absolute, no ``..``); the agent then
    opens it inside ``<storage root>/<namespace>/`` without following a link
    (:func:`sessionfleet.checkpoint.paths.open_confined`).
    """

    images_dir: Path
    endpoint: str
    pod_uid: str
    container_id: str
    namespace: str = ""
    """The worker's namespace: the images must lie in its tree of the storage root."""
    leave_running: bool = True
    lock_timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> CheckpointRequest:
        """Parse and check a request; :class:`ValueError` says what is wrong."""
        images, endpoint, namespace = _location_and_endpoint(body)
        uid, container = body.get("podUID"), body.get("containerID")
        if not isinstance(uid, str) or not _POD_UID.match(uid):
            raise ValueError(f"{_NAME_THE_CONTAINER}: podUID is not a pod's UID")
        if not isinstance(container, str) or not _CONTAINER_ID.match(container):
            raise ValueError(
                f"{_NAME_THE_CONTAINER}: containerID is not <runtime>://<64 hex digits>"
            )
        timeout = body.get("lockTimeoutSeconds", DEFAULT_LOCK_TIMEOUT_MS / 1000)
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not MIN_LOCK_TIMEOUT_SECONDS <= timeout <= MAX_LOCK_TIMEOUT_SECONDS
        ):
            raise ValueError(
                f"lockTimeoutSeconds must be a number of seconds from "
                f"{MIN_LOCK_TIMEOUT_SECONDS:g} to {MAX_LOCK_TIMEOUT_SECONDS:g}"
            )
        leave_running = body.get("leaveRunning", True)
        if not isinstance(leave_running, bool):
            raise ValueError("leaveRunning must be true or false")
        return cls(
            images_dir=images,
            endpoint=endpoint,
            namespace=namespace,
            pod_uid=uid,
            container_id=container,
            leave_running=leave_running,
            lock_timeout_ms=round(timeout * 1000),
        )


def _location_and_endpoint(body: Mapping[str, Any]) -> tuple[Path, str, str]:
    images = Path(checked_path(body.get("imagesDir"), "imagesDir"))
    endpoint = body.get("endpoint")
    if not isinstance(endpoint, str) or not _is_http_url(endpoint):
        raise ValueError(
            f"endpoint must be the engine's http:// URL of at most {MAX_ENDPOINT_CHARS} characters"
        )
    namespace = body.get("namespace")
    if not isinstance(namespace, str) or not NAMESPACE_NAME.match(namespace):
        raise ValueError("namespace must be the worker's namespace (a DNS label)")
    return images, endpoint, namespace


def _is_http_url(text: str) -> bool:
    if len(text) > MAX_ENDPOINT_CHARS:
        return False
    try:
        url = urlsplit(text)
        return url.scheme in ("http", "https") and bool(url.hostname) and url.port != 0
    except ValueError:  # a port out of range, a bad IPv6 literal
        return False


@dataclass(frozen=True, slots=True)
class RestoreRequest:
    """The body of the agent's ``POST /restore``."""

    images_dir: Path
    endpoint: str
    gpus: tuple[str, ...] = ()
    """The GPUs to restore onto (UUIDs); empty: the ones the process used."""
    namespace: str = ""
    """The worker's namespace: the images must lie in its tree of the storage root."""

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> RestoreRequest:
        """Parse and check a request; :class:`ValueError` says what is wrong."""
        images, endpoint, namespace = _location_and_endpoint(body)
        gpus = body.get("gpus") or []
        if (
            not isinstance(gpus, list)
            or len(gpus) > MAX_GPUS
            or not all(isinstance(g, str) for g in gpus)
        ):
            raise ValueError(f"gpus must be a list of at most {MAX_GPUS} GPU UUIDs")
        for gpu in gpus:
            # Checked now: a bad UUID found after CRIU restored the process would leave
            # it locked, and the agent would have to kill it.
            uuid_bytes(gpu)
        return cls(images_dir=images, endpoint=endpoint, gpus=tuple(gpus), namespace=namespace)


class Busy(Exception):
    """Another checkpoint or restore of the same process is running."""


class NodeCheckpointer:
    """The agent's checkpoint service: capability first, then the executor.

    Everything node-specific is injected, so the agent wires the real parts and tests
    wire fakes for the GPU and CRIU: ``capability`` (cached by the caller as it likes),
    ``make_cuda`` (called in a thread: loading libcuda blocks), ``find_pid`` (pod UID
    and container ID to the container's root PID), ``gpus_of`` (a PID's GPU UUIDs).
    """

    def __init__(
        self,
        *,
        node: str,
        capability: Callable[[], Awaitable[Capability]],
        make_cuda: Callable[[], CudaControl],
        criu: CriuRunner,
        engine_for: Callable[[str], EngineControl],
        find_pid: Callable[[str, str], int],
        gpus_of: Callable[[int], list[str]],
        kill: Callable[[int], None] = kill_process,
    ) -> None:
        self.node = node
        self.capability = capability
        self.make_cuda = make_cuda
        self.criu = criu
        self.engine_for = engine_for
        self.find_pid = find_pid
        self.gpus_of = gpus_of
        self.kill = kill
        self._busy: set[str] = set()

    async def _ready(self) -> Capability:
        capability = await self.capability()
        if not capability.ok:
            raise DriverUnavailable(capability.explain())
        return capability

    def _claim(self, key: str, what: str | None = None) -> None:
        if key in self._busy:
            raise Busy(f"a checkpoint or restore of {what or key} is already running")
        self._busy.add(key)

    async def checkpoint(self, request: CheckpointRequest) -> Run:
        """Checkpoint the named process into ``request.images_dir``."""
        await self._ready()
        pid = await asyncio.to_thread(self.find_pid, request.pod_uid, request.container_id)
        key = f"pid {pid}"
        self._claim(key)
        try:
            gpus = await asyncio.to_thread(self.gpus_of, pid)
            cuda = await asyncio.to_thread(self.make_cuda)
            executor = ProcessCheckpointer(
                cuda,
                self.criu,
                self.engine_for(request.endpoint),
                kill=self.kill,
                lock_timeout_ms=request.lock_timeout_ms,
            )
            run = await executor.checkpoint(
                pid, request.images_dir, leave_running=request.leave_running
            )
            run.gpus = tuple(gpus)
            if run.ok:
                await asyncio.to_thread(self._write_metadata, run)
            return run
        finally:
            self._busy.discard(key)

    def _write_metadata(self, run: Run) -> None:
        meta = {
            "pid": run.pid,
            "gpus": list(run.gpus),
            "node": self.node,
            "createdAt": datetime.now(UTC).isoformat(),
            "sizeBytes": run.size_bytes,
        }
        write_file_replacing(run.images / METADATA_FILE, json.dumps(meta, indent=2) + "\n")

    async def restore(self, request: RestoreRequest) -> Run:
        """Restore the process saved in ``request.images_dir`` onto this node's GPUs."""
        capability = await self._ready()
        meta = await asyncio.to_thread(read_metadata, request.images_dir)
        pairs = gpu_pairs(meta.get("gpus") or [], request.gpus)
        if pairs and not capability.can_remap_gpus:
            raise DriverUnavailable(
                f"restoring onto other GPUs needs NVIDIA driver ≥ {MIN_DRIVER_REMAP}; "
                f"this node has {capability.driver_version}"
            )
        # By the directory's identity: the agent names it through a descriptor of its
        # own (ConfinedDirectory.handle), a different path for every request.
        found = await asyncio.to_thread(os.stat, request.images_dir)
        key = f"images {found.st_dev}:{found.st_ino}"
        self._claim(key, "these images")
        try:
            cuda = await asyncio.to_thread(self.make_cuda)
            executor = ProcessCheckpointer(
                cuda, self.criu, self.engine_for(request.endpoint), kill=self.kill
            )
            run = await executor.restore(request.images_dir, pairs)
            run.gpus = tuple(request.gpus or meta.get("gpus") or ())
            return run
        finally:
            self._busy.discard(key)


MAX_METADATA_BYTES = 1 << 16
"""More than a metadata file ever holds; a larger one is read no further (and fails)."""


def write_file_replacing(path: Path, text: str) -> None:
    """Write ``path`` through a new file renamed over it.

    The agent runs as root: writing to ``path`` directly would follow a symlink planted
    there and overwrite whatever it points at. A rename replaces the link itself.
    """
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(descriptor, 0o644)  # as a plain write would leave it (mkstemp: 0600)
        with open(descriptor, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def read_metadata(images: Path) -> dict[str, Any]:
    """Return the metadata a checkpoint wrote; :class:`LookupError` when there is none."""
    path = images / METADATA_FILE
    try:
        # Not through a symlink: one planted in the images could make the agent (root)
        # read any file of the node.
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with open(descriptor, encoding="utf-8") as file:
            meta = json.loads(file.read(MAX_METADATA_BYTES))
    except FileNotFoundError as error:
        raise LookupError(f"no checkpoint at {images} ({METADATA_FILE} is missing)") from error
    except (OSError, ValueError) as error:
        raise ValueError(f"unreadable {path}: {error}") from error
    if not isinstance(meta, dict):
        raise ValueError(f"{path} is not a JSON object")
    return meta
