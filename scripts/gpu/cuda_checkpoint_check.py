#!/usr/bin/env python3
"""Exercise the CUDA checkpoint API on a GPU machine through sessionfleet's ctypes binding.

A child process allocates GPU memory (``cuMemAlloc``) and fills it with random bytes it
keeps a host copy of. This process then drives the child through the whole cycle with
:class:`sessionfleet.agent.cuda.CudaCheckpointApi` — lock, checkpoint (GPU memory
to host), restore (optionally onto another GPU, ``--remap``), unlock — checking the
process state after every call, and finally asks the child to copy its GPU memory back
and compare it with the host copy. It prints what it measured (each call's time, the
checkpoint's throughput, the child's GPU memory before and after per NVML) and a JSON
line, and exits 0 when every check passed, 1 when one failed, 2 when this machine has
no usable GPU or driver (the message says why).

Run it from the repository root with the project's virtual environment::

    .venv/bin/python scripts/gpu/cuda_checkpoint_check.py --mib 1024

Needs an NVIDIA driver ≥ 570 (``--remap``: ≥ 580 and two GPUs of the same type). CRIU
is not used: this checks the CUDA half of the ``criu`` driver (docs/checkpoints.md).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import subprocess
import sys
import time
import uuid
from typing import Any

NO_GPU = 2
FAILED = 1


# --- the child: holds GPU memory ----------------------------------------------------


def _cu(lib: ctypes.CDLL, name: str, *args: Any) -> None:
    code = getattr(lib, name)(*args)
    if code != 0:
        raise RuntimeError(f"{name} failed with CUresult {code}")


def _uuid_of(lib: ctypes.CDLL, device: int) -> str:
    raw = (ctypes.c_ubyte * 16)()
    _cu(lib, "cuDeviceGetUuid", raw, ctypes.c_int(device))
    return f"GPU-{uuid.UUID(bytes=bytes(raw))}"


def child(libcuda: str, size: int, device: int) -> int:
    """Allocate ``size`` bytes on ``device``, fill them, then answer commands on stdin."""
    lib = ctypes.CDLL(libcuda)
    lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    lib.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
    lib.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
    _cu(lib, "cuInit", ctypes.c_uint(0))
    handle = ctypes.c_int()
    _cu(lib, "cuDeviceGet", ctypes.byref(handle), ctypes.c_int(device))
    context = ctypes.c_void_p()
    _cu(lib, "cuDevicePrimaryCtxRetain", ctypes.byref(context), handle)
    _cu(lib, "cuCtxSetCurrent", context)
    pointer = ctypes.c_uint64()
    _cu(lib, "cuMemAlloc_v2", ctypes.byref(pointer), ctypes.c_size_t(size))
    pattern = os.urandom(size)
    host = ctypes.create_string_buffer(pattern, size)
    _cu(lib, "cuMemcpyHtoD_v2", pointer, host, ctypes.c_size_t(size))
    digest = hashlib.sha256(pattern).hexdigest()

    def say(message: dict[str, Any]) -> None:
        print(json.dumps(message), flush=True)

    say({"ready": os.getpid(), "device": _uuid_of(lib, handle.value), "sha256": digest})
    for line in sys.stdin:
        command = line.strip()
        if command == "verify":
            back = ctypes.create_string_buffer(size)
            _cu(lib, "cuMemcpyDtoH_v2", back, pointer, ctypes.c_size_t(size))
            current = ctypes.c_int()
            _cu(lib, "cuCtxGetDevice", ctypes.byref(current))
            say(
                {
                    "verify": back.raw == pattern,
                    "sha256": hashlib.sha256(back.raw).hexdigest(),
                    "device": _uuid_of(lib, current.value),
                }
            )
        elif command == "exit":
            return 0
    return 0


# --- the controller -----------------------------------------------------------------


class Checks:
    """Collects pass/fail lines and measurements."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.figures: dict[str, Any] = {}

    def expect(self, what: str, ok: bool, detail: str = "") -> None:
        """Print one check's line and remember a failure."""
        print(f"  [{'ok' if ok else 'FAIL'}] {what}" + (f" ({detail})" if detail else ""))
        if not ok:
            self.failures.append(what)


def nvml_process_memory(pid: int) -> int | None:
    """Return the bytes ``pid`` holds on any GPU per NVML; ``None`` without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no NVML: the figure is simply not measured
        return None
    try:
        total = 0
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if process.pid == pid and process.usedGpuMemory:
                    total += int(process.usedGpuMemory)
        return total
    finally:
        pynvml.nvmlShutdown()


def device_uuids(libcuda: str) -> list[str]:
    """Return the UUIDs of the GPUs this process sees."""
    lib = ctypes.CDLL(libcuda)
    count = ctypes.c_int()
    _cu(lib, "cuDeviceGetCount", ctypes.byref(count))
    found = []
    for ordinal in range(count.value):
        handle = ctypes.c_int()
        _cu(lib, "cuDeviceGet", ctypes.byref(handle), ctypes.c_int(ordinal))
        found.append(_uuid_of(lib, handle.value))
    return found


def timed(call: Any, *args: Any) -> float:
    """Run ``call`` and return its seconds."""
    started = time.perf_counter()
    call(*args)
    return time.perf_counter() - started


def controller(args: argparse.Namespace) -> int:
    """Drive a child through lock, checkpoint, restore and unlock; report."""
    try:
        from sessionfleet.agent.capability import assess, probe
        from sessionfleet.agent.cuda import (
            CudaCheckpointApi,
            CudaError,
            CudaUnavailable,
            ProcessState,
        )
    except ImportError as error:
        print(f"cannot import sessionfleet ({error}): run with the project's .venv/bin/python")
        return FAILED

    try:
        cuda = CudaCheckpointApi(args.libcuda)
        cuda.init()
        devices = device_uuids(args.libcuda)
    except (CudaUnavailable, CudaError, RuntimeError, OSError) as error:
        print(f"no usable GPU here, nothing to check: {error}")
        print("this script needs an NVIDIA GPU and driver >= 570 (see docs/checkpoints.md)")
        return NO_GPU
    if not devices:
        print("no usable GPU here, nothing to check: the driver reports no device")
        return NO_GPU
    capability = assess(probe(libcuda=args.libcuda))
    print(f"node: {capability.explain()}")
    print(f"driver {capability.driver_version}, CUDA {cuda.driver_version()}, GPUs {devices}")
    remap: list[tuple[str, str]] = []
    if args.remap:
        if len(devices) < 2:
            print("--remap needs two GPUs; restoring onto the same GPU")
        else:
            remap = [(devices[0], devices[1])]

    size = args.mib << 20
    checks = Checks()
    process = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--child", f"--libcuda={args.libcuda}"]
        + [f"--mib={args.mib}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdin is not None and process.stdout is not None

    def ask(command: str) -> dict[str, Any]:
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(command + "\n")
        process.stdin.flush()
        return dict(json.loads(process.stdout.readline()))

    try:
        ready = json.loads(process.stdout.readline() or "{}")
        pid = int(ready.get("ready", 0))
        checks.expect("the child allocated and filled GPU memory", pid > 0, f"{args.mib} MiB")
        if pid <= 0:
            return FAILED
        held_before = nvml_process_memory(pid)
        checks.expect("RUNNING before the lock", cuda.state(pid) is ProcessState.RUNNING)
        lock_s = timed(cuda.lock, pid, args.lock_timeout_ms)
        checks.expect(
            "LOCKED after cuCheckpointProcessLock", cuda.state(pid) is ProcessState.LOCKED
        )
        checkpoint_s = timed(cuda.checkpoint, pid)
        checks.expect(
            "CHECKPOINTED after cuCheckpointProcessCheckpoint",
            cuda.state(pid) is ProcessState.CHECKPOINTED,
        )
        held_checkpointed = nvml_process_memory(pid)
        if held_checkpointed is not None:
            checks.expect(
                "the checkpointed child holds no GPU memory",
                held_checkpointed == 0,
                f"{held_checkpointed} bytes per NVML",
            )
        restore_s = timed(cuda.restore, pid, remap)
        checks.expect(
            "LOCKED after cuCheckpointProcessRestore" + (" with GPU remap" if remap else ""),
            cuda.state(pid) is ProcessState.LOCKED,
        )
        unlock_s = timed(cuda.unlock, pid)
        checks.expect(
            "RUNNING after cuCheckpointProcessUnlock", cuda.state(pid) is ProcessState.RUNNING
        )
        verified = ask("verify")
        checks.expect(
            "GPU memory is intact after the cycle",
            bool(verified.get("verify")) and verified.get("sha256") == ready.get("sha256"),
        )
        if remap:
            checks.expect(
                "the child now runs on the second GPU",
                verified.get("device") == remap[0][1],
                str(verified.get("device")),
            )
        checks.figures = {
            "bytes": size,
            "lockSeconds": round(lock_s, 6),
            "checkpointSeconds": round(checkpoint_s, 6),
            "restoreSeconds": round(restore_s, 6),
            "unlockSeconds": round(unlock_s, 6),
            "checkpointGiBPerSecond": round(size / (1 << 30) / checkpoint_s, 3)
            if checkpoint_s
            else None,
            "restoreGiBPerSecond": round(size / (1 << 30) / restore_s, 3) if restore_s else None,
            "nvmlBytesBefore": held_before,
            "nvmlBytesCheckpointed": held_checkpointed,
            "remapped": bool(remap),
            "driver": capability.driver_version,
        }
        print(
            f"lock {lock_s * 1e3:.1f} ms, checkpoint {checkpoint_s * 1e3:.1f} ms, "
            f"restore {restore_s * 1e3:.1f} ms, unlock {unlock_s * 1e3:.1f} ms "
            f"for {args.mib} MiB"
        )
    except CudaError as error:
        checks.expect("every CUDA call succeeded", False, str(error))
    finally:
        if process.poll() is None:
            try:
                process.stdin.write("exit\n")
                process.stdin.flush()
                process.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                process.kill()  # it may be stuck locked after a failed call
                process.wait()
    print(json.dumps({"ok": not checks.failures, "failures": checks.failures, **checks.figures}))
    return FAILED if checks.failures else 0


def main(argv: list[str] | None = None) -> int:
    """Parse the flags and run as the controller, or as the child."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512, help="GPU memory to hold (default: 512)")
    parser.add_argument("--libcuda", default="libcuda.so.1", help="the driver library")
    parser.add_argument(
        "--lock-timeout-ms", type=int, default=10_000, help="lock timeout (default: 10000)"
    )
    parser.add_argument(
        "--remap", action="store_true", help="restore onto the second GPU (driver >= 580)"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--device", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.libcuda, args.mib << 20, args.device)
    return controller(args)


if __name__ == "__main__":
    raise SystemExit(main())
