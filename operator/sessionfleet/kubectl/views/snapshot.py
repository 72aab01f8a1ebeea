"""The objects the plugin read at one moment, parsed by the API models.

:func:`snapshot` parses what the API server answered into a :class:`Snapshot`; an object
the models cannot parse is kept as :class:`Unreadable`, never skipped silently. Which
sessions hold a worker is the operator's own rule
(:func:`~sessionfleet.policy.holds.holds_worker`), and the DrainPolicy that governs a
worker is resolved with the operator's own :func:`~sessionfleet.policy.drain.resolve_policy`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

from sessionfleet.api import (
    AgentSession,
    Condition,
    ConditionType,
    DrainPolicy,
    DrainPolicySpec,
    InferenceWorker,
    parse,
)
from sessionfleet.api._common import ObjectMeta
from sessionfleet.kubectl.views.format import parse_time
from sessionfleet.policy.drain import PolicyChoice, resolve_policy
from sessionfleet.policy.holds import holds_worker

Body = Mapping[str, Any]
"""An object as the API server answered it (decoded JSON)."""

UNPARSED: Final = "the spec could not be parsed"
"""An invalid DrainPolicy's problem when none is known (as the operator says it)."""


def created_at(meta: ObjectMeta) -> datetime | None:
    """Return an object's ``metadata.creationTimestamp``."""
    return parse_time((meta.model_extra or {}).get("creationTimestamp"))


def condition(conditions: Iterable[Condition], kind: ConditionType) -> Condition | None:
    """Return the condition of one type, if the status carries it."""
    return next((c for c in conditions if c.type is kind), None)


def identity(body: Body) -> tuple[str, str]:
    """Return an object's (namespace, name) from its body, ``""`` where missing."""
    meta = body.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


@dataclass(frozen=True)
class Unreadable:
    """An object the models cannot parse: shown with its problem, never skipped silently."""

    kind: str
    namespace: str
    name: str
    problem: str

    def describe(self) -> str:
        """Return one line naming the object and the problem."""
        return f"{self.kind} {self.namespace}/{self.name} cannot be read: {self.problem}"


@dataclass(frozen=True)
class Snapshot:
    """The workers, sessions and DrainPolicies read at one moment, parsed by the models."""

    workers: tuple[InferenceWorker, ...] = ()
    sessions: tuple[AgentSession, ...] = ()
    policy_specs: Mapping[str, Mapping[str, DrainPolicySpec]] = field(default_factory=dict)
    """By namespace, then name: the DrainPolicies whose spec parsed."""
    invalid_policies: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """By namespace, then name: why the other DrainPolicies did not parse."""
    unreadable: tuple[Unreadable, ...] = ()

    def policy_choice(self, worker: InferenceWorker) -> PolicyChoice:
        """Return the DrainPolicy that governs ``worker``, resolved as the operator does."""
        namespace = worker.metadata.namespace
        return resolve_policy(
            worker.metadata.labels,
            worker.spec.drain_policy_ref,
            self.policy_specs.get(namespace, {}),
            self.invalid_policies.get(namespace, {}),
        )

    def sessions_of(self, worker: InferenceWorker) -> list[AgentSession]:
        """Return the sessions pinned to ``worker``: bound to it and not over."""
        return [
            s
            for s in self.sessions
            if s.metadata.namespace == worker.metadata.namespace
            and s.status.worker == worker.metadata.name
            and pinned(s)
        ]

    def worker(self, namespace: str, name: str) -> InferenceWorker | None:
        """Return one worker, if it was read."""
        return next(
            (
                w
                for w in self.workers
                if w.metadata.namespace == namespace and w.metadata.name == name
            ),
            None,
        )


def snapshot(
    workers: Iterable[Body] = (), sessions: Iterable[Body] = (), policies: Iterable[Body] = ()
) -> Snapshot:
    """Parse what was read into a :class:`Snapshot`; what does not parse is kept as such."""
    unreadable: list[Unreadable] = []
    parsed_workers: list[InferenceWorker] = []
    for body in workers:
        outcome = parse(InferenceWorker, body)
        if outcome.obj is not None:
            parsed_workers.append(outcome.obj)
        else:
            unreadable.append(Unreadable("InferenceWorker", *identity(body), outcome.message))
    parsed_sessions: list[AgentSession] = []
    for body in sessions:
        read = parse(AgentSession, body)
        if read.obj is not None:
            parsed_sessions.append(read.obj)
        else:
            unreadable.append(Unreadable("AgentSession", *identity(body), read.message))
    specs: dict[str, dict[str, DrainPolicySpec]] = {}
    invalid: dict[str, dict[str, str]] = {}
    for body in policies:
        namespace, name = identity(body)
        policy = parse(DrainPolicy, body)
        if policy.obj is not None:
            specs.setdefault(namespace, {})[name] = policy.obj.spec
        else:
            # As the operator reads them: an invalid policy selects no worker, and a
            # worker that references one is told why (controllers.fleet.policy_specs).
            invalid.setdefault(namespace, {})[name] = policy.message or UNPARSED
    return Snapshot(
        workers=tuple(sorted(parsed_workers, key=_key)),
        sessions=tuple(parsed_sessions),
        policy_specs=specs,
        invalid_policies=invalid,
        unreadable=tuple(unreadable),
    )


def _key(obj: InferenceWorker | AgentSession) -> tuple[str, str]:
    return (obj.metadata.namespace, obj.metadata.name)


def pinned(session: AgentSession) -> bool:
    """Whether the session holds its worker: bound and not over (as the operator counts)."""
    return holds_worker(session.status.worker, session.status.phase)
