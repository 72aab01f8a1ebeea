"""``kubectl sessionfleet status``: the summary, the worker table and the hints."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from sessionfleet.api import (
    InferenceWorker,
    SessionPhase,
)
from sessionfleet.kubectl.views.format import (
    NONE,
    maybe_time,
    nothing_found,
    percent,
    table,
    wire_time,
)
from sessionfleet.kubectl.views.sessions import describe_totals, phase_totals
from sessionfleet.kubectl.views.snapshot import Snapshot
from sessionfleet.kubectl.views.workers import (
    DrainView,
    deadline_cell,
    drain_cell,
    drain_view,
    policy_label,
)
from sessionfleet.policy.drain import PolicyChoice


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
                    "startedAt": maybe_time(drain.started_at),
                    "migrateAt": maybe_time(drain.migrate_at) if drain.active else None,
                    "deadlineAt": maybe_time(drain.deadline_at) if drain.active else None,
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
