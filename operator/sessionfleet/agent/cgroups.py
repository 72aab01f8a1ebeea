"""Which pod and container a process belongs to, from ``/proc/<pid>/cgroup``.

The kubelet puts each pod in a cgroup named after the pod's UID and each container in
one named after its runtime ID, so a host PID (NVML reports host PIDs; the agent runs
with ``hostPID``) maps to its pod without asking anyone. The layouts seen in practice:

- cgroup v2, systemd driver (the common case)::

    0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_with_underscores>.slice/cri-containerd-<id>.scope

- cgroup v1, cgroupfs driver: ``4:memory:/kubepods/besteffort/pod<uid>/<id>``;
- Guaranteed pods have no QoS level (``kubepods-pod<uid>.slice``, ``/kubepods/pod<uid>``);
- CRI-O names containers ``crio-<id>.scope`` (and its monitor ``crio-conmon-<id>.scope``,
  which is not the container), Docker ``docker-<id>.scope``;
- static pods carry a 32-hex config hash instead of a UUID;
- inside a cgroup namespace the path is relative (``0::/../../kubepods-…``).

Parsing is pure (:func:`pod_of_cgroup`, :func:`container_root`); reading ``/proc`` is
:func:`scan` and :func:`find_container_pid`, blocking, for a thread.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

_POD = re.compile(
    r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}|[0-9a-f]{32})"
    r"(?:\.slice)?(?=/|$)"
)
_CONTAINER = re.compile(
    r"^/(?:(?:cri-containerd|crio|docker|containerd)-)?([0-9a-f]{64})(?:\.scope)?(?:/|$)"
)


@dataclass(frozen=True, slots=True)
class PodRef:
    """A process's pod (by UID) and container (by runtime ID, ``""`` when not in one)."""

    uid: str
    container_id: str = ""


@dataclass(frozen=True, slots=True)
class ProcInfo:
    """What the agent reads of one process."""

    pid: int
    ppid: int
    start: int
    """Start time in clock ticks after boot (``/proc/<pid>/stat`` field 22)."""
    pod: PodRef | None


def normalise_container_id(container_id: str) -> str:
    """Strip the runtime scheme of a pod status's ``containerID`` (``containerd://…``)."""
    return container_id.split("://", 1)[-1].strip().lower()


def pod_of_cgroup(text: str) -> PodRef | None:
    """Return the pod and container named by a ``/proc/<pid>/cgroup`` file, if any."""
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        match = _POD.search(path)
        if match is None:
            continue
        uid = match.group(1).replace("_", "-")
        container = _CONTAINER.match(path[match.end() :])
        return PodRef(uid, container.group(1) if container else "")
    return None


def parse_stat(text: str) -> tuple[int, int]:
    """Return ``(ppid, start time)`` from ``/proc/<pid>/stat``.

    The command name (field 2) may hold spaces and parentheses, so fields are counted
    after its last closing parenthesis.
    """
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), int(fields[19])


def container_root(processes: Iterable[ProcInfo]) -> int:
    """Return the container's main process.

    That is its earliest-started process whose parent is outside the container
    (``kubectl exec`` sessions are roots too, but start later).
    """
    members = list(processes)
    pids = {p.pid for p in members}
    roots = [p for p in members if p.ppid not in pids]
    if not roots:
        raise LookupError("no process of the container")
    return min(roots, key=lambda p: (p.start, p.pid)).pid


def scan(proc: Path = Path("/proc")) -> list[ProcInfo]:
    """Read every process's parent, start time and pod; blocking."""
    found: list[ProcInfo] = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid, start = parse_stat((entry / "stat").read_text())
            pod = pod_of_cgroup((entry / "cgroup").read_text())
        except (OSError, ValueError, IndexError):
            continue  # the process ended while it was read, or is not ours to read
        found.append(ProcInfo(int(entry.name), ppid, start, pod))
    return found


def pods_of(processes: Iterable[ProcInfo]) -> Mapping[int, PodRef]:
    """Return PID → pod for the processes that are in a pod."""
    return {p.pid: p.pod for p in processes if p.pod is not None}


def find_container_pid(pod_uid: str, container_id: str, proc: Path = Path("/proc")) -> int:
    """Return the main PID of a pod's container on this node; :class:`LookupError` if none."""
    wanted = PodRef(pod_uid.lower(), normalise_container_id(container_id))
    members = [p for p in scan(proc) if p.pod == wanted]
    if not members:
        raise LookupError(
            f"no process of container {wanted.container_id[:12]} of pod {wanted.uid} on this "
            "node (is the agent running with hostPID?)"
        )
    return container_root(members)


__all__ = [
    "PodRef",
    "ProcInfo",
    "container_root",
    "find_container_pid",
    "normalise_container_id",
    "parse_stat",
    "pod_of_cgroup",
    "pods_of",
    "scan",
]
