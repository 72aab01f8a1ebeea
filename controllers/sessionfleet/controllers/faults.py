"""Fault isolation: one object's failure never stops another object's reconcile.

The fleet loop runs one job per worker and per session. A job that raises — a bug
tripped by one odd object, an engine reporting nonsense, a pod the API server refuses
(422) — is caught here: the failure is recorded on that object as the condition
``Reconciled=False`` with reason ``ReconcileError`` and the error as the message, it is
logged once (again only when the message changes, or after ``LOG_AGAIN_SECONDS``),
and every other job and the next pass go on. A write conflict (409) is not a fault:
the next pass reads the object again. Nor is a write refused because this replica
no longer leads: the object is fine, and the new leader takes it from here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

from sessionfleet.api import ConditionStatus, ConditionType, Reason
from sessionfleet.controllers.records import Key
from sessionfleet.kube import Conflict, KubeError, NotFound, NotLeading, Resource
from sessionfleet.policy.worker import ConditionPlan
from sessionfleet.resources.status import merge_conditions

log = logging.getLogger(__name__)

LOG_AGAIN_SECONDS: Final = 300.0
MAX_MESSAGE_CHARS: Final = 512
"""Condition messages are for people; a traceback belongs in the log."""


@dataclass(frozen=True, slots=True)
class Job:
    """One object's reconcile step in a pass of the fleet loop."""

    resource: Resource
    key: Key
    run: Callable[[], Awaitable[None]]


def describe(error: BaseException) -> str:
    """Return a one-line account of a failure, bounded for a condition message."""
    text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    text = " ".join(text.split())
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 1] + "…"


def reconciled_condition(message: str | None) -> ConditionPlan:
    """Return the ``Reconciled`` condition for an object's last failure (None: no failure)."""
    if message is None:
        return ConditionPlan(
            ConditionType.RECONCILED, ConditionStatus.TRUE, Reason.RECONCILE_SUCCEEDED, ""
        )
    return ConditionPlan(
        ConditionType.RECONCILED, ConditionStatus.FALSE, Reason.RECONCILE_ERROR, message
    )


@dataclass
class Faults:
    """The objects whose last reconcile failed, and when each failure was last logged."""

    current: dict[tuple[str, Key], str] = field(default_factory=dict)
    _logged: dict[tuple[str, Key], tuple[str, float]] = field(default_factory=dict)

    def of(self, resource: Resource, key: Key) -> str | None:
        """Return the object's current failure message, if its last job failed."""
        return self.current.get((resource.plural, key))

    def failed(self, resource: Resource, key: Key, message: str) -> bool:
        """Record a failure; return whether to log it (new, changed, or not logged lately)."""
        entry = (resource.plural, key)
        self.current[entry] = message
        last = self._logged.get(entry)
        now = time.monotonic()
        if last is not None and last[0] == message and now - last[1] < LOG_AGAIN_SECONDS:
            return False
        self._logged[entry] = (message, now)
        return True

    def succeeded(self, resource: Resource, key: Key) -> bool:
        """Forget a failure after a job ran clean; return whether there was one."""
        entry = (resource.plural, key)
        self._logged.pop(entry, None)
        return self.current.pop(entry, None) is not None


def is_fault(error: Exception) -> bool:
    """Whether a job's exception is a fault to record (a 409 only means: read again)."""
    return not isinstance(error, (Conflict, NotLeading))


async def run_isolated(
    job: Job,
    faults: Faults,
    record: Callable[[Job, str, datetime], Awaitable[None]],
    now: datetime,
) -> bool:
    """Run one job; record its failure on its object instead of letting it spread.

    Returns whether the job ran clean (a conflict or a failure: look at it again).
    """
    try:
        await job.run()
    except Exception as error:  # the loop must outlive any one object's failure
        if not is_fault(error):
            log.debug("%s %s: %s; retried next pass", job.resource.plural, job.key, error)
            return False
        message = describe(error)
        if faults.failed(job.resource, job.key, message):
            log.warning(
                "%s %s/%s cannot be reconciled: %s",
                job.resource.plural,
                *job.key,
                message,
                exc_info=not isinstance(error, KubeError),
            )
        try:
            await record(job, message, now)
        except NotFound:
            pass  # deleted meanwhile
        except KubeError as write_error:
            log.warning(
                "cannot record the failure on %s %s: %s", job.resource.plural, job.key, write_error
            )
        return False
    faults.succeeded(job.resource, job.key)
    return True


def with_condition(
    existing: Iterable[Mapping[str, Any]], plan: ConditionPlan, now: datetime
) -> list[dict[str, Any]]:
    """Return ``existing`` conditions with ``plan`` put in place of its type's entry."""
    others = [dict(c) for c in existing if c.get("type") != plan.type.value]
    return [*others, *merge_conditions(existing, [plan], now)]
