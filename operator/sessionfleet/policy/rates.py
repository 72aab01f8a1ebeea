"""A token bucket: a rate with a burst, for anything that must not flood (pure)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TokenBucket:
    """``rate`` tokens a second, at most ``burst`` saved up."""

    rate: float
    burst: float
    tokens: float
    updated: float

    @classmethod
    def full(cls, rate: float, burst: float, now: float) -> TokenBucket:
        """Return a bucket that starts with its whole burst."""
        return cls(rate, burst, burst, now)

    def refill(self, now: float) -> None:
        """Add the tokens earned since the last look."""
        if now > self.updated:
            self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
            self.updated = now

    def wait(self, now: float) -> float:
        """Seconds until one token is there (0 when one is there now)."""
        self.refill(now)
        return 0.0 if self.tokens >= 1 else (1 - self.tokens) / self.rate

    def available(self, now: float) -> int:
        """Whole tokens there now."""
        self.refill(now)
        return int(self.tokens)

    def take(self) -> None:
        """Spend one token; call after :meth:`wait` answered 0."""
        self.tokens -= 1


__all__ = ["TokenBucket"]
