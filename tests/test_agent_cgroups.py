"""A process's pod and container from its cgroup: the layouts kubelets produce."""

from __future__ import annotations

from pathlib import Path

import pytest

from sessionfleet.agent.cgroups import (
    PodRef,
    ProcInfo,
    container_root,
    find_container_pid,
    normalise_container_id,
    parse_stat,
    pod_of_cgroup,
    pods_of,
    scan,
)

UID = "0b0c1c8e-3b1a-4c7e-9d1e-7f1e2d3c4b5a"
UNDERSCORED = UID.replace("-", "_")
CID = "4f8d2b1c9e7a" + "0" * 52
STATIC = "6e3f0b4d2e3b8c1c0a9f1e2d3c4b5a69"

CGROUPS = [
    pytest.param(
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UNDERSCORED}.slice/"
        f"cri-containerd-{CID}.scope\n",
        PodRef(UID, CID),
        id="v2 systemd containerd burstable",
    ),
    pytest.param(
        f"0::/kubepods.slice/kubepods-pod{UNDERSCORED}.slice/crio-{CID}.scope\n",
        PodRef(UID, CID),
        id="v2 systemd CRI-O guaranteed",
    ),
    pytest.param(
        f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UNDERSCORED}.slice/"
        f"crio-conmon-{CID}.scope\n",
        PodRef(UID, ""),
        id="CRI-O's monitor is in the pod, not in the container",
    ),
    pytest.param(
        "12:pids:/kubepods/besteffort/pod" + UID + "/" + CID + "\n"
        "11:memory:/kubepods/besteffort/pod" + UID + "/" + CID + "\n"
        "1:name=systemd:/kubepods/besteffort/pod" + UID + "/" + CID + "\n",
        PodRef(UID, CID),
        id="v1 cgroupfs",
    ),
    pytest.param(f"4:cpu,cpuacct:/kubepods/pod{UID}/{CID}\n", PodRef(UID, CID), id="v1 guaranteed"),
    pytest.param(
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{STATIC}.slice/"
        f"docker-{CID}.scope\n",
        PodRef(STATIC, CID),
        id="static pod with a config hash, docker",
    ),
    pytest.param(
        f"0::/../../kubepods-burstable-pod{UNDERSCORED}.slice/cri-containerd-{CID}.scope\n",
        PodRef(UID, CID),
        id="inside a cgroup namespace",
    ),
    pytest.param(
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UNDERSCORED}.slice\n",
        PodRef(UID, ""),
        id="the pod's own cgroup",
    ),
    pytest.param("0::/system.slice/containerd.service\n", None, id="a node daemon"),
    pytest.param("0::/user.slice/user-1000.slice/session-2.scope\n", None, id="a login"),
    pytest.param("0::/\n", None, id="the root"),
    pytest.param("", None, id="empty"),
]


@pytest.mark.parametrize(("text", "expected"), CGROUPS)
def test_pod_of_cgroup(text: str, expected: PodRef | None) -> None:
    assert pod_of_cgroup(text) == expected


@pytest.mark.parametrize(
    ("status_id", "expected"),
    [(f"containerd://{CID}", CID), (f"cri-o://{CID.upper()}", CID), (CID, CID)],
)
def test_pod_status_container_ids(status_id: str, expected: str) -> None:
    assert normalise_container_id(status_id) == expected


def test_stat_survives_odd_command_names() -> None:
    fields = " ".join(["S", "77"] + ["0"] * 17 + ["123456"] + ["0"] * 30)
    assert parse_stat(f"4242 (vllm ) (serve) {fields}") == (77, 123456)


def test_the_container_root_is_the_earliest_process_whose_parent_is_outside() -> None:
    processes = [
        ProcInfo(pid=500, ppid=1, start=900, pod=None),  # kubectl exec: a later root
        ProcInfo(pid=30, ppid=10, start=100, pod=None),  # the engine, child of the shim
        ProcInfo(pid=31, ppid=30, start=150, pod=None),  # an engine worker
    ]
    assert container_root(processes) == 30
    with pytest.raises(LookupError):
        container_root([])


def make_proc(root: Path, pid: int, ppid: int, start: int, cgroup: str) -> None:
    folder = root / str(pid)
    folder.mkdir()
    rest = " ".join(["0"] * 17 + [str(start)] + ["0"] * 30)
    (folder / "stat").write_text(f"{pid} (python3) S {ppid} {rest}\n")
    (folder / "cgroup").write_text(cgroup)


def test_find_container_pid_scans_proc(tmp_path: Path) -> None:
    scope = (
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UNDERSCORED}.slice/"
        "cri-containerd-{}.scope\n"
    )
    other = "b" * 64
    make_proc(tmp_path, 10, 1, 50, "0::/system.slice/containerd.service\n")
    make_proc(tmp_path, 20, 10, 60, scope.format("a" * 64))  # the pause container
    make_proc(tmp_path, 30, 10, 100, scope.format(CID))  # the engine
    make_proc(tmp_path, 31, 30, 120, scope.format(CID))  # its child
    make_proc(tmp_path, 40, 10, 130, scope.format(other))  # another container
    (tmp_path / "self").mkdir()  # not a PID
    assert find_container_pid(UID, f"containerd://{CID}", tmp_path) == 30
    assert find_container_pid(UID.upper(), other, tmp_path) == 40
    with pytest.raises(LookupError, match="hostPID"):
        find_container_pid(UID, "c" * 64, tmp_path)
    mapped = pods_of(scan(tmp_path))
    assert mapped[31] == PodRef(UID, CID) and 10 not in mapped


def test_scan_reads_this_machines_proc() -> None:
    processes = scan()
    assert any(p.pid == 1 for p in processes)
    assert all(p.ppid >= 0 and p.start >= 0 for p in processes)
