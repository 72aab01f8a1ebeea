"""In-memory stand-ins for the criu driver's three interfaces: CUDA, CRIU, the engine.

A GPU and CRIU cannot run on these machines, so the executor is tested against these
(docs/checkpoints.md). They keep the state the real parts would and check the order:
the CRIU fake refuses to dump a process whose GPU memory is still on the device, as the
real dump would capture a process holding device handles.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from sessionfleet.agent.cuda import CudaError, ProcessState


class FakeCuda:
    """Per-PID CUDA checkpoint state with the driver's transitions."""

    def __init__(self) -> None:
        self.states: dict[int, ProcessState] = {}
        self.calls: list[tuple[str, int]] = []
        self.fail: dict[str, str] = {}
        """Call name → message: that call raises once."""
        self.lie: set[str] = set()
        """Calls that report success but change nothing (a driver bug)."""
        self.pairs: list[tuple[str, str]] = []
        self.timeouts: list[int] = []

    def _now(self, pid: int) -> ProcessState:
        return self.states.setdefault(pid, ProcessState.RUNNING)

    def _call(self, name: str, pid: int, need: ProcessState, then: ProcessState) -> None:
        self.calls.append((name, pid))
        if name in self.fail:
            raise CudaError(name, 1, self.fail.pop(name), pid)
        if self._now(pid) is not need:
            raise CudaError(name, 401, "CUDA_ERROR_ILLEGAL_STATE", pid)
        if name not in self.lie:
            self.states[pid] = then

    def state(self, pid: int) -> ProcessState:
        return self._now(pid)

    def lock(self, pid: int, timeout_ms: int) -> None:
        self.timeouts.append(timeout_ms)
        self._call("lock", pid, ProcessState.RUNNING, ProcessState.LOCKED)

    def checkpoint(self, pid: int) -> None:
        self._call("checkpoint", pid, ProcessState.LOCKED, ProcessState.CHECKPOINTED)

    def restore(self, pid: int, gpu_pairs: Sequence[tuple[str, str]] = ()) -> None:
        self.pairs = list(gpu_pairs)
        self._call("restore", pid, ProcessState.CHECKPOINTED, ProcessState.LOCKED)

    def unlock(self, pid: int) -> None:
        self._call("unlock", pid, ProcessState.LOCKED, ProcessState.RUNNING)


class FakeCriu:
    """Writes image files on dump, hands out a PID on restore."""

    def __init__(self, cuda: FakeCuda | None = None, restored_pid: int = 777) -> None:
        self.cuda = cuda
        self.restored_pid = restored_pid
        self.fail: dict[str, str] = {}
        self.dumps: list[tuple[int, Path, bool]] = []
        self.restores: list[Path] = []
        self.ended: set[int] = set()
        self.during_dump: list[object] = []
        self.on_dump: object = None

    async def dump(self, pid: int, images: Path, *, leave_running: bool) -> int:
        self.dumps.append((pid, images, leave_running))
        if callable(self.on_dump):
            self.during_dump.append(await self.on_dump())
        if "dump" in self.fail:
            raise RuntimeError(self.fail.pop("dump"))
        if self.cuda is not None and self.cuda.state(pid) is not ProcessState.CHECKPOINTED:
            raise RuntimeError(f"CRIU would dump device handles: pid {pid} is not checkpointed")
        images.mkdir(parents=True, exist_ok=True)
        (images / "pages-1.img").write_bytes(b"\0" * 4096)
        (images / "core-1.img").write_bytes(b"\1" * 100)
        if not leave_running:
            self.ended.add(pid)
        return 4196

    async def restore(self, images: Path) -> int:
        self.restores.append(images)
        if "restore" in self.fail:
            raise RuntimeError(self.fail.pop("restore"))
        if self.cuda is not None:
            # A restored process comes back with its GPU memory in host memory.
            self.cuda.states[self.restored_pid] = ProcessState.CHECKPOINTED
        return self.restored_pid


class FakeEngine:
    """Records pauses and resumes."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.fail: dict[str, str] = {}
        self.paused = False

    async def pause(self) -> None:
        self.calls.append("pause")
        if "pause" in self.fail:
            raise RuntimeError(self.fail.pop("pause"))
        self.paused = True

    async def resume(self) -> None:
        self.calls.append("resume")
        if "resume" in self.fail:
            raise RuntimeError(self.fail.pop("resume"))
        self.paused = False


class Killer:
    """Records the PIDs it would have killed."""

    def __init__(self) -> None:
        self.killed: list[int] = []

    def __call__(self, pid: int) -> None:
        self.killed.append(pid)
