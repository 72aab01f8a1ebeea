"""Capability detection for the criu driver: parsing, the decision table, this machine."""

from __future__ import annotations

import dataclasses
import os
import stat
import sys
from pathlib import Path

import pytest
from cuda_standin import build, compiler

from sessionfleet.agent.capability import (
    CAP_SYS_ADMIN,
    Probe,
    assess,
    parse_criu_version,
    parse_nvidia_proc_version,
    parse_version,
    probe,
    read_cap_eff,
    read_driver_version,
)

PROPRIETARY = (
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15  Wed Jan 22 07:06:36 UTC 2025\n"
    "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n"
)
OPEN = (
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  "
    "(dvs-builder@U16-I3-B03-4-3)  Sun Jul 27 06:54:38 UTC 2025\n"
    "GCC version:  gcc version 13.3.0 (Ubuntu 13.3.0-6ubuntu2~24.04)\n"
)


@pytest.mark.parametrize(
    ("text", "version"),
    [(PROPRIETARY, "570.86.15"), (OPEN, "580.65.06"), ("GCC version: 12.3.0\n", None)],
)
def test_the_kernel_module_version_file(text: str, version: str | None) -> None:
    assert parse_nvidia_proc_version(text) == version


@pytest.mark.parametrize(
    ("text", "version"),
    [
        ("Version: 4.1\nGitID: v4.1\n", "4.1"),
        ("Version: 3.19\n", "3.19"),
        ("criu 4.0.1\n", "4.0.1"),
        ("", None),
    ],
)
def test_criu_version_output(text: str, version: str | None) -> None:
    assert parse_criu_version(text) == version


def test_versions_compare_as_numbers() -> None:
    assert parse_version("6.8.0-1015-aws") == (6, 8, 0)
    assert parse_version("570.86.15") > (550, 999)  # type: ignore[operator]
    assert parse_version("no digits") is None


GOOD = Probe(
    driver_version="580.65.06",
    driver_note="NVML",
    libcuda_error=None,
    criu_version_output="Version: 4.1\n",
    criu_check=(0, "Looks good.\n"),
    kernel_release="6.8.0-1015-aws",
    euid=0,
    cap_eff=(1 << 41) - 1,
)


def with_(**changes: object) -> Probe:
    return dataclasses.replace(GOOD, **changes)  # type: ignore[arg-type]


def test_a_good_node_can_checkpoint_and_remap() -> None:
    capability = assess(GOOD)
    assert capability.ok and capability.reasons == ()
    assert capability.can_remap_gpus
    assert (capability.driver_version, capability.criu_version) == ("580.65.06", "4.1")
    assert capability.explain() == "this node can checkpoint GPU processes with CRIU"


def test_driver_570_checkpoints_but_does_not_remap() -> None:
    capability = assess(with_(driver_version="570.86.15"))
    assert capability.ok and not capability.can_remap_gpus


# Each row: a change to a good node and the one reason it must produce.
REFUSALS = [
    pytest.param(
        {"driver_version": None, "driver_note": "NVML: NVML Shared Library Not Found"},
        "no NVIDIA driver (NVML: NVML Shared Library Not Found)",
        id="no driver",
    ),
    pytest.param(
        {"driver_version": "550.54.15"},
        "NVIDIA driver 550.54.15 is older than 570, the first with the CUDA checkpoint API",
        id="old driver",
    ),
    pytest.param({"driver_version": "r570"}, "unreadable NVIDIA driver", id="odd driver"),
    pytest.param(
        {"libcuda_error": "libcuda.so.1 does not export cuCheckpointProcessLock"},
        "libcuda.so.1 does not export cuCheckpointProcessLock",
        id="library without the API",
    ),
    pytest.param(
        {"criu_version_output": None, "criu_check": None},
        "criu is not installed (CRIU ≥ 4.0, which has the CUDA plugin, is needed on the node)",
        id="no criu",
    ),
    pytest.param(
        {"criu_version_output": "Version: 3.19\n"},
        "criu 3.19 is older than 4.0, the first with the CUDA plugin",
        id="old criu",
    ),
    pytest.param(
        {"criu_check": (1, "Error (criu/cr-check.c:1234): Can't read kcmp\nLooks bad.\n")},
        "criu check failed (exit 1): Error (criu/cr-check.c:1234): Can't read kcmp / Looks bad.",
        id="criu check fails",
    ),
    pytest.param(
        {"kernel_release": "3.10.0-1160.el7.x86_64"},
        "kernel 3.10.0-1160.el7.x86_64 is older than 3.11, CRIU's minimum",
        id="old kernel",
    ),
    pytest.param(
        {"euid": 1000, "cap_eff": 0},
        "the agent runs neither as root nor with CAP_SYS_ADMIN",
        id="unprivileged",
    ),
]


@pytest.mark.parametrize(("change", "reason"), REFUSALS)
def test_each_missing_requirement_is_a_reason(change: dict[str, object], reason: str) -> None:
    capability = assess(with_(**change))
    assert not capability.ok
    assert len(capability.reasons) == 1, capability.reasons
    assert capability.reasons[0].startswith(reason)
    assert reason in capability.explain()


def test_cap_sys_admin_without_root_is_enough() -> None:
    assert assess(with_(euid=1000, cap_eff=1 << CAP_SYS_ADMIN)).ok


def test_no_driver_does_not_also_blame_the_library() -> None:
    capability = assess(
        with_(driver_version=None, driver_note="none", libcuda_error="libcuda.so.1 missing")
    )
    assert capability.reasons == ("no NVIDIA driver (none)",)


def test_every_reason_is_listed_together() -> None:
    capability = assess(
        with_(driver_version=None, criu_version_output=None, criu_check=None, euid=5, cap_eff=0)
    )
    assert len(capability.reasons) == 3
    assert capability.to_json()["reasons"] == list(capability.reasons)


class AbsentNvml:
    """Stands in for ``pynvml`` on a node without the NVIDIA driver."""

    @staticmethod
    def nvmlInit() -> None:
        raise RuntimeError("NVML Shared Library Not Found")


@pytest.fixture
def bare_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A node the test controls: no NVML, an empty PATH folder; returns that folder.

    Whatever this machine has installed (a GPU, Debian's criu) must not decide the result.
    """
    monkeypatch.setitem(sys.modules, "pynvml", AbsentNvml)
    path = tmp_path / "bin"
    path.mkdir()
    monkeypatch.setenv("PATH", str(path))
    return path


def bare_probe(tmp_path: Path) -> Probe:
    return probe(
        libcuda=str(tmp_path / "libcuda.so.1"),
        driver_version_file=tmp_path / "no-driver-version",
    )


def test_a_node_without_driver_and_criu_says_so(tmp_path: Path, bare_node: Path) -> None:
    capability = assess(bare_probe(tmp_path))
    assert not capability.ok
    assert any(r.startswith("no NVIDIA driver") for r in capability.reasons)
    assert any(r.startswith("criu is not installed") for r in capability.reasons)
    version, note = read_driver_version(tmp_path / "no-driver-version")
    assert version is None and "NVML" in note and "no-driver-version" in note


VDSO = "Error (criu/vdso.c:281): vdso: Unexpected rt vDSO area bounds"


@pytest.mark.parametrize(
    ("version", "reasons"),
    [
        pytest.param("4.1", [f"criu check failed (exit 1): {VDSO}"], id="new criu"),
        pytest.param(
            "3.17",
            [
                "criu 3.17 is older than 4.0, the first with the CUDA plugin",
                f"criu check failed (exit 1): {VDSO}",
            ],
            id="Debian's criu 3.17",
        ),
    ],
)
def test_a_criu_whose_check_fails_says_so(
    tmp_path: Path, bare_node: Path, version: str, reasons: list[str]
) -> None:
    # Debian 12's criu 3.17 (pulled in by runc) fails `criu check` on some kernels.
    write_criu(bare_node, version, 1, check_output=VDSO)
    observed = bare_probe(tmp_path)
    assert observed.criu_check == (1, VDSO + "\n")
    capability = assess(observed)
    assert not capability.ok
    assert [r for r in capability.reasons if r.startswith("criu")] == reasons
    assert capability.to_json()["facts"]["criuCheck"] == VDSO


def test_the_driver_version_file_is_read_when_nvml_is_absent(tmp_path: Path) -> None:
    version_file = tmp_path / "version"
    version_file.write_text(OPEN)
    assert read_driver_version(version_file) == ("580.65.06", str(version_file))


def test_effective_capabilities_are_read_from_proc_status(tmp_path: Path) -> None:
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nCapInh:\t0000000000000000\nCapEff:\t0000000000200000\n")
    assert read_cap_eff(status) == 1 << CAP_SYS_ADMIN
    assert read_cap_eff(tmp_path / "missing") is None
    assert read_cap_eff() is not None  # this process's own


def write_criu(
    folder: Path, version: str, check_status: int, check_output: str = "Looks good."
) -> None:
    script = folder / "criu"
    script.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = --version ]; then echo "Version: {version}"; exit 0; fi\n'
        f'if [ "$1" = check ]; then echo "{check_output}"; exit {check_status}; fi\n'
        "exit 2\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


def test_the_probe_runs_criu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_criu(tmp_path, "3.19", 0)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    observed = probe()
    assert observed.criu_version_output is not None
    assert "3.19" in observed.criu_version_output
    assert observed.criu_check == (0, "Looks good.\n")
    assert "criu 3.19 is older than 4.0" in assess(observed).explain()


def test_the_probe_loads_the_library(tmp_path: Path) -> None:
    if compiler() is None:
        pytest.fail("needs a C compiler (cc or gcc) for the stand-in libcuda")
    assert probe(libcuda=str(build(tmp_path))).libcuda_error is None
    old = build(tmp_path, with_checkpoint_api=False)
    error = probe(libcuda=str(old)).libcuda_error
    assert error is not None and "cuCheckpointProcessLock" in error
