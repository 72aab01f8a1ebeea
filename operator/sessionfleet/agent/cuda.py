"""The CUDA driver's process checkpoint API, called through ctypes on ``libcuda.so.1``.

A controller process (the node agent) drives another process's CUDA state with five
calls, all keyed by the target's host PID (NVIDIA CUDA Driver API, "CUDA Checkpointing"):

- ``cuCheckpointProcessLock`` (RUNNING → LOCKED): further CUDA calls in the target
  block; with a timeout the process is left RUNNING when it expires;
- ``cuCheckpointProcessCheckpoint`` (LOCKED → CHECKPOINTED): device memory is copied to
  host memory and the device handles are released, so CRIU can dump the process;
- ``cuCheckpointProcessRestore`` (CHECKPOINTED → LOCKED): device memory is copied back,
  optionally onto other GPUs (pairs of GPU UUIDs; driver r580 and later);
- ``cuCheckpointProcessUnlock`` (LOCKED → RUNNING);
- ``cuCheckpointProcessGetState``.

The API is in drivers from r570. Every call here blocks (a lock waits up to its
timeout, a checkpoint copies the GPU's memory), so asynchronous callers run them in a
thread. The argument structures are declared from the driver API reference
(``CUcheckpointLockArgs`` and friends: 64 bytes each, mostly reserved and zeroed).
"""

from __future__ import annotations

import ctypes
import enum
import threading
import uuid
from collections.abc import Sequence

LIBCUDA = "libcuda.so.1"
"""The driver library's soname, installed with the NVIDIA driver (not the toolkit)."""

CHECKPOINT_SYMBOLS = (
    "cuCheckpointProcessGetState",
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
)

CUDA_SUCCESS = 0

# Names for the results these calls return, used only when the library cannot name a
# code itself (cuGetErrorName failed, or the library is not loaded).
_KNOWN_RESULTS = {
    1: "CUDA_ERROR_INVALID_VALUE",
    3: "CUDA_ERROR_NOT_INITIALIZED",
    4: "CUDA_ERROR_DEINITIALIZED",
    100: "CUDA_ERROR_NO_DEVICE",
    101: "CUDA_ERROR_INVALID_DEVICE",
    304: "CUDA_ERROR_OPERATING_SYSTEM",
    401: "CUDA_ERROR_ILLEGAL_STATE",
    500: "CUDA_ERROR_NOT_FOUND",
    600: "CUDA_ERROR_NOT_READY",
    801: "CUDA_ERROR_NOT_SUPPORTED",
    909: "CUDA_ERROR_TIMEOUT",
    999: "CUDA_ERROR_UNKNOWN",
}

# What an operator should make of the results a checkpoint call commonly returns.
_HINTS = {
    "CUDA_ERROR_NOT_INITIALIZED": "cuInit has not succeeded in the calling process",
    "CUDA_ERROR_NO_DEVICE": "the calling process sees no GPU (NVIDIA_VISIBLE_DEVICES?)",
    "CUDA_ERROR_INVALID_VALUE": "no CUDA process with that PID, or a malformed argument",
    "CUDA_ERROR_ILLEGAL_STATE": "the process is not in the state this call needs",
    "CUDA_ERROR_NOT_SUPPORTED": "the driver or the process's CUDA use does not support it",
    "CUDA_ERROR_TIMEOUT": "the lock timed out; the process was left RUNNING",
    "CUDA_ERROR_NOT_READY": "the process has not finished initialising CUDA",
}


class ProcessState(enum.IntEnum):
    """``CUprocessState``: where a process stands in the checkpoint cycle."""

    RUNNING = 0
    """The default: CUDA calls proceed."""
    LOCKED = 1
    """CUDA calls block until unlocked."""
    CHECKPOINTED = 2
    """Device memory is in host memory and device handles are released."""
    FAILED = 3
    """An uncorrectable error during checkpoint or restore: the process is lost."""


class CudaUnavailable(Exception):
    """The driver library is missing, or too old to have the checkpoint API."""


class CudaError(Exception):
    """A CUDA call returned an error; ``name`` is the ``CUresult`` name."""

    def __init__(self, call: str, code: int, name: str, pid: int | None = None) -> None:
        hint = _HINTS.get(name)
        target = f" on pid {pid}" if pid is not None else ""
        super().__init__(f"{call}{target} failed: {name} ({code})" + (f": {hint}" if hint else ""))
        self.call = call
        self.code = code
        self.name = name
        self.pid = pid


class CUuuid(ctypes.Structure):
    """``CUuuid``: a GPU's UUID, 16 raw bytes."""

    # cuda.h declares ``char bytes[16]``; unsigned bytes have the same layout, and
    # ctypes would treat a c_char array as a NUL-terminated string, cutting a UUID
    # short at its first zero byte.
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


class CUcheckpointGpuPair(ctypes.Structure):
    """``CUcheckpointGpuPair``: restore what ran on ``oldUuid`` onto ``newUuid``."""

    _fields_ = [("oldUuid", CUuuid), ("newUuid", CUuuid)]


class CUcheckpointLockArgs(ctypes.Structure):
    """``CUcheckpointLockArgs``: a lock timeout in milliseconds (0: wait forever)."""

    _fields_ = [
        ("timeoutMs", ctypes.c_uint),
        ("reserved0", ctypes.c_uint),
        ("reserved1", ctypes.c_uint64 * 7),
    ]


class CUcheckpointCheckpointArgs(ctypes.Structure):
    """``CUcheckpointCheckpointArgs``: reserved, zeroed."""

    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class CUcheckpointRestoreArgs(ctypes.Structure):
    """``CUcheckpointRestoreArgs``: GPU pairs to remap on restore (r580 and later)."""

    _fields_ = [
        ("gpuPairs", ctypes.POINTER(CUcheckpointGpuPair)),
        ("gpuPairsCount", ctypes.c_uint),
        # The header sizes this field as 52 minus the pointer, so the structure stays
        # 64 bytes on every ABI.
        ("reserved", ctypes.c_char * (52 - ctypes.sizeof(ctypes.c_void_p))),
        ("reserved1", ctypes.c_uint64),
    ]


class CUcheckpointUnlockArgs(ctypes.Structure):
    """``CUcheckpointUnlockArgs``: reserved, zeroed."""

    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


_Bytes16 = ctypes.c_ubyte * 16


def uuid_bytes(gpu: str) -> bytes:
    """Return the 16 bytes of a GPU UUID as NVML and ``nvidia-smi -L`` print it.

    ``GPU-5ab8c1d2-0b6f-2a3e-9f11-0123456789ab`` (the ``GPU-`` prefix is optional).
    MIG devices (``MIG-…``) cannot be remapped by the checkpoint API and are refused.
    """
    text = gpu.strip()
    if text.upper().startswith("MIG-"):
        raise ValueError(f"{gpu!r} is a MIG device; the checkpoint API remaps whole GPUs")
    if text.upper().startswith("GPU-"):
        text = text[4:]
    try:
        return uuid.UUID(text).bytes
    except ValueError as error:
        raise ValueError(f"{gpu!r} is not a GPU UUID") from error


def gpu_pair_array(
    pairs: Sequence[tuple[str, str]],
) -> ctypes.Array[CUcheckpointGpuPair]:
    """Return a C array of ``CUcheckpointGpuPair`` for ``(old UUID, new UUID)`` pairs."""
    array = (CUcheckpointGpuPair * len(pairs))()
    for slot, (old, new) in zip(array, pairs, strict=True):
        slot.oldUuid.bytes = _Bytes16.from_buffer_copy(uuid_bytes(old))
        slot.newUuid.bytes = _Bytes16.from_buffer_copy(uuid_bytes(new))
    return array


def result_name(library: ctypes.CDLL | None, code: int) -> str:
    """Return ``CUresult`` ``code``'s name, from the library when it can say."""
    if library is not None:
        name = ctypes.c_char_p()
        try:
            if library.cuGetErrorName(code, ctypes.byref(name)) == CUDA_SUCCESS and name.value:
                return name.value.decode()
        except AttributeError:
            pass
    return _KNOWN_RESULTS.get(code, f"CUresult {code}")


def load_library(path: str = LIBCUDA) -> ctypes.CDLL:
    """Load the driver library; :class:`CudaUnavailable` says why it cannot be used."""
    try:
        library = ctypes.CDLL(path)
    except OSError as error:
        raise CudaUnavailable(f"{path} cannot be loaded (no NVIDIA driver?): {error}") from error
    missing = [symbol for symbol in CHECKPOINT_SYMBOLS if not hasattr(library, symbol)]
    if missing:
        raise CudaUnavailable(
            f"{path} does not export {', '.join(missing)}: the driver predates r570, "
            "the first with the CUDA checkpoint API"
        )
    return library


class CudaCheckpointApi:
    """The checkpoint calls of one loaded driver library.

    Construct it in a thread (it loads a shared library); each method blocks. The
    first call runs ``cuInit(0)``, which the checkpoint API needs in the caller.
    """

    def __init__(self, library: str = LIBCUDA) -> None:
        self.path = library
        self._lib = load_library(library)
        self._declare()
        self._init_lock = threading.Lock()
        self._initialised = False

    def _declare(self) -> None:
        # Declared argument types make ctypes refuse a wrong call instead of passing
        # garbage to the driver; every function returns a CUresult (a C enum: int).
        lib = self._lib
        lib.cuInit.argtypes = [ctypes.c_uint]
        lib.cuDriverGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuCheckpointProcessGetState.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        lib.cuCheckpointProcessLock.argtypes = [
            ctypes.c_int,
            ctypes.POINTER(CUcheckpointLockArgs),
        ]
        lib.cuCheckpointProcessCheckpoint.argtypes = [
            ctypes.c_int,
            ctypes.POINTER(CUcheckpointCheckpointArgs),
        ]
        lib.cuCheckpointProcessRestore.argtypes = [
            ctypes.c_int,
            ctypes.POINTER(CUcheckpointRestoreArgs),
        ]
        lib.cuCheckpointProcessUnlock.argtypes = [
            ctypes.c_int,
            ctypes.POINTER(CUcheckpointUnlockArgs),
        ]
        for name in ("cuInit", "cuDriverGetVersion", "cuGetErrorName", *CHECKPOINT_SYMBOLS):
            getattr(lib, name).restype = ctypes.c_int

    def _check(self, call: str, code: int, pid: int | None = None) -> None:
        if code != CUDA_SUCCESS:
            raise CudaError(call, code, result_name(self._lib, code), pid)

    def init(self) -> None:
        """Run ``cuInit(0)`` once; later calls return at once."""
        with self._init_lock:
            if not self._initialised:
                self._check("cuInit", self._lib.cuInit(0))
                self._initialised = True

    def driver_version(self) -> int:
        """Return the CUDA version the driver supports, as ``1000 * major + 10 * minor``."""
        version = ctypes.c_int()
        self._check("cuDriverGetVersion", self._lib.cuDriverGetVersion(ctypes.byref(version)))
        return version.value

    def state(self, pid: int) -> ProcessState:
        """Return the process's checkpoint state."""
        self.init()
        raw = ctypes.c_int(-1)
        self._check(
            "cuCheckpointProcessGetState",
            self._lib.cuCheckpointProcessGetState(pid, ctypes.byref(raw)),
            pid,
        )
        try:
            return ProcessState(raw.value)
        except ValueError as error:
            raise CudaError(
                "cuCheckpointProcessGetState", 0, f"unknown process state {raw.value}", pid
            ) from error

    def lock(self, pid: int, timeout_ms: int) -> None:
        """Lock the process (RUNNING → LOCKED), waiting at most ``timeout_ms`` (0: forever)."""
        self.init()
        args = CUcheckpointLockArgs(timeoutMs=timeout_ms)
        self._check(
            "cuCheckpointProcessLock",
            self._lib.cuCheckpointProcessLock(pid, ctypes.byref(args)),
            pid,
        )

    def checkpoint(self, pid: int) -> None:
        """Move device memory to host memory (LOCKED → CHECKPOINTED)."""
        self.init()
        args = CUcheckpointCheckpointArgs()
        self._check(
            "cuCheckpointProcessCheckpoint",
            self._lib.cuCheckpointProcessCheckpoint(pid, ctypes.byref(args)),
            pid,
        )

    def restore(self, pid: int, gpu_pairs: Sequence[tuple[str, str]] = ()) -> None:
        """Move memory back to the device (CHECKPOINTED → LOCKED), remapping GPUs by UUID."""
        self.init()
        args = CUcheckpointRestoreArgs()
        pairs = gpu_pair_array(gpu_pairs)
        if gpu_pairs:
            args.gpuPairs = ctypes.cast(pairs, ctypes.POINTER(CUcheckpointGpuPair))
            args.gpuPairsCount = len(gpu_pairs)
        self._check(
            "cuCheckpointProcessRestore",
            self._lib.cuCheckpointProcessRestore(pid, ctypes.byref(args)),
            pid,
        )

    def unlock(self, pid: int) -> None:
        """Unlock the process (LOCKED → RUNNING)."""
        self.init()
        args = CUcheckpointUnlockArgs()
        self._check(
            "cuCheckpointProcessUnlock",
            self._lib.cuCheckpointProcessUnlock(pid, ctypes.byref(args)),
            pid,
        )


__all__ = [
    "CHECKPOINT_SYMBOLS",
    "LIBCUDA",
    "CUcheckpointCheckpointArgs",
    "CUcheckpointGpuPair",
    "CUcheckpointLockArgs",
    "CUcheckpointRestoreArgs",
    "CUcheckpointUnlockArgs",
    "CUuuid",
    "CudaCheckpointApi",
    "CudaError",
    "CudaUnavailable",
    "ProcessState",
    "gpu_pair_array",
    "load_library",
    "result_name",
    "uuid_bytes",
]
