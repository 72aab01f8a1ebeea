"""A stand-in ``libcuda.so.1``, compiled from C for the tests: no GPU is needed.

It exports the driver's checkpoint entry points with the real signatures and keeps a
per-PID process state, so the ctypes binding is exercised for real: argument structures
cross the C boundary, results come back as ``CUresult`` codes and names. Inspection
hooks (``standin_*``) report what the library received (the lock timeout, the GPU
pairs' bytes) and let a test make the next call of a kind fail.

This is the one place a fake stands in: no GPU can run here (see docs/checkpoints.md).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

SOURCE = r"""
#include <string.h>

typedef int CUresult;
typedef struct { char bytes[16]; } CUuuid;
typedef struct { CUuuid oldUuid; CUuuid newUuid; } CUcheckpointGpuPair;
typedef struct {
    unsigned int timeoutMs; unsigned int reserved0; unsigned long long reserved1[7];
} CUcheckpointLockArgs;
typedef struct { unsigned long long reserved[8]; } CUcheckpointCheckpointArgs;
typedef struct {
    CUcheckpointGpuPair *gpuPairs; unsigned int gpuPairsCount;
    char reserved[52 - sizeof(void *)]; unsigned long long reserved1;
} CUcheckpointRestoreArgs;
typedef struct { unsigned long long reserved[8]; } CUcheckpointUnlockArgs;

enum { RUNNING = 0, LOCKED = 1, CHECKPOINTED = 2, FAILED = 3 };
#define MAXP 64
static int pids[MAXP], states[MAXP], used;
static int initialised;
static unsigned int last_timeout = 12345;
static unsigned int last_pairs_count;
static unsigned char last_pairs[8 * 32];
static int fail_next[8];   /* per call: 0 lock, 1 checkpoint, 2 restore, 3 unlock */
static int fail_code[8];
static int fail_state[8];  /* the state to leave behind when failing, -1: unchanged */

static int *slot(int pid) {
    for (int i = 0; i < used; i++) if (pids[i] == pid) return &states[i];
    if (used == MAXP) return 0;
    pids[used] = pid; states[used] = RUNNING; return &states[used++];
}

CUresult cuInit(unsigned int flags) { if (flags != 0) return 1; initialised = 1; return 0; }
CUresult cuDriverGetVersion(int *v) { if (!v) return 1; *v = 12080; return 0; }

CUresult cuGetErrorName(CUresult code, const char **name) {
    switch (code) {
    case 0: *name = "CUDA_SUCCESS"; return 0;
    case 1: *name = "CUDA_ERROR_INVALID_VALUE"; return 0;
    case 3: *name = "CUDA_ERROR_NOT_INITIALIZED"; return 0;
    case 401: *name = "CUDA_ERROR_ILLEGAL_STATE"; return 0;
    case 909: *name = "CUDA_ERROR_TIMEOUT"; return 0;
    default: *name = 0; return 1;
    }
}

static int injected(int call, int *s) {
    if (!fail_next[call]) return 0;
    fail_next[call] = 0;
    if (fail_state[call] >= 0) *s = fail_state[call];
    return fail_code[call];
}

#ifndef NO_CHECKPOINT
CUresult cuCheckpointProcessGetState(int pid, int *state) {
    if (!initialised) return 3;
    int *s = slot(pid); if (pid <= 0 || !s || !state) return 1;
    *state = *s; return 0;
}
CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args) {
    if (!initialised) return 3;
    int *s = slot(pid); if (pid <= 0 || !s) return 1;
    if (args) last_timeout = args->timeoutMs;
    int e = injected(0, s); if (e) return e;
    if (*s != RUNNING) return 401;
    *s = LOCKED; return 0;
}
CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args) {
    if (!initialised) return 3;
    int *s = slot(pid); if (pid <= 0 || !s) return 1;
    int e = injected(1, s); if (e) return e;
    if (*s != LOCKED) return 401;
    *s = CHECKPOINTED; return 0;
}
CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args) {
    if (!initialised) return 3;
    int *s = slot(pid); if (pid <= 0 || !s) return 1;
    last_pairs_count = 0;
    if (args) {
        last_pairs_count = args->gpuPairsCount;
        if (args->gpuPairsCount > 8) return 1;
        if (args->gpuPairsCount && !args->gpuPairs) return 1;
        memcpy(last_pairs, args->gpuPairs, args->gpuPairsCount * sizeof(CUcheckpointGpuPair));
    }
    int e = injected(2, s); if (e) return e;
    if (*s != CHECKPOINTED) return 401;
    *s = LOCKED; return 0;
}
CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args) {
    if (!initialised) return 3;
    int *s = slot(pid); if (pid <= 0 || !s) return 1;
    int e = injected(3, s); if (e) return e;
    if (*s != LOCKED) return 401;
    *s = RUNNING; return 0;
}
#endif

/* Enough of the memory API for scripts/gpu/cuda_checkpoint_check.py's child: "device"
   memory is host memory, two "GPUs" with UUIDs of repeated bytes. */
#include <stdlib.h>
typedef unsigned long long CUdeviceptr;
CUresult cuDeviceGetCount(int *n) { if (!initialised) return 3; *n = 2; return 0; }
CUresult cuDeviceGet(int *dev, int ordinal) {
    if (ordinal < 0 || ordinal > 1) return 101;
    *dev = ordinal; return 0;
}
CUresult cuDeviceGetUuid(CUuuid *u, int dev) { memset(u->bytes, 0x10 + dev, 16); return 0; }
CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) {
    *ctx = (void *)(long)(0x1000 + dev); return 0;
}
CUresult cuCtxSetCurrent(void *ctx) { return 0; }
CUresult cuCtxGetDevice(int *dev) { *dev = 0; return 0; }
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
    void *m = malloc(n); if (!m) return 2;
    *p = (CUdeviceptr)m; return 0;
}
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *h, size_t n) {
    memcpy((void *)d, h, n); return 0;
}
CUresult cuMemcpyDtoH_v2(void *h, CUdeviceptr d, size_t n) { memcpy(h, (void *)d, n); return 0; }
CUresult cuMemFree_v2(CUdeviceptr d) { free((void *)d); return 0; }

unsigned int standin_last_timeout(void) { return last_timeout; }
unsigned int standin_last_pairs(unsigned char *out) {
    memcpy(out, last_pairs, sizeof(last_pairs)); return last_pairs_count;
}
void standin_set_state(int pid, int state) { int *s = slot(pid); if (s) *s = state; }
void standin_fail_next(int call, int code, int state) {
    fail_next[call] = 1; fail_code[call] = code; fail_state[call] = state;
}
"""

LOCK, CHECKPOINT, RESTORE, UNLOCK = 0, 1, 2, 3


def compiler() -> str | None:
    """Return a C compiler's path, if the machine has one."""
    return shutil.which("cc") or shutil.which("gcc")


def build(directory: Path, *, with_checkpoint_api: bool = True) -> Path:
    """Compile the stand-in into ``directory`` and return the library's path."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) to build the stand-in libcuda")
    source = directory / "standin_libcuda.c"
    source.write_text(SOURCE)
    name = "libcuda.so.1" if with_checkpoint_api else "libcuda_old.so.1"
    library = directory / name
    flags = [] if with_checkpoint_api else ["-DNO_CHECKPOINT"]
    subprocess.run(
        [cc, "-shared", "-fPIC", "-O0", *flags, "-o", str(library), str(source)],
        check=True,
        capture_output=True,
    )
    return library


class Inspector:
    """The stand-in's inspection hooks, through its own handle on the library."""

    def __init__(self, library: Path) -> None:
        # ctypes returns the same handle for the same path, so these hooks see the
        # state the binding under test changes.
        self.lib = ctypes.CDLL(str(library))
        self.lib.standin_last_pairs.argtypes = [ctypes.c_char_p]
        self.lib.standin_last_pairs.restype = ctypes.c_uint
        self.lib.standin_last_timeout.restype = ctypes.c_uint

    def last_timeout(self) -> int:
        return int(self.lib.standin_last_timeout())

    def last_pairs(self) -> list[tuple[bytes, bytes]]:
        buffer = ctypes.create_string_buffer(8 * 32)
        count = self.lib.standin_last_pairs(buffer)
        raw = buffer.raw
        return [(raw[i * 32 : i * 32 + 16], raw[i * 32 + 16 : i * 32 + 32]) for i in range(count)]

    def set_state(self, pid: int, state: int) -> None:
        self.lib.standin_set_state(pid, state)

    def fail_next(self, call: int, code: int, state: int = -1) -> None:
        self.lib.standin_fail_next(call, code, state)
