"""DrainPolicy status: which workers each policy governs, and what is wrong with it.

One pure function, :func:`plan_policy_statuses`, computes the status of every
DrainPolicy of a namespace from what the indexes show — the workers with their labels,
``drainPolicyRef`` and phase, and the policies — with the same
:func:`~sessionfleet.policy.drain.resolve_policy` each worker's drain uses, so a
policy lists exactly the workers that drain under it:

- the workers it governs, counted and named (sorted; the names bounded by
  :data:`~sessionfleet.api.drainpolicy.MAX_LISTED_WORKERS`), and how many of them are
  draining now;
- ``Valid``: True, or False with the parse problem (and the workers that reference
  it, which drain under the built-in default meanwhile);
- ``Conflict=True`` when its selector and another policy's both select a worker with
  no ``drainPolicyRef``: that worker drains under neither, and the condition names it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from sessionfleet.api import ConditionStatus, ConditionType, DrainPolicySpec, Reason
from sessionfleet.api.drainpolicy import MAX_LISTED_WORKERS
from sessionfleet.policy.drain import resolve_policy
from sessionfleet.policy.worker import ConditionPlan

MAX_NAMED_IN_MESSAGE: Final = 10
"""The most names a condition message spells out; the rest are counted."""


@dataclass(frozen=True, slots=True)
class WorkerView:
    """What a policy's status reads of one (parsed) InferenceWorker."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    reference: str | None = None
    """The worker's ``spec.drainPolicyRef``."""
    draining: bool = False
    """Whether its phase is Draining."""


@dataclass(frozen=True, slots=True)
class PolicyStatusPlan:
    """The status one DrainPolicy should carry (its conditions still to be merged)."""

    matched: tuple[str, ...] = ()
    """Every worker the policy governs, sorted."""
    active_drains: int = 0
    conditions: tuple[ConditionPlan, ...] = ()

    @property
    def listed(self) -> tuple[str, ...]:
        """The names the status lists: the first :data:`MAX_LISTED_WORKERS`."""
        return self.matched[:MAX_LISTED_WORKERS]


def named(names: Sequence[str], limit: int = MAX_NAMED_IN_MESSAGE) -> str:
    """Return ``a, b, c`` — or ``a, b and 3 more`` beyond ``limit`` — for a message."""
    shown = ", ".join(names[:limit])
    rest = len(names) - limit
    return f"{shown} and {rest} more" if rest > 0 else shown


def plan_policy_statuses(
    policies: Mapping[str, DrainPolicySpec],
    workers: Iterable[WorkerView],
    invalid: Mapping[str, str] | None = None,
) -> dict[str, PolicyStatusPlan]:
    """Return the status of every policy of one namespace, by name.

    ``policies`` are the policies whose spec parsed; ``invalid`` maps the others' names
    to their parse problem. ``workers`` are the namespace's workers whose spec parsed
    (one that does not is Failed, and no policy governs it).
    """
    invalid = invalid or {}
    governed: dict[str, list[WorkerView]] = defaultdict(list)
    conflicts: dict[str, list[str]] = defaultdict(list)
    rivals: dict[str, set[str]] = defaultdict(set)
    referencing: dict[str, list[str]] = defaultdict(list)
    for worker in workers:
        choice = resolve_policy(worker.labels, worker.reference, policies, invalid)
        if choice.name is not None:
            governed[choice.name].append(worker)
        elif choice.reason is Reason.POLICY_CONFLICT:
            for name in choice.conflicting:
                conflicts[name].append(worker.name)
                rivals[name].update(n for n in choice.conflicting if n != name)
        elif choice.reason is Reason.POLICY_INVALID and worker.reference is not None:
            referencing[worker.reference].append(worker.name)

    plans: dict[str, PolicyStatusPlan] = {}
    for name in policies:
        mine = governed.get(name, [])
        conditions = [
            ConditionPlan(ConditionType.VALID, ConditionStatus.TRUE, Reason.PARSED, "spec accepted")
        ]
        if conflicts.get(name):
            others = sorted(rivals[name])
            who = (
                f"DrainPolicy {others[0]} also selects"
                if len(others) == 1
                else f"DrainPolicies {named(others)} also select"
            )
            conditions.append(
                ConditionPlan(
                    ConditionType.CONFLICT,
                    ConditionStatus.TRUE,
                    Reason.POLICY_CONFLICT,
                    f"{who} worker(s) {named(sorted(conflicts[name]))}: they drain under the "
                    "built-in default until their spec.drainPolicyRef names one policy or the "
                    "selectors are narrowed",
                )
            )
        plans[name] = PolicyStatusPlan(
            matched=tuple(sorted(w.name for w in mine)),
            active_drains=sum(1 for w in mine if w.draining),
            conditions=tuple(conditions),
        )
    for name, problem in invalid.items():
        if name in policies:
            continue  # a parsed policy of the same name wins (never both in one index)
        message = problem
        if referencing.get(name):
            message += (
                f"; worker(s) {named(sorted(referencing[name]))} reference it and drain "
                "under the built-in default meanwhile"
            )
        plans[name] = PolicyStatusPlan(
            conditions=(
                ConditionPlan(
                    ConditionType.VALID, ConditionStatus.FALSE, Reason.INVALID_SPEC, message
                ),
            )
        )
    return plans
