"""Where a process's CPU goes during a phase of a benchmark: py-spy, summarised.

py-spy samples another process's Python stacks from outside (no change to it, and
``--nonblocking`` does not even pause it); its raw output is one line per distinct
stack, ``frame;frame;...;frame count``. :func:`summarize` turns that into the shares
the bench reports: by function, the share of samples spent in it (self) and under it
(inclusive), so a figure like "the status PATCH through httpx 20%" is read, not
guessed. Install py-spy with ``make profile-tools``.

    with Recording(pid, Path("build/profile-fill.txt")) as recording:
        ...  # the phase
    print(recording.summary["inclusive"][:10])
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import TracebackType
from typing import Any

_FRAME = re.compile(r"^(?P<function>.+?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def py_spy() -> str:
    """The py-spy executable: the virtual environment's, else the PATH's.

    Raises:
        SystemExit: py-spy is not installed, with how to install it.
    """
    beside = Path(sys.executable).with_name("py-spy")
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if found is None:
        raise SystemExit("py-spy is not installed: run `make profile-tools`")
    return found


def frame_name(frame: str) -> str:
    """``function (path/to/module.py:line)`` as ``module.py:function``, line dropped."""
    match = _FRAME.match(frame.strip())
    if match is None:
        return frame.strip()
    return f"{Path(match['file']).name}:{match['function']}"


def summarize(raw: str, top: int = 25) -> dict[str, Any]:
    """Shares of samples by function from py-spy's raw (collapsed) output."""
    own: Counter[str] = Counter()
    under: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        samples = int(count)
        total += samples
        frames = [frame_name(f) for f in stack.split(";") if f]
        if frames:
            own[frames[-1]] += samples
        for name in set(frames):
            under[name] += samples

    def shares(counter: Counter[str]) -> list[tuple[str, float]]:
        return [(name, round(100 * n / total, 1)) for name, n in counter.most_common(top)]

    return {"samples": total, "self_pct": shares(own), "inclusive_pct": shares(under)}


class Recording:
    """py-spy recording ``pid`` until the block ends; then :attr:`summary`."""

    def __init__(self, pid: int, out: Path, *, rate: int = 100) -> None:
        self.pid = pid
        self.out = out
        self.rate = rate
        self.process: subprocess.Popen[bytes] | None = None
        self.summary: dict[str, Any] = {}

    def __enter__(self) -> Recording:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        argv = [py_spy(), "record", "--pid", str(self.pid), "--format", "raw"]
        argv += ["--rate", str(self.rate), "--nonblocking", "--output", str(self.out)]
        self.process = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        )
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        try:
            _, stderr = self.process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            _, stderr = self.process.communicate()
        if self.out.exists():
            self.summary = summarize(self.out.read_text())
        else:
            self.summary = {"error": stderr.decode(errors="replace")[-500:]}
