"""What ``kubectl sessionfleet`` shows, built from the objects: pure functions.

The plugin's I/O layer (:mod:`sessionfleet.kubectl.cli`) reads objects from the API
server and hands them here as the JSON it answered; these functions parse them with
the API models, decide what to say and return rows, text or JSON-ready dicts. The
time is a parameter, so every countdown is tested without a clock.

Nothing is decided twice: the DrainPolicy that governs a worker is resolved with the
operator's own :func:`~sessionfleet.policy.drain.resolve_policy`, from the policies
as the operator reads them (:func:`Snapshot.policy_choice`), and where a session
would go now is :func:`~sessionfleet.policy.placement.place` over loads built the way
the operator builds them.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from sessionfleet.api import (
    API_VERSION,
    AgentSession,
    CheckpointDriver,
    CheckpointPhase,
    CheckpointReason,
    Condition,
    ConditionStatus,
    ConditionType,
    DeadlineAction,
    DrainMode,
    DrainPolicy,
    DrainPolicySpec,
    InferenceWorker,
    MigrationScope,
    Reason,
    SessionPhase,
    WorkerCheckpoint,
    WorkerCheckpointSpec,
    WorkerPhase,
    format_duration,
    parse,
    parse_duration,
)
from sessionfleet.api._common import ObjectMeta
from sessionfleet.policy import holds
from sessionfleet.policy.drain import PolicyChoice, resolve_policy
from sessionfleet.policy.handshake import acks_of
from sessionfleet.policy.holds import holds_worker, takes_new_sessions
from sessionfleet.policy.placement import (
    Placement,
    PlacementRequest,
    WorkerLoad,
    admit_or_place,
    place,
)
from sessionfleet.resources.labels import WORKER_LABEL

Body = Mapping[str, Any]
"""An object as the API server answered it (decoded JSON)."""

NONE: Final = "-"
"""What a table cell shows for a value that is not there."""
NEW: Final = "New"
"""The phase shown for a session the operator has not handled yet (no status phase)."""
SESSION_PHASES: Final = (NEW, *(phase.value for phase in SessionPhase))
"""Session phases in the order they are counted and shown."""
UNPARSED: Final = "the spec could not be parsed"
"""An invalid DrainPolicy's problem when none is known (as the operator says it)."""

# --- time -----------------------------------------------------------------------------


def parse_time(value: object) -> datetime | None:
    """Return an RFC 3339 time from the API server as an aware ``datetime``, else ``None``."""
    if not isinstance(value, str) or not value:
        return None
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def age(delta: timedelta) -> str:
    """Return an age the way kubectl writes one (``45s``, ``3m20s``, ``2h5m``, ``4d``).

    The rules of k8s.io/apimachinery's ``duration.HumanDuration``: the longer ago, the
    coarser; a time up to a second in the future (clock skew) is ``0s``.
    """
    seconds = math.floor(delta.total_seconds())
    if seconds < -1:
        return "<invalid>"
    if seconds < 0:
        return "0s"
    if seconds < 120:
        return f"{seconds}s"
    minutes = seconds // 60
    if minutes < 10:
        rest = seconds % 60
        return f"{minutes}m{rest}s" if rest else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = minutes // 60
    if hours < 8:
        rest = minutes % 60
        return f"{hours}h{rest}m" if rest else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        rest = hours % 24
        return f"{hours // 24}d{rest}h" if rest else f"{hours // 24}d"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        days = (hours // 24) % 365
        return f"{hours // 24 // 365}y{days}d" if days else f"{hours // 24 // 365}y"
    return f"{hours // 24 // 365}y"


def age_of(moment: datetime | None, now: datetime) -> str:
    """Return how long ago ``moment`` was (:func:`age`), or ``<unknown>``."""
    return age(now - moment) if moment is not None else "<unknown>"


def countdown(at: datetime, now: datetime) -> str:
    """Return the time until ``at``, to the second: ``in 9m41s``, ``now``, or ``12s ago``.

    A countdown rounds up (0.2 s left is ``in 1s``): it never says a moment has come
    before it has.
    """
    seconds = (at - now).total_seconds()
    if seconds > 0:
        return f"in {format_duration(timedelta(seconds=math.ceil(seconds)))}"
    if seconds == 0:
        return "now"
    return f"{format_duration(timedelta(seconds=math.floor(-seconds)))} ago"


def wire_time(moment: datetime) -> str:
    """Return ``moment`` as the API server writes times: ``2026-11-29T14:00:00Z``."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def tokens(count: int | None) -> str:
    """Return a token count for a table: ``812``, ``12.3K``, ``1.2M``."""
    if count is None:
        return NONE
    if count < 1000:
        return str(count)
    if count < 1_000_000:
        return f"{count / 1000:.1f}K"
    return f"{count / 1_000_000:.1f}M"


def percent(value: float | None, digits: int = 1) -> str:
    """Return a percentage for a table, or :data:`NONE`."""
    return NONE if value is None else f"{value:.{digits}f}%"


# --- tables ---------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Return rows as kubectl prints them: upper-case headers, columns three spaces apart."""
    lines = [[str(h).upper() for h in headers], *([str(c) for c in row] for row in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(headers))]
    return "\n".join(
        "   ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def nothing_found(what: str, namespace: str | None) -> str:
    """Return kubectl's line for an empty list."""
    where = f" in {namespace} namespace" if namespace else ""
    return f"No {what} found{where}."


# --- the objects ----------------------------------------------------------------------


def created_at(meta: ObjectMeta) -> datetime | None:
    """Return an object's ``metadata.creationTimestamp``."""
    return parse_time((meta.model_extra or {}).get("creationTimestamp"))


def condition(conditions: Iterable[Condition], kind: ConditionType) -> Condition | None:
    """Return the condition of one type, if the status carries it."""
    return next((c for c in conditions if c.type is kind), None)


def _identity(body: Body) -> tuple[str, str]:
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
            unreadable.append(Unreadable("InferenceWorker", *_identity(body), outcome.message))
    parsed_sessions: list[AgentSession] = []
    for body in sessions:
        read = parse(AgentSession, body)
        if read.obj is not None:
            parsed_sessions.append(read.obj)
        else:
            unreadable.append(Unreadable("AgentSession", *_identity(body), read.message))
    specs: dict[str, dict[str, DrainPolicySpec]] = {}
    invalid: dict[str, dict[str, str]] = {}
    for body in policies:
        namespace, name = _identity(body)
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


# --- sessions -------------------------------------------------------------------------


def session_phase(session: AgentSession) -> str:
    """Return the session's phase, :data:`NEW` while the operator has not handled it."""
    return session.status.phase.value if session.status.phase is not None else NEW


def pinned(session: AgentSession) -> bool:
    """Whether the session holds its worker: bound and not over (as the operator counts)."""
    return holds_worker(session.status.worker, session.status.phase)


def context_tokens(session: AgentSession) -> int:
    """Return the operator's estimate of the session's prefix: its mean prompt per turn.

    The same figure placement weighs against a worker's KV capacity
    (``SessionState.context_tokens``); 0 before the first turn is counted.
    """
    return holds.context_tokens(session.status.prompt_tokens, session.status.turns)


def phase_totals(sessions: Iterable[AgentSession]) -> dict[str, int]:
    """Return the number of sessions in each phase, in :data:`SESSION_PHASES` order."""
    counts = Counter(session_phase(s) for s in sessions)
    return {phase: counts[phase] for phase in SESSION_PHASES if counts[phase]}


def describe_totals(totals: Mapping[str, int]) -> str:
    """Return ``5 (Bound 4, Pending 1)``, or ``0``."""
    total = sum(totals.values())
    if not total:
        return "0"
    return f"{total} (" + ", ".join(f"{phase} {n}" for phase, n in totals.items()) + ")"


SESSION_HEADERS: Final = ("id", "phase", "worker", "turns", "context", "hit%", "age")


def session_record(session: AgentSession, now: datetime) -> dict[str, Any]:
    """Return one session as ``--output json`` shows it."""
    status = session.status
    created = created_at(session.metadata)
    return {
        "namespace": session.metadata.namespace,
        "name": session.metadata.name,
        "id": session.spec.session_id,
        "model": session.spec.model,
        "phase": session_phase(session),
        "worker": status.worker,
        "turns": status.turns or 0,
        "contextTokens": context_tokens(session),
        "hitRatePercent": status.hit_rate_percent,
        "createdAt": wire_time(created) if created is not None else None,
        "ageSeconds": int((now - created).total_seconds()) if created is not None else None,
    }


def session_rows(
    sessions: Iterable[AgentSession], now: datetime, *, with_namespace: bool = False
) -> tuple[tuple[str, ...], list[list[str]]]:
    """Return the headers and rows of ``kubectl sessionfleet sessions``, sorted by id."""
    headers = (("namespace",) if with_namespace else ()) + SESSION_HEADERS
    rows = []
    for session in sorted(
        sessions, key=lambda s: (s.metadata.namespace, s.spec.session_id, s.metadata.name)
    ):
        status = session.status
        row = [
            session.spec.session_id,
            session_phase(session),
            status.worker or NONE,
            str(status.turns or 0),
            tokens(context_tokens(session)),
            percent(status.hit_rate_percent),
            age_of(created_at(session.metadata), now),
        ]
        rows.append(([session.metadata.namespace] if with_namespace else []) + row)
    return headers, rows


def sessions_text(sessions: Sequence[AgentSession], now: datetime, namespace: str | None) -> str:
    """Return the whole output of ``kubectl sessionfleet sessions``."""
    if not sessions:
        return nothing_found("sessions", namespace)
    return table(*session_rows(sessions, now, with_namespace=namespace is None))


def matching_sessions(bodies: Iterable[Body], key: str) -> list[Body]:
    """Return the sessions whose object name or ``spec.sessionId`` is ``key``.

    The name wins: a session named ``key`` is the only answer even if another session's
    id is ``key`` too.
    """
    listed = list(bodies)
    by_name = [b for b in listed if _identity(b)[1] == key]
    if by_name:
        return by_name
    return [b for b in listed if (b.get("spec") or {}).get("sessionId") == key]


# --- workers and drains ---------------------------------------------------------------


def policy_label(choice: PolicyChoice) -> str:
    """Return the governing policy in a few words: its name, or ``default`` and why."""
    if choice.name is not None:
        return choice.name
    return "default" if choice.reason is None else f"default ({choice.reason.value})"


def policy_origin(choice: PolicyChoice, worker: InferenceWorker) -> str:
    """Return the policy and how it was chosen, for a sentence."""
    if choice.name is not None:
        how = (
            "named by spec.drainPolicyRef"
            if worker.spec.drain_policy_ref == choice.name
            else "its selector matches the worker's labels"
        )
        return f"DrainPolicy {choice.name} ({how})"
    if choice.reason is None:
        return "the built-in default (no DrainPolicy selects the worker)"
    return f"the built-in default ({choice.reason.value}: {choice.message})"


@dataclass(frozen=True)
class DrainView:
    """Where a worker's drain stands, and when its next steps come."""

    state: str
    """:data:`NONE`; ``Requested`` (spec.drain, not acted on yet); the Draining
    condition's reason (``SessionsPinned``, ``GracePeriodExpired``, ``Migrating``,
    ``DeadlineReached``); or ``Drained``."""
    started_at: datetime | None = None
    migrate_at: datetime | None = None
    """When the sessions still pinned start to move (Migrate: the start; Wait: never)."""
    deadline_at: datetime | None = None
    on_deadline: DeadlineAction = DeadlineAction.RELEASE
    message: str = ""

    @property
    def active(self) -> bool:
        """Whether a drain is in progress (not over, not merely requested)."""
        return self.started_at is not None and self.state not in (NONE, "Drained", "Requested")


def drain_view(worker: InferenceWorker, choice: PolicyChoice) -> DrainView:
    """Return the state of ``worker``'s drain under the policy that governs it."""
    status = worker.status
    draining = condition(status.conditions, ConditionType.DRAINING)
    message = draining.message if draining is not None else ""
    if status.phase is WorkerPhase.DRAINED:
        return DrainView("Drained", status.drain_started_at, message=message)
    in_progress = status.phase is WorkerPhase.DRAINING or (
        draining is not None and draining.status is ConditionStatus.TRUE
    )
    if in_progress:
        started = status.drain_started_at
        state = (
            draining.reason
            if draining is not None and draining.status is ConditionStatus.TRUE
            else WorkerPhase.DRAINING.value
        )
        migrate_at, deadline_at = _drain_times(choice.spec, started)
        return DrainView(
            state, started, migrate_at, deadline_at, choice.spec.on_deadline, message=message
        )
    if worker.spec.drain:
        return DrainView("Requested", message="spec.drain is true; the operator has not acted yet")
    return DrainView(NONE)


def _drain_times(
    policy: DrainPolicySpec, started: datetime | None
) -> tuple[datetime | None, datetime | None]:
    """Return when a drain started at ``started`` migrates and reaches its deadline."""
    if started is None:
        return None, None
    deadline = started + parse_duration(policy.deadline)
    if policy.mode is DrainMode.MIGRATE:
        return started, deadline
    if policy.mode is DrainMode.WAIT_THEN_MIGRATE:
        return started + parse_duration(policy.grace_period), deadline
    return None, deadline


def drain_cell(view: DrainView, now: datetime) -> str:
    """Return the DRAIN column: the state, and when migration starts if it is to come."""
    if view.active and view.migrate_at is not None and view.migrate_at > now:
        return f"{view.state} (migrates {countdown(view.migrate_at, now)})"
    return view.state


def deadline_cell(view: DrainView, now: datetime) -> str:
    """Return the DEADLINE column: a countdown, or how long ago it passed and what then."""
    if not view.active or view.deadline_at is None:
        return NONE
    if view.deadline_at > now:
        return countdown(view.deadline_at, now)
    return f"{countdown(view.deadline_at, now)} ({view.on_deadline.value})"


@dataclass(frozen=True)
class WorkerEntry:
    """One worker as ``status`` shows it."""

    worker: InferenceWorker
    sessions: int
    """Pinned sessions, counted from the sessions read (the status' figure lags by up to 5 s)."""
    choice: PolicyChoice
    drain: DrainView

    @property
    def phase(self) -> str:
        """The worker's phase, or :data:`NONE` before the operator wrote one."""
        phase = self.worker.status.phase
        return phase.value if phase is not None else NONE


def worker_entries(snap: Snapshot) -> list[WorkerEntry]:
    """Return every worker with its pinned sessions, its policy and its drain."""
    entries = []
    for worker in snap.workers:
        choice = snap.policy_choice(worker)
        entries.append(
            WorkerEntry(worker, len(snap.sessions_of(worker)), choice, drain_view(worker, choice))
        )
    return entries


WORKER_HEADERS: Final = (
    "worker",
    "model",
    "phase",
    "epoch",
    "sessions",
    "hit%",
    "kv%",
    "node",
    "policy",
    "drain",
    "deadline",
)


def worker_rows(
    entries: Iterable[WorkerEntry], now: datetime, *, with_namespace: bool = False
) -> tuple[tuple[str, ...], list[list[str]]]:
    """Return the headers and rows of the worker table of ``status``."""
    headers = (("namespace",) if with_namespace else ()) + WORKER_HEADERS
    rows = []
    for entry in entries:
        worker, status = entry.worker, entry.worker.status
        row = [
            worker.metadata.name,
            worker.spec.model,
            entry.phase,
            str(status.epoch) if status.epoch is not None else NONE,
            str(entry.sessions),
            percent(status.prefix_hit_rate_percent),
            percent(status.kv_cache_usage_percent, 0),
            status.node or NONE,
            policy_label(entry.choice),
            drain_cell(entry.drain, now),
            deadline_cell(entry.drain, now),
        ]
        rows.append(([worker.metadata.namespace] if with_namespace else []) + row)
    return headers, rows


def _count(items: Iterable[str]) -> str:
    counts = Counter(items)
    total = sum(counts.values())
    if not total:
        return "0"
    return f"{total} (" + ", ".join(f"{k} {n}" for k, n in sorted(counts.items())) + ")"


def status_text(snap: Snapshot, now: datetime, namespace: str | None) -> str:
    """Return the whole output of ``kubectl sessionfleet status``: summary, workers, hints."""
    entries = worker_entries(snap)
    drains = [e for e in entries if e.drain.active]
    lines = [
        f"Namespace:  {namespace if namespace is not None else '(all namespaces)'}",
        f"Workers:    {_count(e.phase for e in entries)}",
        f"Sessions:   {describe_totals(phase_totals(snap.sessions))}",
        f"Drains:     {len(drains)} in progress" if drains else "Drains:     none",
        "",
    ]
    if entries:
        lines.append(table(*worker_rows(entries, now, with_namespace=namespace is None)))
    else:
        lines.append(nothing_found("InferenceWorkers", namespace))
    notes = [f"{e.worker.metadata.name}: {e.drain.message}" for e in drains if e.drain.message] + [
        f"{e.worker.metadata.name}: {e.choice.message}"
        for e in entries
        if e.choice.reason is not None
    ]
    waiting = [s for s in snap.sessions if s.status.phase in (None, SessionPhase.PENDING)]
    if waiting:
        count = len(waiting)
        notes.append(
            f"{count} session{'s are' if count > 1 else ' is'} not bound: "
            "kubectl sessionfleet explain session <id> says why"
        )
    notes += [u.describe() for u in snap.unreadable]
    if notes:
        lines += ["", *notes]
    return "\n".join(lines)


def status_json(snap: Snapshot, now: datetime, namespace: str | None) -> dict[str, Any]:
    """Return ``status`` as ``--output json`` shows it."""
    workers = []
    for entry in worker_entries(snap):
        worker, status, drain = entry.worker, entry.worker.status, entry.drain
        workers.append(
            {
                "namespace": worker.metadata.namespace,
                "name": worker.metadata.name,
                "model": worker.spec.model,
                "phase": status.phase.value if status.phase is not None else None,
                "epoch": status.epoch,
                "pinnedSessions": entry.sessions,
                "prefixHitRatePercent": status.prefix_hit_rate_percent,
                "kvCacheUsagePercent": status.kv_cache_usage_percent,
                "node": status.node,
                "policy": entry.choice.name,
                "policyProblem": entry.choice.message or None,
                "drain": {
                    "state": None if drain.state == NONE else drain.state,
                    "startedAt": _maybe_time(drain.started_at),
                    "migrateAt": _maybe_time(drain.migrate_at) if drain.active else None,
                    "deadlineAt": _maybe_time(drain.deadline_at) if drain.active else None,
                    "deadlineInSeconds": (
                        math.ceil((drain.deadline_at - now).total_seconds())
                        if drain.active and drain.deadline_at is not None
                        else None
                    ),
                    "onDeadline": drain.on_deadline.value if drain.active else None,
                    "message": drain.message or None,
                },
            }
        )
    totals = phase_totals(snap.sessions)
    return {
        "namespace": namespace,
        "time": wire_time(now),
        "workers": workers,
        "sessions": {"total": sum(totals.values()), "byPhase": totals},
        "unreadable": [u.describe() for u in snap.unreadable],
    }


def _maybe_time(moment: datetime | None) -> str | None:
    return wire_time(moment) if moment is not None else None


# --- where a session would go ---------------------------------------------------------


def loads(snap: Snapshot, namespace: str) -> list[WorkerLoad]:
    """Return placement's view of a namespace's workers, as the operator builds it.

    Pinned sessions and their prefixes are counted from the sessions read, and KV usage
    is the engine's figure from the worker's status; a worker is a candidate only when
    it is Ready and not asked to drain.
    """
    out = []
    for worker in snap.workers:
        if worker.metadata.namespace != namespace:
            continue
        held = snap.sessions_of(worker)
        usage = worker.status.kv_cache_usage_percent
        out.append(
            WorkerLoad(
                name=worker.metadata.name,
                model=worker.spec.model,
                ready=takes_new_sessions(worker.status.phase, worker.spec.drain),
                pinned_sessions=len(held),
                max_sessions=worker.spec.capacity.max_sessions,
                kv_tokens_capacity=worker.spec.capacity.kv_tokens,
                kv_tokens_pinned=sum(context_tokens(s) for s in held),
                kv_usage=usage / 100 if usage is not None else 0.0,
            )
        )
    return out


def placement_now(snap: Snapshot, session: AgentSession) -> Placement:
    """Return where the operator would bind ``session`` now: its pin, hint and parent honoured."""
    parent = None
    if session.spec.parent_session_id is not None:
        parent = next(
            (
                s.status.worker
                for s in snap.sessions
                if s.metadata.namespace == session.metadata.namespace
                and s.spec.session_id == session.spec.parent_session_id
                and pinned(s)
            ),
            None,
        )
    request = PlacementRequest(
        model=session.spec.model,
        pin=session.spec.worker_pin,
        parent_worker=parent,
        expected_tokens=context_tokens(session),
    )
    workers = loads(snap, session.metadata.namespace)
    return admit_or_place(request, workers, hint=session.spec.worker_hint)


def serving(snap: Snapshot, namespace: str, model: str) -> list[InferenceWorker]:
    """Return a namespace's workers serving ``model``."""
    return [w for w in snap.workers if w.metadata.namespace == namespace and w.spec.model == model]


def _worker_brief(worker: InferenceWorker, held: int) -> str:
    phase = worker.status.phase.value if worker.status.phase is not None else "no phase yet"
    drain = ", drain requested" if worker.spec.drain and phase != "Drained" else ""
    return f"{worker.metadata.name} ({phase}{drain}, {held}/{worker.spec.capacity.max_sessions})"


# --- events ---------------------------------------------------------------------------


@dataclass(frozen=True)
class EventView:
    """One Event about an object, from events.k8s.io/v1 or core/v1 alike."""

    type: str
    reason: str
    message: str
    source: str
    count: int
    last_seen: datetime | None


def _event_view(body: Body) -> tuple[Body, EventView]:
    """Return the object an event is about and the event, from either API's shape."""
    if "regarding" in body or "note" in body:  # events.k8s.io/v1
        series = body.get("series") or {}
        count = series.get("count") or body.get("deprecatedCount") or 1
        last = (
            parse_time(series.get("lastObservedTime"))
            or parse_time(body.get("eventTime"))
            or parse_time(body.get("deprecatedLastTimestamp"))
        )
        return body.get("regarding") or {}, EventView(
            type=str(body.get("type") or ""),
            reason=str(body.get("reason") or ""),
            message=str(body.get("note") or ""),
            source=str(body.get("reportingController") or ""),
            count=int(count),
            last_seen=last,
        )
    source = body.get("source") or {}
    last = (
        parse_time(body.get("lastTimestamp"))
        or parse_time(body.get("eventTime"))
        or parse_time(body.get("firstTimestamp"))
    )
    return body.get("involvedObject") or {}, EventView(
        type=str(body.get("type") or ""),
        reason=str(body.get("reason") or ""),
        message=str(body.get("message") or ""),
        source=str(body.get("reportingComponent") or source.get("component") or ""),
        count=int(body.get("count") or 1),
        last_seen=last,
    )


def events_about(kind: str, name: str, uid: str, *listings: Iterable[Body]) -> list[EventView]:
    """Return the events about one object, oldest first, from any number of listings.

    Both event APIs serve the same objects, so an event listed twice (same UID) counts
    once. An event that names an object's UID must name this one's: an object deleted
    and created again under its name has other events.
    """
    seen: set[str] = set()
    out = []
    for listing in listings:
        for body in listing:
            event_uid = str((body.get("metadata") or {}).get("uid") or "")
            if event_uid and event_uid in seen:
                continue
            regarding, view = _event_view(body)
            if regarding.get("kind") != kind or regarding.get("name") != name:
                continue
            if uid and regarding.get("uid") and regarding.get("uid") != uid:
                continue
            if event_uid:
                seen.add(event_uid)
            out.append(view)
    _epoch = datetime.min.replace(tzinfo=UTC)
    return sorted(out, key=lambda e: e.last_seen or _epoch)


def events_table(events: Sequence[EventView], now: datetime) -> str:
    """Return events as ``kubectl describe`` lists them, or ``no events``."""
    if not events:
        return "no events"
    rows = [
        [
            e.type or NONE,
            e.reason or NONE,
            age_of(e.last_seen, now) + (f" (x{e.count})" if e.count > 1 else ""),
            e.source or NONE,
            e.message,
        ]
        for e in events
    ]
    return table(("type", "reason", "age", "from", "message"), rows)


def conditions_table(conditions: Sequence[Condition], now: datetime) -> str:
    """Return conditions as rows, or ``no conditions``."""
    if not conditions:
        return "no conditions"
    rows = [
        [c.type.value, c.status.value, c.reason, age_of(c.last_transition_time, now), c.message]
        for c in conditions
    ]
    return table(("type", "status", "reason", "age", "message"), rows)


# --- explain session ------------------------------------------------------------------


def _reason_text(reason: str) -> str:
    """Return the documentation sentence of a reason the API defines, else ``""``."""
    try:
        return Reason(reason).description
    except ValueError:
        return ""


def _indent(text: str, by: str = "  ") -> list[str]:
    return [by + line if line else line for line in text.splitlines()]


def explain_session(
    session: AgentSession,
    events: Sequence[EventView],
    snap: Snapshot,
    now: datetime,
    *,
    events_problem: str | None = None,
) -> str:
    """Return why a session is where it is: its state, the reasons, its conditions and events.

    ``snap`` holds the namespace's workers and sessions, for what the conditions cannot
    say: which workers serve the model, whether one has room now, where a migrating
    session is likely to go. ``events_problem``: why no events could be listed.
    """
    meta, spec, status = session.metadata, session.spec, session.status
    phase = session_phase(session)
    lines = [
        f"Session:     {spec.session_id}",
        f"Object:      AgentSession {meta.namespace}/{meta.name}",
        f"Model:       {spec.model}",
        f"Phase:       {phase}",
        f"Created:     {age_of(created_at(meta), now)} ago",
    ]
    if spec.worker_pin:
        lines.append(f"Pinned to:   {spec.worker_pin} (spec.workerPin)")
    elif spec.worker_hint:
        lines.append(f"Hint:        {spec.worker_hint} (spec.workerHint)")
    if spec.parent_session_id:
        lines.append(f"Parent:      {spec.parent_session_id}")
    if status.worker:
        epoch = f", epoch {status.epoch}" if status.epoch is not None else ""
        pod = f"pod {status.pod}" if status.pod else "no pod recorded"
        lines.append(f"Worker:      {status.worker} ({pod}{epoch})")
    if status.turns:
        lines.append(
            f"Turns:       {status.turns}, context ~{tokens(context_tokens(session))} tokens, "
            f"hit rate {percent(status.hit_rate_percent)}"
        )
    lines += ["", *_why(session, snap, now)]
    if status.migrations:
        lines += ["", "Migrations:"]
        for move in status.migrations:
            via = (
                f" through checkpoint {move.checkpoint}"
                if move.checkpoint
                else ", without a checkpoint"
            )
            recomputed = (
                f", {move.recomputed_tokens} tokens recomputed"
                if move.recomputed_tokens is not None
                else ""
            )
            lines.append(
                f"  {move.from_worker} -> {move.to_worker} ({move.reason.value}) "
                f"{age_of(move.at, now)} ago{via}{recomputed}"
            )
    lines += ["", "Conditions:", *_indent(conditions_table(status.conditions, now))]
    listed = events_table(events, now) if events_problem is None else events_problem
    lines += ["", "Events:", *_indent(listed)]
    return "\n".join(lines)


_LABEL = re.compile(r"^(\w[\w ]*:) +")


def _sentences(lines: Iterable[str]) -> list[str]:
    """Return lines of the text layout without its column padding: ``Why: not bound: ...``."""
    return [_LABEL.sub(r"\1 ", line.strip()) for line in lines if line.strip()]


def _placement_record(placement: Placement) -> dict[str, Any]:
    return {
        "worker": placement.worker,
        "reason": placement.reason.value,
        "message": placement.message,
    }


def _event_record(event: EventView) -> dict[str, Any]:
    return {
        "type": event.type or None,
        "reason": event.reason or None,
        "message": event.message,
        "from": event.source or None,
        "count": event.count,
        "lastSeen": _maybe_time(event.last_seen),
    }


def explain_session_record(
    session: AgentSession,
    events: Sequence[EventView],
    snap: Snapshot,
    now: datetime,
    *,
    events_problem: str | None = None,
) -> dict[str, Any]:
    """Return ``explain session`` as ``--output json|yaml`` shows it: the same answer as data.

    The session's row (as ``sessions -o json``) with its wishes, the Ready condition's
    reason and what it means, the explanation's sentences, where placement would put it
    now (Pending: placed as a new session; Migrating: its likely target), the routers
    that acknowledged a migration, its migrations, conditions and events.
    """
    spec, status = session.spec, session.status
    reason, message = _ready_reason(session)
    phase = status.phase
    placement: Placement | None = None
    if phase is SessionPhase.PENDING:
        placement = placement_now(snap, session)
    elif phase is SessionPhase.MIGRATING:
        placement = migration_target(snap, session)
    return {
        **session_record(session, now),
        "workerPin": spec.worker_pin,
        "workerHint": spec.worker_hint,
        "parentSessionId": spec.parent_session_id,
        "pod": status.pod,
        "epoch": status.epoch,
        "ready": {
            "reason": reason or None,
            "message": message or None,
            "meaning": _reason_text(reason) or None,
        },
        "explanation": _sentences(_why(session, snap, now)),
        "placementNow": _placement_record(placement) if placement is not None else None,
        "acknowledgedBy": (
            sorted(acks_of(session.metadata.annotations))
            if phase is SessionPhase.MIGRATING
            else None
        ),
        "migrations": [move.wire() for move in status.migrations],
        "conditions": [c.wire() for c in status.conditions],
        "events": [_event_record(e) for e in events] if events_problem is None else None,
        "eventsProblem": events_problem,
    }


def _ready_reason(session: AgentSession) -> tuple[str, str]:
    ready = condition(session.status.conditions, ConditionType.READY)
    return (ready.reason, ready.message) if ready is not None else ("", "")


def _why(session: AgentSession, snap: Snapshot, now: datetime) -> list[str]:
    """Return the paragraph that answers "why is it so" for the session's phase."""
    status, namespace = session.status, session.metadata.namespace
    reason, message = _ready_reason(session)
    explained = _reason_text(reason)
    because = f"{reason}: {message}" if reason else ""
    phase = status.phase
    if phase is None:
        return [
            "Why:         the operator has not handled this session yet (no status). It binds a",
            "             new session as soon as it sees it: is an operator running for "
            f"namespace {namespace}?",
        ]
    if phase is SessionPhase.PENDING:
        lines = [f"Why:         not bound: {because or 'no Ready condition yet'}"]
        if explained:
            lines.append(f"             ({explained})")
        lines += _candidates(session, snap)
        now_placed = placement_now(snap, session)
        if now_placed.worker is not None:
            lines.append(
                f"Now:         placement would choose {now_placed.worker} "
                f"({now_placed.message}); the operator binds it on its next pass"
            )
        else:
            lines.append(f"Now:         still no place: {now_placed.message}")
        return lines
    worker = snap.worker(namespace, status.worker) if status.worker else None
    if phase is SessionPhase.MIGRATING:
        return _migrating(session, worker, snap, now)
    if phase is SessionPhase.RESTORING:
        lines = [
            f"Why:         its worker {status.worker} is being recreated; turns are held until "
            "it is Ready again",
        ]
        if worker is not None:
            recovering = condition(worker.status.conditions, ConditionType.RECOVERING)
            if recovering is not None and recovering.message:
                lines.append(f"Worker:      {recovering.reason}: {recovering.message}")
        return lines
    if phase is SessionPhase.BOUND:
        since = f" since {age_of(status.bound_at, now)} ago" if status.bound_at else ""
        lines = [f"Bound:       to {status.worker}{since}: its turns go there"]
        if worker is not None and worker.status.phase is WorkerPhase.DRAINING:
            draining = condition(worker.status.conditions, ConditionType.DRAINING)
            detail = f": {draining.message}" if draining is not None else ""
            lines.append(f"Worker:      {status.worker} is Draining{detail}")
        elif worker is None and status.worker:
            lines.append(f"Worker:      {status.worker} was not found")
        return lines
    if phase is SessionPhase.FINISHED:
        lines = [f"Why:         finished: {because or 'the session ended'}"]
        if status.finished_at is not None:
            expires = status.finished_at + timedelta(
                seconds=session.spec.ttl_seconds_after_finished
            )
            lines.append(
                f"             deleted {countdown(expires, now)} (ttlSecondsAfterFinished "
                f"{session.spec.ttl_seconds_after_finished})"
            )
        return lines
    return [f"Why:         lost: {because or 'its worker is gone'}"] + (
        [f"             ({explained})"] if explained else []
    )


def _candidates(session: AgentSession, snap: Snapshot) -> list[str]:
    """Return the workers that could take the session, or what the namespace serves."""
    namespace, model = session.metadata.namespace, session.spec.model
    candidates = serving(snap, namespace, model)
    if candidates:
        briefs = ", ".join(_worker_brief(w, len(snap.sessions_of(w))) for w in candidates)
        return [f"Workers:     serving {model}: {briefs}"]
    served = sorted({w.spec.model for w in snap.workers if w.metadata.namespace == namespace})
    elsewhere = f"; the workers here serve {', '.join(served)}" if served else ""
    return [f"Workers:     no worker in {namespace} serves {model}{elsewhere}"]


def migration_target(snap: Snapshot, session: AgentSession) -> Placement:
    """Return where a migrating session would go now, as the operator places it.

    No pin or hint, and the worker it leaves excluded.
    """
    return place(
        PlacementRequest(
            model=session.spec.model,
            expected_tokens=context_tokens(session),
            exclude=frozenset({session.status.worker or ""}),
        ),
        loads(snap, session.metadata.namespace),
    )


def _migrating(
    session: AgentSession, worker: InferenceWorker | None, snap: Snapshot, now: datetime
) -> list[str]:
    status = session.status
    source = status.worker or "?"
    since = status.migrating_since
    lines = [
        f"Migrating:   leaving {source}"
        + (f", asked {age_of(since, now)} ago" if since is not None else "")
        + "; routers hold its next turn until each has acknowledged that none is in flight",
    ]
    if worker is not None:
        draining = condition(worker.status.conditions, ConditionType.DRAINING)
        if draining is not None and draining.message:
            lines.append(f"Because:     {source} drains: {draining.message}")
    acks = sorted(acks_of(session.metadata.annotations))
    lines.append(f"Acknowledged: {', '.join(acks) if acks else 'by no router yet'}")
    target = migration_target(snap, session)
    if target.worker is not None:
        lines.append(
            f"Target:      {target.worker} if it moved now ({target.message}); chosen when it moves"
        )
    else:
        lines.append(f"Target:      none now: {target.message}; it stays until the deadline")
    return lines


# --- drain and undrain ----------------------------------------------------------------


def _mode_text(policy: DrainPolicySpec) -> str:
    return f"{policy.mode.value}: {policy.mode.description}"


def _move_text(policy: DrainPolicySpec, worker: InferenceWorker) -> str:
    """Return how sessions move under the policy: alone or with the worker, cached or not."""
    if policy.migration_scope is MigrationScope.WORKER:
        return (
            "the whole worker is checkpointed and restarted on a node that is not draining; "
            "its sessions follow it"
        )
    driver = worker.spec.checkpoint.driver
    if policy.checkpoint and driver is not CheckpointDriver.NONE:
        return (
            f"each moves at its next turn boundary through a checkpoint (driver {driver.value}): "
            "its next turn is served from cache"
        )
    why = "policy checkpoint: false" if not policy.checkpoint else "the worker's driver is none"
    return f"each moves at its next turn boundary without its cache ({why}): recomputed"


def _deadline_text(policy: DrainPolicySpec) -> str:
    if policy.on_deadline is DeadlineAction.RELEASE:
        return (
            "the holds are removed and the drain proceeds; sessions still pinned lose their cache"
        )
    return "the holds stay: the platform's own deadline decides"


def drain_timeline(
    policy: DrainPolicySpec,
    worker: InferenceWorker,
    pinned_count: int,
    start: datetime,
    now: datetime,
) -> list[tuple[str, str]]:
    """Return what the drain does and when, as (when, what) rows, from ``start``."""
    name = worker.metadata.name
    end = (
        f"{name} is Drained: its pod is deleted, and it stays Drained until "
        f"kubectl sessionfleet undrain {name}"
    )
    if pinned_count == 0:
        return [("now", f"no session is pinned: {end}")]

    def when(offset: str) -> str:
        moment = start + parse_duration(offset)
        return f"{countdown(moment, now)} ({wire_time(moment)})"

    held = (
        "the pinned session keeps its"
        if pinned_count == 1
        else f"the {pinned_count} pinned sessions keep their"
    )
    if policy.migration_scope is MigrationScope.WORKER:
        move = f"{name} moves whole to a node that is not draining; its sessions follow it"
    else:
        them = "the pinned session moves" if pinned_count == 1 else "the pinned sessions move"
        move = f"{them} to other workers, each at its next turn boundary"
    rows = [("now", f"hold: no new session goes to {name}; {held} turns here")]
    if policy.mode is DrainMode.MIGRATE:
        rows[0] = ("now", move)
    elif policy.mode is DrainMode.WAIT_THEN_MIGRATE:
        rows.append((f"grace {policy.grace_period}, {when(policy.grace_period)}", move))
    rows.append((f"deadline {policy.deadline}, {when(policy.deadline)}", _deadline_text(policy)))
    rows.append(("once none is pinned", end))
    return rows


def drain_targets(
    snap: Snapshot, worker: InferenceWorker, sessions: Sequence[AgentSession]
) -> dict[str, str]:
    """Return where each session would move if it moved now, by session name.

    The operator places them one after another, each counted against its target for
    the next (``policy.migration.plan_migration``); so does this.
    """
    current = [
        load for load in loads(snap, worker.metadata.namespace) if load.name != worker.metadata.name
    ]
    out = {}
    for session in sessions:
        tokens_ = context_tokens(session)
        placement = place(
            PlacementRequest(model=session.spec.model, expected_tokens=tokens_), current
        )
        if placement.worker is None:
            out[session.metadata.name] = f"none ({placement.reason.value})"
            continue
        out[session.metadata.name] = placement.worker
        current = [
            WorkerLoad(
                name=load.name,
                model=load.model,
                ready=load.ready,
                pinned_sessions=load.pinned_sessions + (load.name == placement.worker),
                max_sessions=load.max_sessions,
                kv_tokens_capacity=load.kv_tokens_capacity,
                kv_tokens_pinned=load.kv_tokens_pinned
                + (tokens_ if load.name == placement.worker else 0),
                kv_usage=load.kv_usage,
            )
            for load in current
        ]
    return out


def _migrates(policy: DrainPolicySpec) -> bool:
    return policy.mode is not DrainMode.WAIT


def drain_preview(
    snap: Snapshot,
    worker: InferenceWorker,
    now: datetime,
    *,
    dry_run: bool,
    was_set: bool,
) -> str:
    """Return what ``drain`` did (or, ``dry_run``, would do) and what the policy does next.

    ``worker`` is as read before the patch; ``was_set``: its ``spec.drain`` was already
    true, so nothing changes.
    """
    choice = snap.policy_choice(worker)
    policy = choice.spec
    name, namespace = worker.metadata.name, worker.metadata.namespace
    if was_set:
        head = f"InferenceWorker {namespace}/{name}: spec.drain is already true"
    elif dry_run:
        head = f"InferenceWorker {namespace}/{name}: spec.drain would be set to true (dry run)"
    else:
        head = f"InferenceWorker {namespace}/{name}: spec.drain set to true"
    lines = [head, ""]
    view = drain_view(worker, choice)
    if view.active and view.started_at is not None:
        lines.append(
            f"Draining:     since {age_of(view.started_at, now)} ago ({view.state}); "
            "times below count from then"
        )
    elif view.state == "Drained":
        lines.append("Drained:      already; nothing is pinned")
    lines += [
        f"Policy:       {policy_origin(choice, worker)}",
        f"Mode:         {_mode_text(policy)}",
        "Grace period: "
        + (
            policy.grace_period
            if policy.mode is DrainMode.WAIT_THEN_MIGRATE
            else f"{policy.grace_period} (not used by mode {policy.mode.value})"
        ),
        f"Deadline:     {policy.deadline}",
        f"At deadline:  {policy.on_deadline.value}: {_deadline_text(policy)}",
        f"Holds:        {', '.join(sorted(h.value for h in policy.holds)) or 'none'}",
    ]
    if _migrates(policy):
        lines.append(f"Migration:    {_move_text(policy, worker)}")
    warnings = []
    if not policy.triggers.worker_drain:
        warnings.append(
            "warning: this policy does not drain on spec.drain (triggers.workerDrain is false): "
            "only a cordon or a disruption taint of the node starts a drain"
        )
    if choice.reason is not None:
        warnings.append(f"warning: {choice.message}")
    held = snap.sessions_of(worker)
    start = view.started_at if view.active and view.started_at is not None else now
    lines += ["", "What happens:"]
    lines += _indent(table(("when", "what"), drain_timeline(policy, worker, len(held), start, now)))
    lines += ["", _pinned_heading(policy, len(held))]
    if held:
        targets = drain_targets(snap, worker, held) if _migrates(policy) else {}
        rows = [
            [
                s.spec.session_id,
                session_phase(s),
                str(s.status.turns or 0),
                tokens(context_tokens(s)),
                *([targets.get(s.metadata.name, NONE)] if targets else []),
            ]
            for s in sorted(held, key=lambda s: s.spec.session_id)
        ]
        headers = ("id", "phase", "turns", "context", *(("target now",) if targets else ()))
        lines += _indent(table(headers, rows))
    if warnings:
        lines += ["", *warnings]
    return "\n".join(lines)


def _pinned_heading(policy: DrainPolicySpec, count: int) -> str:
    if not count:
        return "Pinned sessions: none"
    fate = {
        DrainMode.WAIT: f"waited for until they finish, at most {policy.deadline}",
        DrainMode.MIGRATE: "migrated now",
        DrainMode.WAIT_THEN_MIGRATE: f"waited for {policy.grace_period}, then migrated",
    }[policy.mode]
    return f"Pinned sessions ({count}), {fate}:"


def undrain_summary(
    snap: Snapshot, worker: InferenceWorker, now: datetime, *, dry_run: bool, was_set: bool
) -> str:
    """Return what ``undrain`` did (or would do) and what follows from it."""
    name, namespace = worker.metadata.name, worker.metadata.namespace
    if not was_set:
        head = f"InferenceWorker {namespace}/{name}: spec.drain is already false"
    elif dry_run:
        head = f"InferenceWorker {namespace}/{name}: spec.drain would be set to false (dry run)"
    else:
        head = f"InferenceWorker {namespace}/{name}: spec.drain set to false"
    lines = [head]
    choice = snap.policy_choice(worker)
    view = drain_view(worker, choice)
    held = len(snap.sessions_of(worker))
    by_request = Reason.DRAIN_REQUESTED.value in view.message
    if view.state == "Drained":
        epoch = (worker.status.epoch or 0) + 1
        lines.append(
            f"It is Drained: a new pod ({name}-{epoch}) starts, and new sessions are placed "
            "on it once it is Ready"
        )
    elif view.active and (by_request or not view.message):
        lines.append(
            f"It is draining ({view.state}, since {age_of(view.started_at, now)} ago): the drain "
            f"stops, unless its node is cordoned or tainted for a disruption; the {held} "
            f"session(s) still pinned stay on {name}, and those already moved stay where they are"
        )
    elif view.active:
        lines.append(
            f"It is draining for another reason ({view.message}): spec.drain does not stop that"
        )
    elif view.state == "Requested":
        lines.append("The operator had not started the drain: nothing else changes")
    return "\n".join(lines)


# --- checkpoints ----------------------------------------------------------------------


def manual_checkpoint(worker: str, namespace: str) -> dict[str, Any]:
    """Return a WorkerCheckpoint of ``worker`` with reason Manual, named by the API server.

    No owner reference: a manual checkpoint is the user's to delete, and the operator's
    retention leaves it alone.
    """
    spec = WorkerCheckpointSpec(worker=worker, reason=CheckpointReason.MANUAL)
    return {
        "apiVersion": API_VERSION,
        "kind": WorkerCheckpoint.info.kind,
        "metadata": {
            "generateName": f"{worker}-manual-",
            "namespace": namespace,
            "labels": {WORKER_LABEL: worker},
        },
        "spec": spec.wire(),
    }


def checkpoint_phase(body: Body) -> str:
    """Return a WorkerCheckpoint's phase, ``Pending`` until the operator writes one."""
    phase = (body.get("status") or {}).get("phase")
    return str(phase) if phase else CheckpointPhase.PENDING.value


def checkpoint_done(body: Body) -> bool | None:
    """Whether the checkpoint Succeeded (``True``), Failed (``False``), or is not over."""
    phase = checkpoint_phase(body)
    if phase == CheckpointPhase.SUCCEEDED.value:
        return True
    if phase == CheckpointPhase.FAILED.value:
        return False
    return None


def checkpoint_summary(body: Body) -> str:
    """Return what a finished checkpoint holds, or why it failed, in a few lines."""
    read = parse(WorkerCheckpoint, body)
    if read.obj is None:
        return f"the checkpoint cannot be read: {read.message}"
    status = read.obj.status
    if status.phase is CheckpointPhase.FAILED:
        done = condition(status.conditions, ConditionType.CHECKPOINTED)
        valid = condition(status.conditions, ConditionType.VALID)
        reason = next(
            (
                c.reason
                for c in (valid, done)
                if c is not None and c.status is ConditionStatus.FALSE
            ),
            "",
        )
        prefix = f"{reason}: " if reason else ""
        return f"failed: {prefix}{status.error or 'no error recorded'}"
    if status.phase is not CheckpointPhase.SUCCEEDED:
        return f"{checkpoint_phase(body)}"
    size = _size(status.size_bytes)
    took = f" in {status.duration_seconds:.1f}s" if status.duration_seconds is not None else ""
    epoch = f" of epoch {status.epoch}" if status.epoch is not None else ""
    lines = [
        f"written{took}{epoch}: {size}, {len(status.sessions)} session(s), "
        f"{status.total_tokens or 0} tokens",
        f"location: {status.location or NONE}",
    ]
    return "\n".join(lines)


def _size(count: int | None) -> str:
    """Return a size in bytes for people: ``812 B``, ``3.4 MiB``."""
    if count is None:
        return "size unknown"
    if count < 1024:
        return f"{count} B"
    value, unit = count / 1024, "KiB"
    for bigger in ("MiB", "GiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.1f} {unit}"
