"""What the controllers need of leader election, and the no-election default.

The operator's entry point (:mod:`sessionfleet.operator.main`) hands the fleet either a
:class:`~sessionfleet.operator.leader.LeaderElector` (``--leader-elect``) or
:class:`Solo`; the controllers read only :class:`Leadership`, so they do not import the
election.
"""

from __future__ import annotations

import asyncio
from typing import Protocol


class Leadership(Protocol):
    """Whether this replica may write, and what the health endpoint says of the Lease."""

    @property
    def acquired(self) -> asyncio.Event:
        """Set while this replica leads (waited on before leader-only work starts)."""

    @property
    def identity(self) -> str:
        """Return this replica's name in the election."""

    @property
    def lease(self) -> str:
        """Return the Lease's name (empty without an election)."""

    @property
    def leading(self) -> bool:
        """Whether this replica holds the Lease now."""

    @property
    def in_touch(self) -> bool:
        """Whether the Lease was read or renewed recently enough to trust ``leading``."""

    @property
    def holder(self) -> str | None:
        """Return the Lease's holder as last read."""

    async def run(self) -> None:
        """Take part in the election until cancelled."""

    async def release(self) -> None:
        """Give the Lease up, so a standby need not wait for it to expire."""


class Solo:
    """No election: this process is the only writer (``--leader-elect`` not given)."""

    def __init__(self) -> None:
        self.acquired = asyncio.Event()
        self.acquired.set()
        self.identity = "solo"
        self.lease = ""

    @property
    def leading(self) -> bool:
        """Always: nobody else writes."""
        return True

    @property
    def in_touch(self) -> bool:
        """Always: there is no Lease to reach."""
        return True

    @property
    def holder(self) -> str | None:
        """Return this process's identity."""
        return self.identity

    async def run(self) -> None:
        """Nothing to renew."""

    async def release(self) -> None:
        """Nothing to release."""
