"""The criu driver's executor and node service: the state machine's actions performed.

CUDA and CRIU are stand-ins (no GPU here); the engine is the real simulated engine
over HTTP where the test is about the engine's part.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp.test_utils import TestServer
from criu_fakes import FakeCriu, FakeCuda, FakeEngine, Killer
from cuda_standin import LOCK, Inspector, build, compiler

from sessionfleet.agent.capability import Capability
from sessionfleet.agent.criu import (
    Busy,
    CheckpointRequest,
    CriuCli,
    CriuError,
    EngineError,
    HttpEngine,
    NodeCheckpointer,
    ProcessCheckpointer,
    RestoreRequest,
    gpu_pairs,
    kill_process,
    read_metadata,
)
from sessionfleet.agent.criu_machine import Action, Phase
from sessionfleet.agent.cuda import CudaCheckpointApi, ProcessState
from sessionfleet.checkpoint.agent_api import METADATA_FILE
from sessionfleet.checkpoint.driver import DriverUnavailable
from sessionfleet.simengine.engine import EngineConfig
from sessionfleet.simengine.server import build_app

PID = 4321
GPU_A = "GPU-5ab8c1d2-0b6f-2a3e-9f11-0123456789ab"
GPU_B = "GPU-00000000-1111-2222-3333-444444444444"


def executor(
    cuda: FakeCuda, criu: FakeCriu, engine: FakeEngine, killer: Killer | None = None
) -> ProcessCheckpointer:
    return ProcessCheckpointer(cuda, criu, engine, kill=killer or Killer(), lock_timeout_ms=1500)


def actions(run: Any) -> list[tuple[str, bool]]:
    return [(s.action.value, s.ok) for s in run.steps]


async def test_a_checkpoint_left_running_brings_everything_back(tmp_path: Path) -> None:
    cuda, engine = FakeCuda(), FakeEngine()
    criu = FakeCriu(cuda)
    run = await executor(cuda, criu, engine).checkpoint(PID, tmp_path / "img")
    assert run.ok and run.phase is Phase.RESUMED and run.error == ""
    assert [c for c, _ in cuda.calls] == ["lock", "checkpoint", "restore", "unlock"]
    assert cuda.timeouts == [1500]
    assert criu.dumps == [(PID, tmp_path / "img", True)]
    assert engine.calls == ["pause", "resume"] and not engine.paused
    assert cuda.state(PID) is ProcessState.RUNNING
    assert run.size_bytes == 4196
    assert all(ok for _, ok in actions(run)) and len(run.steps) == 7


async def test_a_migration_checkpoint_ends_the_process(tmp_path: Path) -> None:
    cuda, engine = FakeCuda(), FakeEngine()
    criu = FakeCriu(cuda)
    run = await executor(cuda, criu, engine).checkpoint(PID, tmp_path / "img", leave_running=False)
    assert run.phase is Phase.STOPPED and run.ok
    assert criu.ended == {PID}
    assert engine.calls == ["pause"]  # nothing is left to resume


async def test_a_lock_timeout_resumes_the_engine_without_unlocking(tmp_path: Path) -> None:
    cuda, engine, killer = FakeCuda(), FakeEngine(), Killer()
    cuda.fail["lock"] = "CUDA_ERROR_TIMEOUT"
    run = await executor(cuda, FakeCriu(cuda), engine, killer).checkpoint(PID, tmp_path)
    assert run.phase is Phase.FAILED and not run.ok
    assert "CUDA_ERROR_TIMEOUT" in run.error
    assert [c for c, _ in cuda.calls] == ["lock"]  # the undo's unlock saw RUNNING
    assert engine.calls == ["pause", "resume"]
    assert killer.killed == []
    assert actions(run) == [
        ("PauseEngine", True),
        ("Lock", False),
        ("Unlock", True),
        ("ResumeEngine", True),
    ]


async def test_a_failed_dump_restores_gpu_memory_and_resumes(tmp_path: Path) -> None:
    cuda, engine = FakeCuda(), FakeEngine()
    criu = FakeCriu(cuda)
    criu.fail["dump"] = "criu dump exited 1: Can't dump nested uts namespace"
    run = await executor(cuda, criu, engine).checkpoint(PID, tmp_path)
    assert run.phase is Phase.FAILED
    assert run.error == "Dump failed: criu dump exited 1: Can't dump nested uts namespace"
    assert cuda.state(PID) is ProcessState.RUNNING
    assert engine.calls == ["pause", "resume"]


async def test_a_lock_that_lies_is_caught_by_the_state_check(tmp_path: Path) -> None:
    cuda, engine = FakeCuda(), FakeEngine()
    cuda.lie.add("lock")
    run = await executor(cuda, FakeCriu(cuda), engine).checkpoint(PID, tmp_path)
    assert run.phase is Phase.FAILED
    assert "the process is RUNNING, not LOCKED" in run.error


async def test_a_failed_undo_kills_the_process(tmp_path: Path) -> None:
    cuda, engine, killer = FakeCuda(), FakeEngine(), Killer()
    criu = FakeCriu(cuda)
    criu.fail["dump"] = "disk full"
    cuda.fail["restore"] = "CUDA_ERROR_OUT_OF_MEMORY"
    run = await executor(cuda, criu, engine, killer).checkpoint(PID, tmp_path)
    assert run.phase is Phase.FATAL
    assert killer.killed == [PID]
    assert "Dump failed: disk full; then RestoreGpu failed" in run.error


async def test_a_restore_remaps_gpus_and_resumes(tmp_path: Path) -> None:
    cuda, engine = FakeCuda(), FakeEngine()
    criu = FakeCriu(cuda, restored_pid=999)
    engine.paused = True  # the process was dumped paused
    run = await executor(cuda, criu, engine).restore(tmp_path, [(GPU_A, GPU_B)])
    assert run.ok and run.phase is Phase.RESUMED and run.pid == 999
    assert cuda.pairs == [(GPU_A, GPU_B)]
    assert cuda.state(999) is ProcessState.RUNNING
    assert not engine.paused


async def test_a_failed_gpu_restore_is_fatal_and_kills(tmp_path: Path) -> None:
    cuda, engine, killer = FakeCuda(), FakeEngine(), Killer()
    cuda.fail["restore"] = "CUDA_ERROR_INVALID_DEVICE"
    run = await executor(cuda, FakeCriu(cuda, restored_pid=31), engine, killer).restore(tmp_path)
    assert run.phase is Phase.FATAL
    assert killer.killed == [31]
    assert engine.calls == []


async def test_a_failed_criu_restore_has_nothing_to_kill(tmp_path: Path) -> None:
    cuda, killer = FakeCuda(), Killer()
    criu = FakeCriu(cuda)
    criu.fail["restore"] = "criu restore exited 1"
    run = await executor(cuda, criu, FakeEngine(), killer).restore(tmp_path)
    assert run.phase is Phase.FATAL and run.pid is None
    assert killer.killed == []
    assert [s.action for s in run.steps] == [Action.CRIU_RESTORE, Action.KILL]


# --- the real ctypes binding and the real engine, with CRIU standing in -------------


@pytest.fixture
async def sim_engine() -> AsyncIterator[str]:
    server = TestServer(build_app(EngineConfig(model="m")), host="127.0.0.1")
    await server.start_server()
    yield str(server.make_url("")).rstrip("/")
    await server.close()


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10) as client:
        yield client


async def test_real_binding_and_real_engine_in_one_checkpoint(
    tmp_path: Path, sim_engine: str, http: httpx.AsyncClient
) -> None:
    if compiler() is None:
        pytest.fail("needs a C compiler (cc or gcc) for the stand-in libcuda")
    library = build(tmp_path)
    cuda = CudaCheckpointApi(str(library))
    criu = FakeCriu()

    async def engine_paused_and_gpu_state() -> tuple[bool, ProcessState]:
        answer = (await http.get(f"{sim_engine}/is_paused")).json()
        return bool(answer["is_paused"]), cuda.state(PID)

    criu.on_dump = engine_paused_and_gpu_state
    engine = HttpEngine(http, sim_engine)
    run = await ProcessCheckpointer(cuda, criu, engine, lock_timeout_ms=2500).checkpoint(
        PID, tmp_path / "img"
    )
    assert run.ok, run.error
    # While CRIU dumped, the engine was paused and the GPU memory was in host memory.
    assert criu.during_dump == [(True, ProcessState.CHECKPOINTED)]
    assert Inspector(library).last_timeout() == 2500
    assert cuda.state(PID) is ProcessState.RUNNING
    assert (await http.get(f"{sim_engine}/is_paused")).json()["is_paused"] is False


async def test_real_binding_lock_timeout_is_undone(
    tmp_path: Path, sim_engine: str, http: httpx.AsyncClient
) -> None:
    if compiler() is None:
        pytest.fail("needs a C compiler (cc or gcc) for the stand-in libcuda")
    library = build(tmp_path)
    Inspector(library).fail_next(LOCK, 909)
    run = await ProcessCheckpointer(
        CudaCheckpointApi(str(library)), FakeCriu(), HttpEngine(http, sim_engine)
    ).checkpoint(PID + 1, tmp_path / "img")
    assert run.phase is Phase.FAILED
    assert "CUDA_ERROR_TIMEOUT" in run.error
    assert (await http.get(f"{sim_engine}/is_paused")).json()["is_paused"] is False


async def test_an_unreachable_engine_is_an_engine_error(http: httpx.AsyncClient) -> None:
    with pytest.raises(EngineError, match="unreachable"):
        await HttpEngine(http, "http://127.0.0.1:9", timeout=1).pause()


# --- the criu command ---------------------------------------------------------------


def test_dump_and_restore_command_lines(tmp_path: Path) -> None:
    cli = CriuCli("/usr/sbin/criu")
    dump = cli.dump_argv(42, tmp_path, leave_running=True)
    assert dump[:6] == ["/usr/sbin/criu", "dump", "--tree", "42", "--images-dir", str(tmp_path)]
    assert "--tcp-established" in dump and dump[-1] == "--leave-running"
    assert "--leave-running" not in cli.dump_argv(42, tmp_path, leave_running=False)
    restore = cli.restore_argv(tmp_path, tmp_path / "p.pid")
    assert restore[:3] == ["/usr/sbin/criu", "restore", "--images-dir"]
    assert "--restore-detached" in restore and "--tcp-close" in restore
    assert restore[restore.index("--pidfile") + 1] == str(tmp_path / "p.pid")


FAKE_CRIU = """#!/bin/sh
# Stands in for criu: writes an image and a log, or fails like criu does.
cmd="$1"; shift
dir=""; pidfile=""
while [ $# -gt 0 ]; do
  case "$1" in
    --images-dir) dir="$2"; shift;;
    --pidfile) pidfile="$2"; shift;;
  esac
  shift
done
if [ -n "$CRIU_FAIL" ]; then
  echo "(00.001) Error (criu/cr-$cmd.c:12): $CRIU_FAIL" > "$dir/$cmd.log"
  exit 1
fi
echo "(00.001) $cmd finished successfully" > "$dir/$cmd.log"
if [ "$cmd" = dump ]; then head -c 8192 /dev/zero > "$dir/pages-1.img"; fi
if [ "$cmd" = restore ]; then echo 31337 > "$pidfile"; fi
"""


@pytest.fixture
def fake_criu(tmp_path: Path) -> Path:
    script = tmp_path / "criu"
    script.write_text(FAKE_CRIU)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


async def test_the_criu_runner_dumps_and_restores(tmp_path: Path, fake_criu: Path) -> None:
    cli = CriuCli(str(fake_criu))
    images = tmp_path / "images" / "ckpt-1"
    size = await cli.dump(42, images, leave_running=True)
    assert size == 8192 + (images / "dump.log").stat().st_size
    assert await cli.restore(images) == 31337


async def test_a_failing_criu_reports_its_log_error(
    tmp_path: Path, fake_criu: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CRIU_FAIL", "Can't dump nested uts namespace")
    with pytest.raises(CriuError, match="exited 1: .*Can't dump nested uts namespace"):
        await CriuCli(str(fake_criu)).dump(42, tmp_path / "img", leave_running=True)


async def test_a_missing_criu_is_a_criu_error(tmp_path: Path) -> None:
    with pytest.raises(CriuError, match="cannot run"):
        await CriuCli(str(tmp_path / "no-criu")).dump(42, tmp_path / "img", leave_running=True)


async def test_a_hanging_criu_times_out(tmp_path: Path) -> None:
    script = tmp_path / "criu"
    script.write_text("#!/bin/sh\nexec sleep 30\n")
    script.chmod(0o755)
    with pytest.raises(CriuError, match="timed out"):
        await CriuCli(str(script), timeout=0.3).dump(42, tmp_path / "img", leave_running=True)


# --- the node service ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("saved", "target", "pairs"),
    [
        ([GPU_A], [], []),
        ([GPU_A], [GPU_A], []),
        ([GPU_A], [GPU_B], [(GPU_A, GPU_B)]),
        ([GPU_A, GPU_B], [GPU_B, GPU_A], [(GPU_A, GPU_B), (GPU_B, GPU_A)]),
        ([GPU_A, GPU_B], [GPU_A, "GPU-C"], [(GPU_B, "GPU-C")]),
    ],
)
def test_gpu_pairs(saved: list[str], target: list[str], pairs: list[tuple[str, str]]) -> None:
    assert gpu_pairs(saved, target) == pairs


def test_gpu_pairs_need_as_many_gpus() -> None:
    with pytest.raises(ValueError, match="used 2 GPU"):
        gpu_pairs([GPU_A, GPU_B], [GPU_A])


GOOD = {
    "imagesDir": "/checkpoints/ns/w/c1",
    "namespace": "ns",
    "endpoint": "http://10.0.0.5:8000",
    "podUID": "0b0c1c8e-3b1a-4c7e-9d1e-7f1e2d3c4b5a",
    "containerID": "containerd://" + "a" * 64,
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"imagesDir": "relative/dir"}, "absolute"),
        ({"imagesDir": "/checkpoints/../etc"}, "without '.' or '..'"),
        ({"endpoint": "10.0.0.5:8000"}, "http://"),
        ({"podUID": ""}, "podUID and containerID"),
        ({"containerID": None}, "podUID and containerID"),
        ({"lockTimeoutSeconds": -1}, "from 0.001 to 600"),
        ({"lockTimeoutSeconds": 0}, "from 0.001 to 600"),
        ({"lockTimeoutSeconds": float("nan")}, "from 0.001 to 600"),
        ({"lockTimeoutSeconds": True}, "from 0.001 to 600"),
        ({"leaveRunning": "no"}, "true or false"),
    ],
)
def test_checkpoint_requests_are_checked(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CheckpointRequest.from_json({**GOOD, **change})


def test_a_good_checkpoint_request_parses() -> None:
    request = CheckpointRequest.from_json({**GOOD, "lockTimeoutSeconds": 2.5})
    assert request.lock_timeout_ms == 2500 and request.leave_running
    assert request.images_dir == Path("/checkpoints/ns/w/c1")


def capable(ok: bool = True, remap: bool = True) -> Capability:
    return Capability(
        ok=ok,
        reasons=() if ok else ("criu is not installed",),
        driver_version="580.65.06" if remap else "570.86.15",
        can_remap_gpus=remap,
    )


def node_service(
    cuda: FakeCuda,
    criu: FakeCriu,
    engine: FakeEngine,
    capability: Capability,
    gpus: list[str] | None = None,
) -> NodeCheckpointer:
    async def current() -> Capability:
        return capability

    return NodeCheckpointer(
        node="gpu-node-1",
        capability=current,
        make_cuda=lambda: cuda,
        criu=criu,
        engine_for=lambda endpoint: engine,
        find_pid=lambda uid, container: PID,
        gpus_of=lambda pid: list(gpus or [GPU_A]),
        kill=Killer(),
    )


def request_for(images: Path) -> CheckpointRequest:
    return CheckpointRequest.from_json({**GOOD, "imagesDir": str(images)})


async def test_the_node_service_refuses_when_the_node_cannot(tmp_path: Path) -> None:
    cuda = FakeCuda()
    service = node_service(cuda, FakeCriu(cuda), FakeEngine(), capable(ok=False))
    with pytest.raises(DriverUnavailable, match="criu is not installed"):
        await service.checkpoint(request_for(tmp_path))
    assert cuda.calls == []


async def test_the_node_service_records_the_gpus_for_the_restore(tmp_path: Path) -> None:
    cuda, engine = FakeCuda(), FakeEngine()
    service = node_service(cuda, FakeCriu(cuda), engine, capable(), gpus=[GPU_A])
    run = await service.checkpoint(request_for(tmp_path / "c1"))
    assert run.ok and run.gpus == (GPU_A,)
    meta = json.loads((tmp_path / "c1" / METADATA_FILE).read_text())
    assert meta["gpus"] == [GPU_A] and meta["node"] == "gpu-node-1" and meta["pid"] == PID

    restore = RestoreRequest.from_json(
        {
            "imagesDir": str(tmp_path / "c1"),
            "namespace": "ns",
            "endpoint": "http://10.0.0.9:8000",
            "gpus": [GPU_B],
        }
    )
    restored = await service.restore(restore)
    assert restored.ok and cuda.pairs == [(GPU_A, GPU_B)]


async def test_remapping_gpus_needs_driver_580(tmp_path: Path) -> None:
    cuda = FakeCuda()
    (tmp_path / METADATA_FILE).write_text(json.dumps({"gpus": [GPU_A]}))
    service = node_service(cuda, FakeCriu(cuda), FakeEngine(), capable(remap=False))
    request = RestoreRequest(tmp_path, "http://10.0.0.9:8000", (GPU_B,))
    with pytest.raises(DriverUnavailable, match="≥ 580; this node has 570.86.15"):
        await service.restore(request)
    same = RestoreRequest(tmp_path, "http://10.0.0.9:8000", (GPU_A,))
    assert (await service.restore(same)).ok  # the same GPU needs no remap


async def test_a_restore_without_a_checkpoint_is_a_lookup_error(tmp_path: Path) -> None:
    cuda = FakeCuda()
    service = node_service(cuda, FakeCriu(cuda), FakeEngine(), capable())
    with pytest.raises(LookupError, match="no checkpoint at"):
        await service.restore(RestoreRequest(tmp_path, "http://e:1"))
    (tmp_path / METADATA_FILE).write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        read_metadata(tmp_path)


async def test_one_operation_per_process_at_a_time(tmp_path: Path) -> None:
    cuda = FakeCuda()
    service = node_service(cuda, FakeCriu(cuda), FakeEngine(), capable())
    service._claim(f"pid {PID}")
    with pytest.raises(Busy):
        await service.checkpoint(request_for(tmp_path))
    service._busy.clear()
    assert (await service.checkpoint(request_for(tmp_path))).ok


async def test_one_restore_per_images_directory_whatever_path_names_it(tmp_path: Path) -> None:
    """The agent names images through a descriptor of its own, a new path per request:
    two restores of the same directory still exclude each other."""
    cuda = FakeCuda()
    (tmp_path / METADATA_FILE).write_text(json.dumps({"gpus": [GPU_A]}))
    service = node_service(cuda, FakeCriu(cuda), FakeEngine(), capable())
    found = tmp_path.stat()
    service._claim(f"images {found.st_dev}:{found.st_ino}")
    descriptor = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        handle = Path(f"/proc/{os.getpid()}/fd/{descriptor}")
        request = RestoreRequest(images_dir=handle, endpoint="http://10.0.0.9:8000")
        with pytest.raises(Busy, match="these images"):
            await service.restore(request)
    finally:
        os.close(descriptor)


def test_the_real_kill_ends_a_process_and_ignores_one_already_gone() -> None:
    process = subprocess.Popen(["sleep", "30"])
    kill_process(process.pid)
    assert process.wait(timeout=10) == -signal.SIGKILL
    kill_process(process.pid)  # reaped: no such process, and no error
