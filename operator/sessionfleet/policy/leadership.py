"""Leader election on a ``coordination.k8s.io`` Lease: the decisions, without I/O.

The rules are those of client-go's ``tools/leaderelection``, which every Kubernetes
controller manager follows:

* A candidate never trusts another machine's clock. It remembers when *it* last saw
  the Lease record change (``Observation.seen_at``, its own monotonic clock), and
  presumes the holder alive until ``leaseDurationSeconds`` have passed since then.
* A leader keeps the lead only while its last successful renewal, timed from when the
  request was *sent*, is younger than ``renew_deadline``, which is shorter than the
  lease duration: it stops writing before any candidate may take over
  (:func:`still_leading`).
* Every write of the Lease carries the resourceVersion it was decided from, so of two
  candidates racing for an expired Lease exactly one wins (the other gets 409).

:class:`LeaderElector <sessionfleet.operator.leader.LeaderElector>` does the I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from typing import Any, Final

JITTER_FACTOR: Final = 1.2
"""client-go's: a retry waits up to this factor times the retry period."""
WRITE_SHARE_OF_MARGIN: Final = 0.8
"""A write's whole life is bounded by this share of the margin; the rest allows for the
two replicas' clocks running at slightly different rates and for the time a renewal's
answer takes to come back."""


@dataclass(frozen=True, slots=True)
class ElectionTiming:
    """How long a Lease lasts, how long a leader tries to renew it, how often anyone tries."""

    lease_duration: timedelta = timedelta(seconds=15)
    renew_deadline: timedelta = timedelta(seconds=10)
    retry_period: timedelta = timedelta(seconds=2)

    @property
    def margin(self) -> float:
        """Seconds between the leader's gate closing and the earliest takeover."""
        return (self.lease_duration - self.renew_deadline).total_seconds()

    @property
    def write_timeout(self) -> float:
        """The longest a write may take, from its gate check to its answer.

        A write admitted while the gate was open (before ``renewed_at + renew_deadline``)
        and bounded by this lands before ``renewed_at + lease_duration``: before any
        standby, which waits a whole lease duration from when it saw that renewal
        (after it was sent), may take over. So ``write_timeout < lease_duration -
        renew_deadline`` (docs/operator.md, "Fencing").
        """
        return self.margin * WRITE_SHARE_OF_MARGIN

    def problems(self) -> list[str]:
        """Return what is wrong with these settings (client-go's checks); empty if valid."""
        lease, renew, retry = (
            self.lease_duration.total_seconds(),
            self.renew_deadline.total_seconds(),
            self.retry_period.total_seconds(),
        )
        found = []
        if retry <= 0:
            found.append("the retry period must be positive")
        if lease <= renew:
            found.append(
                f"the lease duration ({lease:g} s) must be longer than the renew deadline "
                f"({renew:g} s): the margin is what keeps a deposed leader from writing "
                "after its successor starts"
            )
        if renew <= retry * JITTER_FACTOR:
            found.append(
                f"the renew deadline ({renew:g} s) must be longer than {JITTER_FACTOR} times "
                f"the retry period ({retry:g} s)"
            )
        if lease < 1 or lease != int(lease):
            found.append(f"the lease duration ({lease:g} s) must be a whole number of seconds")
        return found


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """What a candidate reads from the Lease."""

    holder: str
    """``spec.holderIdentity``; empty when nobody holds it (released)."""
    duration_seconds: int
    transitions: int
    acquire_time: str | None
    resource_version: str


@dataclass(frozen=True, slots=True)
class Observation:
    """A Lease record and when this candidate first saw it (its monotonic clock)."""

    record: LeaseRecord
    seen_at: float


class Step(Enum):
    """What a candidate does with the Lease now."""

    CREATE = "create the Lease, holding it"
    RENEW = "renew the Lease this candidate holds"
    TAKE = "take over the Lease: released, or its holder stopped renewing it"
    WAIT = "wait: another candidate holds the Lease and renews it"


def lease_record(body: Mapping[str, Any]) -> LeaseRecord:
    """Read a Lease object (as the API server returns it)."""
    spec = body.get("spec") or {}
    metadata = body.get("metadata") or {}
    return LeaseRecord(
        holder=str(spec.get("holderIdentity") or ""),
        duration_seconds=int(spec.get("leaseDurationSeconds") or 0),
        transitions=int(spec.get("leaseTransitions") or 0),
        acquire_time=spec.get("acquireTime"),
        resource_version=str(metadata.get("resourceVersion") or ""),
    )


def observe(previous: Observation | None, record: LeaseRecord, now: float) -> Observation:
    """Remember ``record``; its clock starts again only when the record changed.

    Every renewal changes the resourceVersion, so a holder that renews keeps moving
    ``seen_at`` forward, and one that stopped leaves it behind.
    """
    if previous is not None and previous.record == record:
        return previous
    return Observation(record, now)


def next_step(observation: Observation | None, identity: str, now: float) -> Step:
    """Decide from the last observation (``None``: the Lease does not exist)."""
    if observation is None:
        return Step.CREATE
    record = observation.record
    if record.holder == identity:
        return Step.RENEW
    if not record.holder:
        return Step.TAKE
    if now < observation.seen_at + max(record.duration_seconds, 1):
        return Step.WAIT
    return Step.TAKE


def still_leading(renewed_at: float | None, now: float, timing: ElectionTiming) -> bool:
    """Whether a leader whose last renewal was *sent* at ``renewed_at`` may still write."""
    if renewed_at is None:
        return False
    return now < renewed_at + timing.renew_deadline.total_seconds()


def transitions_after(record: LeaseRecord | None, identity: str) -> int:
    """``leaseTransitions`` once ``identity`` holds the Lease: one more on a change of holder."""
    if record is None:
        return 0
    return record.transitions if record.holder == identity else record.transitions + 1


__all__ = [
    "ElectionTiming",
    "LeaseRecord",
    "Observation",
    "Step",
    "lease_record",
    "next_step",
    "observe",
    "still_leading",
    "transitions_after",
]
