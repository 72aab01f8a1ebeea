"""The ctypes binding of the CUDA checkpoint API, against a stand-in libcuda built from C."""

from __future__ import annotations

import ctypes
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from cuda_standin import CHECKPOINT, LOCK, RESTORE, UNLOCK, Inspector, build, compiler

from sessionfleet.agent.cuda import (
    CUcheckpointCheckpointArgs,
    CUcheckpointGpuPair,
    CUcheckpointLockArgs,
    CUcheckpointRestoreArgs,
    CUcheckpointUnlockArgs,
    CudaCheckpointApi,
    CudaError,
    CudaUnavailable,
    ProcessState,
    gpu_pair_array,
    load_library,
    result_name,
    uuid_bytes,
)

GPU_A = "GPU-5ab8c1d2-0b6f-2a3e-9f11-0123456789ab"
GPU_B = "GPU-00000000-1111-2222-3333-444444444444"


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if compiler() is None:
        pytest.fail("these tests build a stand-in libcuda and need a C compiler (cc or gcc)")
    return build(tmp_path_factory.mktemp("libcuda"))


@pytest.fixture
def api(standin: Path) -> Iterator[tuple[CudaCheckpointApi, Inspector]]:
    yield CudaCheckpointApi(str(standin)), Inspector(standin)


def test_argument_structures_have_the_headers_sizes() -> None:
    # cuda.h pads every argument structure to 64 bytes; a wrong size would shift
    # fields the driver reads.
    for structure in (
        CUcheckpointLockArgs,
        CUcheckpointCheckpointArgs,
        CUcheckpointRestoreArgs,
        CUcheckpointUnlockArgs,
    ):
        assert ctypes.sizeof(structure) == 64, structure.__name__
    assert ctypes.sizeof(CUcheckpointGpuPair) == 32
    assert CUcheckpointRestoreArgs.gpuPairsCount.offset == ctypes.sizeof(ctypes.c_void_p)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (GPU_A, uuid.UUID(GPU_A[4:]).bytes),
        (GPU_A[4:], uuid.UUID(GPU_A[4:]).bytes),
        ("gpu-" + GPU_A[4:].upper(), uuid.UUID(GPU_A[4:]).bytes),
    ],
)
def test_gpu_uuids_become_sixteen_bytes(text: str, expected: bytes) -> None:
    assert uuid_bytes(text) == expected


@pytest.mark.parametrize("text", ["MIG-5ab8c1d2-0b6f-2a3e-9f11-0123456789ab", "GPU-nope", ""])
def test_unusable_gpu_ids_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        uuid_bytes(text)


def test_a_pair_array_carries_old_then_new() -> None:
    array = gpu_pair_array([(GPU_A, GPU_B)])
    assert bytes(array[0].oldUuid.bytes) == uuid_bytes(GPU_A)
    assert bytes(array[0].newUuid.bytes) == uuid_bytes(GPU_B)


def test_a_missing_library_is_unavailable_with_the_reason() -> None:
    with pytest.raises(CudaUnavailable, match="cannot be loaded"):
        load_library("/nonexistent/libcuda.so.1")


def test_a_driver_without_the_checkpoint_api_is_unavailable(tmp_path: Path) -> None:
    if compiler() is None:
        pytest.fail("needs a C compiler (cc or gcc)")
    old = build(tmp_path, with_checkpoint_api=False)
    with pytest.raises(CudaUnavailable, match="cuCheckpointProcessLock.*r570"):
        CudaCheckpointApi(str(old))


def test_a_full_cycle_moves_through_the_four_states(
    api: tuple[CudaCheckpointApi, Inspector],
) -> None:
    cuda, inspector = api
    pid = 1001
    assert cuda.driver_version() == 12080
    assert cuda.state(pid) is ProcessState.RUNNING
    cuda.lock(pid, timeout_ms=7500)
    assert inspector.last_timeout() == 7500  # the structure's first field reached C
    assert cuda.state(pid) is ProcessState.LOCKED
    cuda.checkpoint(pid)
    assert cuda.state(pid) is ProcessState.CHECKPOINTED
    cuda.restore(pid)
    assert inspector.last_pairs() == []
    assert cuda.state(pid) is ProcessState.LOCKED
    cuda.unlock(pid)
    assert cuda.state(pid) is ProcessState.RUNNING


def test_restore_passes_gpu_pairs_by_uuid(api: tuple[CudaCheckpointApi, Inspector]) -> None:
    cuda, inspector = api
    pid = 1002
    cuda.lock(pid, 0)
    cuda.checkpoint(pid)
    cuda.restore(pid, [(GPU_A, GPU_B), (GPU_B, GPU_A)])
    assert inspector.last_pairs() == [
        (uuid_bytes(GPU_A), uuid_bytes(GPU_B)),
        (uuid_bytes(GPU_B), uuid_bytes(GPU_A)),
    ]
    assert cuda.state(pid) is ProcessState.LOCKED


def test_a_call_in_the_wrong_state_names_the_error(
    api: tuple[CudaCheckpointApi, Inspector],
) -> None:
    cuda, _ = api
    with pytest.raises(CudaError) as caught:
        cuda.checkpoint(1003)  # RUNNING, not LOCKED
    error = caught.value
    assert (error.code, error.name, error.pid) == (401, "CUDA_ERROR_ILLEGAL_STATE", 1003)
    assert "not in the state this call needs" in str(error)


def test_a_lock_timeout_is_readable_and_leaves_the_process_running(
    api: tuple[CudaCheckpointApi, Inspector],
) -> None:
    cuda, inspector = api
    inspector.fail_next(LOCK, 909)
    with pytest.raises(CudaError, match="CUDA_ERROR_TIMEOUT.*left RUNNING"):
        cuda.lock(1004, 10)
    assert cuda.state(1004) is ProcessState.RUNNING


def test_a_failed_process_state_is_reported(api: tuple[CudaCheckpointApi, Inspector]) -> None:
    cuda, inspector = api
    inspector.set_state(1005, 3)
    assert cuda.state(1005) is ProcessState.FAILED
    inspector.set_state(1006, 7)  # a state a newer driver might add
    with pytest.raises(CudaError, match="unknown process state 7"):
        cuda.state(1006)


def test_codes_the_library_cannot_name_fall_back_to_known_names(
    api: tuple[CudaCheckpointApi, Inspector], standin: Path
) -> None:
    library = ctypes.CDLL(str(standin))
    assert result_name(library, 401) == "CUDA_ERROR_ILLEGAL_STATE"  # from the library
    assert result_name(library, 801) == "CUDA_ERROR_NOT_SUPPORTED"  # from the table
    assert result_name(None, 123456) == "CUresult 123456"


def test_every_call_checks_its_result(api: tuple[CudaCheckpointApi, Inspector]) -> None:
    cuda, inspector = api
    pid = 1007
    cuda.lock(pid, 0)
    inspector.fail_next(CHECKPOINT, 1)
    with pytest.raises(CudaError, match="cuCheckpointProcessCheckpoint on pid 1007"):
        cuda.checkpoint(pid)
    cuda.checkpoint(pid)
    inspector.fail_next(RESTORE, 1)
    with pytest.raises(CudaError, match="cuCheckpointProcessRestore"):
        cuda.restore(pid)
    cuda.restore(pid)
    inspector.fail_next(UNLOCK, 1)
    with pytest.raises(CudaError, match="cuCheckpointProcessUnlock"):
        cuda.unlock(pid)
    with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_VALUE"):
        cuda.state(-1)
