"""Can this node checkpoint a GPU process with CRIU? Observe, then decide purely.

:func:`probe` gathers raw observations (blocking: it runs ``criu`` and loads shared
libraries; call it in a thread, or through :func:`detect`); :func:`assess` turns them
into a :class:`Capability` with one sentence per missing requirement:

- an NVIDIA driver ≥ 570 (the CUDA checkpoint API), ≥ 580 to restore onto other GPUs;
  read through NVML (``nvmlSystemGetDriverVersion``), else ``/proc/driver/nvidia/version``;
- ``libcuda.so.1`` exporting ``cuCheckpointProcessLock`` and its siblings;
- CRIU ≥ 4.0 (the first with the CUDA plugin) and a passing ``criu check``;
- a kernel CRIU supports (≥ 3.11; ``criu check`` tests the features it needs);
- root or ``CAP_SYS_ADMIN``: CRIU and the checkpoint API act on other users' processes.
"""

from __future__ import annotations

import asyncio
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sessionfleet.agent.cuda import LIBCUDA, CudaUnavailable, load_library

MIN_DRIVER = 570
"""The first driver branch with the CUDA checkpoint API and CRIU integration."""
MIN_DRIVER_REMAP = 580
"""The first driver branch that restores a process onto a different GPU."""
MIN_CRIU = (4, 0)
"""The first CRIU release with the CUDA plugin."""
MIN_KERNEL = (3, 11)
"""CRIU's documented minimum kernel; ``criu check`` tests the features beyond it."""
CAP_SYS_ADMIN = 21
"""The capability's bit in ``CapEff`` (linux/capability.h)."""
NVIDIA_VERSION_FILE = Path("/proc/driver/nvidia/version")

_VERSION = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")


@dataclass(frozen=True, slots=True)
class Probe:
    """What the node showed; ``None`` where a thing is absent."""

    driver_version: str | None
    """The NVIDIA driver's version, ``570.86.15``; ``None``: no driver found."""
    driver_note: str
    """Where the version came from, or why it could not be read."""
    libcuda_error: str | None
    """``None`` when ``libcuda.so.1`` loads and exports the checkpoint API, else why not."""
    criu_version_output: str | None
    """``criu --version``'s output; ``None``: no ``criu`` on the PATH."""
    criu_check: tuple[int, str] | None
    """``criu check``'s exit status and output; ``None`` when it was not run."""
    kernel_release: str
    euid: int
    cap_eff: int | None
    """The effective capability set from ``/proc/self/status``; ``None`` if unreadable."""


@dataclass(frozen=True, slots=True)
class Capability:
    """Whether the ``criu`` driver can work here, and every reason it cannot."""

    ok: bool
    reasons: tuple[str, ...] = ()
    driver_version: str | None = None
    criu_version: str | None = None
    kernel: str = ""
    can_remap_gpus: bool = False
    """The driver can restore a process onto GPUs other than the ones it ran on."""
    facts: Mapping[str, str] = field(default_factory=dict)

    def explain(self) -> str:
        """One line: what is missing, or that the node can checkpoint."""
        if self.ok:
            return "this node can checkpoint GPU processes with CRIU"
        return "this node cannot checkpoint GPU processes with CRIU: " + "; ".join(self.reasons)

    def to_json(self) -> dict[str, Any]:
        """Return the agent's ``GET /capability`` answer."""
        return {
            "ok": self.ok,
            "reasons": list(self.reasons),
            "driverVersion": self.driver_version,
            "criuVersion": self.criu_version,
            "kernel": self.kernel,
            "canRemapGpus": self.can_remap_gpus,
            "facts": dict(self.facts),
        }


def parse_version(text: str | None) -> tuple[int, ...] | None:
    """Return the first dotted version in ``text`` (``(570, 86, 15)``), or ``None``."""
    if not text:
        return None
    match = _VERSION.search(text)
    if match is None:
        return None
    return tuple(int(part) for part in match.groups() if part is not None)


def parse_nvidia_proc_version(text: str) -> str | None:
    """Return the driver version from ``/proc/driver/nvidia/version``.

    The first line reads ``NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15  …``
    (or ``… Open Kernel Module for x86_64  580.65.06  Release Build …``); the GCC
    version on the second line must not be taken for it.
    """
    for line in text.splitlines():
        if line.startswith("NVRM version:"):
            match = re.search(r"Module(?:\s+for\s+\S+)?\s+(\d+\.\d+(?:\.\d+)?)", line)
            if match:
                return match.group(1)
            found = re.search(r"\s(\d{3}\.\d+(?:\.\d+)?)\s", line)
            return found.group(1) if found else None
    return None


def parse_criu_version(text: str | None) -> str | None:
    """Return CRIU's version from ``criu --version`` (``Version: 4.1``)."""
    if not text:
        return None
    match = re.search(r"Version:\s*(\d+\.\d+(?:\.\d+)?)", text)
    if match:
        return match.group(1)
    version = parse_version(text)
    return ".".join(str(part) for part in version) if version else None


def _tail(text: str, lines: int = 3) -> str:
    kept = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " / ".join(kept[-lines:])


def assess(probe: Probe) -> Capability:
    """Decide from the observations; pure."""
    reasons: list[str] = []
    facts = {"driverSource": probe.driver_note}
    driver = parse_version(probe.driver_version)
    if probe.driver_version is None:
        reasons.append(f"no NVIDIA driver ({probe.driver_note})")
    elif driver is None:
        reasons.append(f"unreadable NVIDIA driver version {probe.driver_version!r}")
    elif driver[0] < MIN_DRIVER:
        reasons.append(
            f"NVIDIA driver {probe.driver_version} is older than {MIN_DRIVER}, "
            "the first with the CUDA checkpoint API"
        )
    if probe.libcuda_error is not None and probe.driver_version is not None:
        # Without a driver the library's absence says nothing new.
        reasons.append(probe.libcuda_error)
    criu_version = parse_criu_version(probe.criu_version_output)
    if probe.criu_version_output is None:
        reasons.append(
            "criu is not installed (CRIU ≥ 4.0, which has the CUDA plugin, is needed on the node)"
        )
    else:
        parsed = parse_version(criu_version)
        if parsed is None:
            reasons.append(f"unreadable criu version: {_tail(probe.criu_version_output)!r}")
        elif parsed[:2] < MIN_CRIU:
            reasons.append(f"criu {criu_version} is older than 4.0, the first with the CUDA plugin")
    if probe.criu_check is not None:
        status, output = probe.criu_check
        facts["criuCheck"] = _tail(output) or f"exit {status}"
        if status != 0:
            reasons.append(f"criu check failed (exit {status}): {_tail(output)}")
    kernel = parse_version(probe.kernel_release)
    if kernel is None:
        reasons.append(f"unreadable kernel release {probe.kernel_release!r}")
    elif kernel[:2] < MIN_KERNEL:
        reasons.append(f"kernel {probe.kernel_release} is older than 3.11, CRIU's minimum")
    admin = probe.cap_eff is not None and bool(probe.cap_eff >> CAP_SYS_ADMIN & 1)
    if probe.euid != 0 and not admin:
        reasons.append(
            "the agent runs neither as root nor with CAP_SYS_ADMIN, which CRIU and the "
            "CUDA checkpoint API need to act on another pod's process"
        )
    return Capability(
        ok=not reasons,
        reasons=tuple(reasons),
        driver_version=probe.driver_version,
        criu_version=criu_version,
        kernel=probe.kernel_release,
        can_remap_gpus=driver is not None and driver[0] >= MIN_DRIVER_REMAP,
        facts=facts,
    )


def read_driver_version(version_file: Path = NVIDIA_VERSION_FILE) -> tuple[str | None, str]:
    """Return the NVIDIA driver version and where it came from (or why it is unknown).

    NVML first (``nvmlSystemGetDriverVersion``), then the kernel module's version file.
    """
    notes: list[str] = []
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        text = version.decode() if isinstance(version, bytes) else str(version)
        return text, "NVML"
    except Exception as error:  # pynvml raises one class per NVML return code
        notes.append(f"NVML: {error}")
    try:
        found = parse_nvidia_proc_version(version_file.read_text())
    except OSError as error:
        notes.append(f"{version_file}: {error.strerror or error}")
    else:
        if found:
            return found, str(version_file)
        notes.append(f"{version_file}: no version line")
    return None, "; ".join(notes)


def read_cap_eff(status_file: Path = Path("/proc/self/status")) -> int | None:
    """Return the effective capability bits of this process."""
    try:
        for line in status_file.read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split(":", 1)[1].strip(), 16)
    except (OSError, ValueError):
        return None
    return None


def _run(argv: list[str], timeout: float) -> tuple[int, str]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return 124, f"{' '.join(argv)} timed out after {timeout:g} s"
    except OSError as error:
        return 127, str(error)
    return done.returncode, (done.stdout + done.stderr)


def probe(
    criu: str = "criu",
    libcuda: str = LIBCUDA,
    timeout: float = 30.0,
    driver_version_file: Path = NVIDIA_VERSION_FILE,
) -> Probe:
    """Observe this node; blocking (runs ``criu`` and loads ``libcuda``)."""
    driver_version, driver_note = read_driver_version(driver_version_file)
    try:
        load_library(libcuda)
        libcuda_error = None
    except CudaUnavailable as error:
        libcuda_error = str(error)
    criu_path = shutil.which(criu)
    criu_version_output: str | None = None
    criu_check: tuple[int, str] | None = None
    if criu_path is not None:
        status, output = _run([criu_path, "--version"], timeout)
        criu_version_output = output if status == 0 else f"exit {status}: {output}"
        # `criu check` needs root; it reports missing kernel features, not versions.
        criu_check = _run([criu_path, "check"], timeout)
    return Probe(
        driver_version=driver_version,
        driver_note=driver_note,
        libcuda_error=libcuda_error,
        criu_version_output=criu_version_output,
        criu_check=criu_check,
        kernel_release=platform.release(),
        euid=os.geteuid(),
        cap_eff=read_cap_eff(),
    )


async def detect(criu: str = "criu", libcuda: str = LIBCUDA) -> Capability:
    """Probe in a thread and assess."""
    return assess(await asyncio.to_thread(probe, criu, libcuda))


__all__ = [
    "MIN_CRIU",
    "MIN_DRIVER",
    "MIN_DRIVER_REMAP",
    "MIN_KERNEL",
    "Capability",
    "Probe",
    "assess",
    "detect",
    "parse_criu_version",
    "parse_nvidia_proc_version",
    "parse_version",
    "probe",
    "read_cap_eff",
    "read_driver_version",
]
