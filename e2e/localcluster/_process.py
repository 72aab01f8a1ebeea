"""Start, identify and stop the cluster's processes.

Every component runs in its own session (so its process group is its pid), with its
output in a log file. A component is recorded by pid *and* its start time from
``/proc/<pid>/stat``, so a later ``down`` from another process never signals an
unrelated process that happens to reuse the pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

#: Popen handles of processes this interpreter started, so they can be reaped (a
#: killed child stays a zombie, and looks alive in /proc, until its parent waits).
_children: dict[int, subprocess.Popen[bytes]] = {}


@dataclass(frozen=True)
class ProcessRecord:
    """A started process: enough to find it again from another interpreter."""

    name: str
    pid: int
    start_ticks: int
    log: str

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-serialisable dict."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ProcessRecord:
        """Rebuild a record written by ``to_json``."""
        return cls(str(data["name"]), int(data["pid"]), int(data["start_ticks"]), str(data["log"]))


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` from the state (field 3) on, or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses; the fields
    # after the last ')' are fixed: state is field 3, starttime field 22.
    return stat[stat.rindex(")") + 2 :].split()


def start_ticks(pid: int) -> int | None:
    """Return the start time of ``pid`` in clock ticks, or None if it is gone.

    A zombie counts as gone: it has exited and only waits to be reaped.
    """
    fields = _stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def is_stopped(record: ProcessRecord) -> bool:
    """Whether the recorded process runs but is stopped (SIGSTOP: state ``T``)."""
    fields = _stat_fields(record.pid)
    return is_running(record) and fields is not None and fields[0] == "T"


def is_running(record: ProcessRecord) -> bool:
    """Whether the recorded process still runs (same pid and same start time)."""
    child = _children.get(record.pid)
    if child is not None and child.poll() is not None:
        return False
    return start_ticks(record.pid) == record.start_ticks


def spawn(
    name: str,
    argv: Sequence[str],
    log: Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> ProcessRecord:
    """Start ``argv`` in a new session with stdout and stderr appended to ``log``.

    The new session keeps terminal signals (Ctrl-C) away from the components, so
    the harness decides the order of shutdown, and lets ``stop`` signal the whole
    process group, children included.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as output:
        output.write(f"--- {time.strftime('%H:%M:%S')} {' '.join(argv)}\n".encode())
        output.flush()
        child = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
            close_fds=True,
        )
    _children[child.pid] = child
    ticks = start_ticks(child.pid)
    # A process that already exited has no start time; record 0 so is_running is False.
    return ProcessRecord(name, child.pid, ticks or 0, str(log))


def exit_code(record: ProcessRecord) -> int | None:
    """The exit status of a process this interpreter started and that has exited."""
    child = _children.get(record.pid)
    return child.poll() if child is not None else None


def _signal_group(record: ProcessRecord, signum: int) -> None:
    """Signal the process group of ``record`` if the process is still the same one."""
    if not is_running(record):
        return
    try:
        os.killpg(record.pid, signum)
    except ProcessLookupError:
        pass


def _wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    """Poll ``condition`` every 10 ms for up to ``timeout`` seconds; its last value."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return condition()
        time.sleep(0.01)
    return True


def _reap(record: ProcessRecord) -> None:
    """Wait for a child of this interpreter that has exited, so it is no zombie."""
    child = _children.pop(record.pid, None)
    if child is not None:
        try:
            child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def stop(record: ProcessRecord, timeout: float = 10.0) -> None:
    """SIGTERM the process group, wait up to ``timeout`` seconds, then SIGKILL it.

    A stopped (SIGSTOPped) group is continued right after the SIGTERM, so that it
    can act on it instead of waiting out ``timeout``.
    """
    was_running = is_running(record)
    _signal_group(record, signal.SIGTERM)
    _signal_group(record, signal.SIGCONT)
    if not _wait_until(lambda: not is_running(record), timeout):
        _signal_group(record, signal.SIGKILL)
        _wait_until(lambda: not is_running(record), 5)
    if was_running:
        # Children of the group leader may outlive it; the group id stays valid
        # while any member lives, and it is ours because the leader was ours.
        try:
            os.killpg(record.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    _reap(record)


def kill(record: ProcessRecord, timeout: float = 10.0) -> bool:
    """SIGKILL the process group and wait until the process is gone.

    A child of this interpreter is reaped; another one counts as gone once it is a
    zombie (its own parent reaps it). Returns False if it still ran after
    ``timeout`` seconds (uninterruptible sleep), True otherwise.
    """
    _signal_group(record, signal.SIGKILL)
    gone = _wait_until(lambda: not is_running(record), timeout)
    if gone:
        _reap(record)
    return gone


def pause(record: ProcessRecord, timeout: float = 5.0) -> bool:
    """SIGSTOP the process group; True once the process is stopped, within ``timeout``."""
    _signal_group(record, signal.SIGSTOP)
    return _wait_until(lambda: is_stopped(record), timeout)


def resume(record: ProcessRecord, timeout: float = 5.0) -> bool:
    """SIGCONT the process group; True once the process is no longer stopped.

    Harmless on a process that runs or is gone (nothing is signalled then).
    """
    _signal_group(record, signal.SIGCONT)
    return _wait_until(lambda: not is_stopped(record), timeout)


def kwok_pod_cidrs_in_use() -> set[int]:
    """Second octets of the ``--cidr=127.N...`` of every KWOK running on this machine.

    Read from /proc so that clusters of other state directories, other checkouts
    and other harness versions all count.
    """
    octets: set[int] = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if not argv or not argv[0].endswith(b"kwok"):
            continue
        for arg in argv:
            if arg.startswith(b"--cidr=127."):
                octets.add(int(arg.split(b".")[1]))
    return octets


def log_tail(path: str | Path, lines: int = 25) -> str:
    """Return the last ``lines`` lines of a log file, for error messages."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])
