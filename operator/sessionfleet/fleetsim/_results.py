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
        }


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
