"""How long the simulated engine takes: prefill per uncached token, decode per output token.

The default is free (every delay zero), so tests and the router benchmark measure the
data path, not a pretend GPU. ``REALISTIC`` approximates one modern GPU serving a
mid-sized model: 50 µs of prefill per prompt token not served from cache (20K tokens/s)
and 20 ms per generated token (50 tokens/s per sequence). With the agentic figures in
docs/background.md (~2,242 new tokens and a few hundred generated per turn) that spends well over
90% of a turn generating, as the published traces do (91.0-98.6%), and makes a cache
miss on an 80K-token context cost about 4 s of prefill: the penalty sessionfleet avoids.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CostModel:
    """Simulated time per request, prompt token and generated token (seconds)."""

    prefill_seconds_per_token: float = 0.0
    decode_seconds_per_token: float = 0.0
    request_overhead_seconds: float = 0.0

    def __post_init__(self) -> None:
        if (
            min(
                self.prefill_seconds_per_token,
                self.decode_seconds_per_token,
                self.request_overhead_seconds,
            )
            < 0
        ):
            raise ValueError("simulated times cannot be negative")

    @property
    def free(self) -> bool:
        """Whether every delay is zero (the engine then never sleeps)."""
        return not (
            self.prefill_seconds_per_token
            or self.decode_seconds_per_token
            or self.request_overhead_seconds
        )

    def prefill_seconds(self, uncached_tokens: int) -> float:
        """Time to first token: the fixed overhead plus prefill of the uncached tokens."""
        return self.request_overhead_seconds + uncached_tokens * self.prefill_seconds_per_token

    def decode_seconds(self, tokens: int = 1) -> float:
        """Time to generate ``tokens`` tokens after the first."""
        return tokens * self.decode_seconds_per_token


FREE = CostModel()
"""No simulated delay: the default."""

REALISTIC = CostModel(
    prefill_seconds_per_token=50e-6,
    decode_seconds_per_token=20e-3,
    request_overhead_seconds=5e-3,
)
"""One modern GPU serving a mid-sized model (see the module docstring)."""
