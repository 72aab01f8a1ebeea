"""What a simulation measured, and the table that compares strategies."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

# Time to first token is kept as a histogram with buckets 1% wide from 1 ms up,
# so a run of millions of turns needs a few kilobytes and p95 is exact to 1%.
_TTFT_MIN = 1e-3
_TTFT_GROWTH = 1.01
_TTFT_SCALE = 1.0 / math.log(_TTFT_GROWTH)
_TTFT_BUCKETS = 2200  # up to 1e-3 * 1.01**2200, about 3e6 s


def ttft_bucket(seconds: float) -> int:
    """Return the histogram bucket of a time to first token."""
    if seconds <= _TTFT_MIN:
        return 0
    index = int(math.log(seconds / _TTFT_MIN) * _TTFT_SCALE) + 1
    return index if index < _TTFT_BUCKETS else _TTFT_BUCKETS - 1


def bucket_upper(index: int) -> float:
    """Return the upper edge of a histogram bucket, in seconds."""
    return _TTFT_MIN * _TTFT_GROWTH**index


def new_histogram() -> list[int]:
    """Return an empty time-to-first-token histogram."""
    return [0] * _TTFT_BUCKETS


@dataclass(slots=True)
class DrainRecord:
    """One drain: how long it held and what happened to the sessions on the worker."""

    worker: str
    started: float
    finished: float | None = None
    pinned_at_start: int = 0
    migrated_with_checkpoint: int = 0
    migrated_without_checkpoint: int = 0
    released: int = 0
    """Sessions still pinned when the deadline released the hold: their cache is gone."""
    evicted: int = 0
    """Sessions whose worker went at once (strategies without a drain hold)."""

    @property
    def duration(self) -> float | None:
        """Seconds from the start of the drain until the worker could go."""
        return None if self.finished is None else self.finished - self.started


@dataclass(slots=True)
class FailureRecord:
    """One lost worker: when it failed, when it served again, and whether it restored."""

    worker: str
    failed: float
    detected: float | None = None
    ready: float | None = None
    restored_tokens: int = 0
    sessions: int = 0


@dataclass(slots=True)
class SimResult:
    """Everything one simulation run measured."""

    strategy: str
    sessions: int = 0
    turns: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    recomputed_tokens: int = 0
    """Context tokens computed before (on some worker) that a turn had to compute again."""
    output_tokens: int = 0
    sessions_lost_cache: int = 0
    """Sessions with a turn that recomputed more than half of the context they had built."""
    ttft_sum: float = 0.0
    ttft_max: float = 0.0
    ttft_histogram: list[int] = field(default_factory=new_histogram)
    held_turns: int = 0
    """Turns held while their session migrated or its worker restored."""
    retried_turns: int = 0
    """Times a turn found no worker (none had room, or its worker was down) and waited."""
    checkpoints: int = 0
    checkpoint_bytes: int = 0
    drains: list[DrainRecord] = field(default_factory=list)
    failures: list[FailureRecord] = field(default_factory=list)
    end_time: float = 0.0
    """Virtual seconds until the last session finished."""
    sessions_failed: int = 0
    """Sessions whose client gave up waiting for a first token (``client_timeout_seconds``)."""
    admitted: int = 0
    """Measured sessions whose first turn was placed."""
    admission_max: float = 0.0
    admission_histogram: list[int] = field(default_factory=new_histogram)
    """Seconds from a session's arrival until its first turn was placed: the gateway's
    queue and any retries for room; not part of its time to first token."""
    queue_max: int = 0
    queue_area: float = 0.0
    """The admission queue's length integrated over time, for its time-weighted mean."""
    session_seconds_histogram: list[int] = field(default_factory=new_histogram)
    """Seconds from arrival to last answer of measured sessions that completed."""
    completed_measured: int = 0
    turns_on_target: int = 0
    """Measured turns whose first token came within ``ttft_target_seconds``."""
    prefill_busy: float = 0.0
    """Seconds of prefill computed in the measured turns, all workers together."""
    window_start: float = 0.0
    window_end: float = 0.0
    """The measured window: [warmup, min(measure-until, the last measured turn)]."""
    workers: int = 0
    bin_seconds: float = 60.0
    bin_input: list[int] = field(default_factory=list)
    bin_cached: list[int] = field(default_factory=list)
    bin_ttft: list[float] = field(default_factory=list)
    bin_turns: list[int] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        """Share of prompt tokens served from the prefix cache."""
        return self.cached_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def ttft_mean(self) -> float:
        """Mean time to first token, in seconds."""
        return self.ttft_sum / self.turns if self.turns else 0.0

    def ttft_quantile(self, q: float) -> float:
        """Time to first token at quantile ``q`` (upper bucket edge, within 1%)."""
        if not self.turns:
            return 0.0
        rank = q * self.turns
        seen = 0
        for index, count in enumerate(self.ttft_histogram):
            seen += count
            if seen >= rank and count:
                return min(bucket_upper(index), self.ttft_max)
        return self.ttft_max

    @property
    def window(self) -> float:
        """Seconds of virtual time that were measured."""
        return max(self.window_end - self.window_start, 1e-9)

    @property
    def turns_per_second(self) -> float:
        """Measured turns per second of the window."""
        return self.turns / self.window

    @property
    def output_tokens_per_second(self) -> float:
        """Measured output tokens per second of the window."""
        return self.output_tokens / self.window

    @property
    def goodput(self) -> float:
        """Turns per second that met the time-to-first-token target."""
        return self.turns_on_target / self.window

    @property
    def prefill_utilisation(self) -> float:
        """Share of the workers' prefill time that the measured turns kept busy."""
        return self.prefill_busy / (self.window * self.workers) if self.workers else 0.0

    @property
    def queue_mean(self) -> float:
        """Time-weighted mean length of the admission queue over the run."""
        return self.queue_area / self.end_time if self.end_time else 0.0

    @property
    def failed_share(self) -> float:
        """Share of sessions (completed or failed) whose client gave up."""
        total = self.sessions + self.sessions_failed
        return self.sessions_failed / total if total else 0.0

    def admission_quantile(self, q: float) -> float:
        """Admission wait at quantile ``q`` (upper bucket edge, within 1%)."""
        return _quantile(self.admission_histogram, self.admitted, q, self.admission_max)

    def session_quantile(self, q: float) -> float:
        """Session completion time at quantile ``q`` (upper bucket edge, within 1%)."""
        return _quantile(self.session_seconds_histogram, self.completed_measured, q, math.inf)

    @property
    def ttft_p95(self) -> float:
        """95th percentile time to first token, in seconds."""
        return self.ttft_quantile(0.95)

    @property
    def drain_durations(self) -> list[float]:
        """Seconds each finished drain took."""
        return [d.duration for d in self.drains if d.duration is not None]

    def as_dict(self) -> dict[str, object]:
        """Return the headline figures, for JSON output."""
        return {
            "strategy": self.strategy,
            "sessions": self.sessions,
            "turns": self.turns,
            "input_tokens": self.input_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_rate": round(self.hit_rate, 5),
            "recomputed_tokens": self.recomputed_tokens,
            "output_tokens": self.output_tokens,
            "ttft_mean_s": round(self.ttft_mean, 4),
            "ttft_p95_s": round(self.ttft_p95, 4),
            "sessions_lost_cache": self.sessions_lost_cache,
            "held_turns": self.held_turns,
            "retried_turns": self.retried_turns,
            "checkpoints": self.checkpoints,
            "drains": [
                {
                    "worker": d.worker,
                    "started_s": round(d.started, 1),
                    "duration_s": None if d.duration is None else round(d.duration, 1),
                    "migrated_with_checkpoint": d.migrated_with_checkpoint,
                    "migrated_without_checkpoint": d.migrated_without_checkpoint,
                    "released": d.released,
                    "evicted": d.evicted,
                }
                for d in self.drains
            ],
            "failures": [
                {
                    "worker": f.worker,
                    "failed_s": round(f.failed, 1),
                    "ready_s": None if f.ready is None else round(f.ready, 1),
                    "restored_tokens": f.restored_tokens,
                    "sessions": f.sessions,
                }
                for f in self.failures
            ],
            "end_time_s": round(self.end_time, 1),
            "ttft_p50_s": round(self.ttft_quantile(0.5), 4),
            "ttft_p99_s": round(self.ttft_quantile(0.99), 4),
            "ttft_max_s": round(self.ttft_max, 4),
            "admission_wait_p50_s": round(self.admission_quantile(0.5), 4),
            "admission_wait_p99_s": round(self.admission_quantile(0.99), 4),
            "admission_wait_max_s": round(self.admission_max, 4),
            "queue_mean": round(self.queue_mean, 2),
            "queue_max": self.queue_max,
            "session_time_p50_s": round(self.session_quantile(0.5), 2),
            "session_time_p99_s": round(self.session_quantile(0.99), 2),
            "sessions_failed": self.sessions_failed,
            "window_s": [round(self.window_start, 1), round(self.window_end, 1)],
            "turns_per_s": round(self.turns_per_second, 4),
            "output_tokens_per_s": round(self.output_tokens_per_second, 2),
            "goodput_turns_per_s": round(self.goodput, 4),
            "turns_on_target": self.turns_on_target,
            "prefill_utilisation": round(self.prefill_utilisation, 4),
        }


def _quantile(histogram: list[int], total: int, q: float, ceiling: float) -> float:
    if not total:
        return 0.0
    rank = q * total
    seen = 0
    for index, count in enumerate(histogram):
        seen += count
        if seen >= rank and count:
            return min(bucket_upper(index), ceiling)
    return ceiling


def _seconds(value: float) -> str:
    if value >= 600:
        return f"{value / 60:.0f}m"
    return f"{value:.2f}s" if value < 10 else f"{value:.0f}s"


def format_fair_table(results: Sequence[SimResult], target: float) -> str:
    """Return the steady-state comparison: latency, admission, goodput, utilisation."""
    headers = (
        "strategy",
        "hit rate",
        "TTFT p50",
        "p99",
        "max",
        "admit p50",
        "p99",
        "queue mean/max",
        "session p50",
        "turns/s",
        "tok/s",
        f"on target ({target:g}s)",
        "failed",
        "prefill util",
        "sim time",
    )
    rows = [
        (
            r.strategy,
            f"{r.hit_rate:.1%}",
            _seconds(r.ttft_quantile(0.5)),
            _seconds(r.ttft_quantile(0.99)),
            _seconds(r.ttft_max),
            _seconds(r.admission_quantile(0.5)),
            _seconds(r.admission_quantile(0.99)),
            f"{r.queue_mean:.0f}/{r.queue_max}",
            _seconds(r.session_quantile(0.5)),
            f"{r.turns_per_second:.2f}",
            f"{r.output_tokens_per_second:.0f}",
            f"{r.turns_on_target / r.turns:.1%}" if r.turns else "-",
            f"{r.sessions_failed} ({r.failed_share:.1%})",
            f"{r.prefill_utilisation:.0%}",
            _seconds(r.end_time),
        )
        for r in results
    ]
    return _align(headers, rows)


def _align(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(row[i])) for row in (headers, *rows)) for i in range(len(headers))]
    lines = []
    for number, row in enumerate((headers, *rows)):
        cells = [
            str(cell).ljust(width) if i == 0 else str(cell).rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
        if number == 0:
            lines.append("  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _tokens(count: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.1f}{unit}"
    return str(count)


def _drains(result: SimResult) -> str:
    durations = result.drain_durations
    if not result.drains:
        return "-"
    if not durations:
        return "unfinished"
    text = f"{sum(durations) / len(durations):.0f}s"
    if len(durations) > 1:
        text += f" (max {max(durations):.0f}s)"
    if len(durations) < len(result.drains):
        text += f" +{len(result.drains) - len(durations)} unfinished"
    return text


def format_table(results: Sequence[SimResult]) -> str:
    """Return the strategy comparison as an aligned text table."""
    headers = (
        "strategy",
        "hit rate",
        "recomputed",
        "TTFT mean",
        "TTFT p95",
        "drain (mean)",
        "lost cache",
    )
    rows = [
        (
            r.strategy,
            f"{r.hit_rate:.1%}",
            _tokens(r.recomputed_tokens),
            f"{r.ttft_mean:.2f}s",
            f"{r.ttft_p95:.2f}s",
            _drains(r),
            f"{r.sessions_lost_cache} ({r.sessions_lost_cache / r.sessions:.0%})"
            if r.sessions
            else "0",
        )
        for r in results
    ]
    return _align(headers, rows)
