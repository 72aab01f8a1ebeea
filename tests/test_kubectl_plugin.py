"""kubectl sessionfleet: the pure builders with tables, and the command line against a fake API.

The plugin against a real API server and a real operator is in e2e/test_kubectl_plugin.py.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from sessionfleet.api import InferenceWorker, SessionPhase, WorkerCheckpoint, parse
from sessionfleet.kube import (
    CHECKPOINTS,
    CORE_EVENTS,
    DRAIN_POLICIES,
    EVENTS,
    SESSIONS,
    WORKERS,
    ApiUnavailable,
    Forbidden,
    KubeConfig,
    NotFound,
    Resource,
)
from sessionfleet.kubectl import cli
from sessionfleet.kubectl.views.checkpoints import (
    checkpoint_done,
    checkpoint_phase,
    checkpoint_summary,
    manual_checkpoint,
)
from sessionfleet.kubectl.views.drain import drain_preview, undrain_summary
from sessionfleet.kubectl.views.events import events_about, events_table
from sessionfleet.kubectl.views.explain import explain_session, explain_session_record
from sessionfleet.kubectl.views.format import (
    age,
    countdown,
    parse_time,
    percent,
    table,
    tokens,
    wire_time,
)
from sessionfleet.kubectl.views.sessions import (
    matching_sessions,
    phase_totals,
    session_record,
    session_rows,
    sessions_text,
)
from sessionfleet.kubectl.views.snapshot import snapshot
from sessionfleet.kubectl.views.status import (
    WORKER_HEADERS,
    status_json,
    status_text,
    worker_entries,
    worker_rows,
)
from sessionfleet.kubectl.views.workers import drain_view, policy_label
from sessionfleet.policy.drain import resolve_policy
from sessionfleet.policy.migration import plan_migration
from sessionfleet.policy.placement import WorkerLoad
from sessionfleet.policy.sessions import SessionState
from sessionfleet.resources.names import session_object_name

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
V = "sessionfleet.dev/v1alpha1"


def ago(seconds: float) -> str:
    return wire_time(NOW - timedelta(seconds=seconds))


def cond(kind: str, status: str, reason: str, message: str = "", age: float = 30) -> dict[str, Any]:
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": ago(age),
    }


def worker(
    name: str,
    *,
    ns: str = "ns",
    model: str = "m",
    labels: dict[str, str] | None = None,
    spec: dict[str, Any] | None = None,
    **status: Any,
) -> dict[str, Any]:
    return {
        "apiVersion": V,
        "kind": "InferenceWorker",
        "metadata": {
            "name": name,
            "namespace": ns,
            "uid": f"uid-{name}",
            "labels": labels or {},
            "creationTimestamp": ago(600),
        },
        "spec": {"model": model, "engine": {"type": "sim"}, **(spec or {})},
        "status": status,
    }


def ready(name: str, **kwargs: Any) -> dict[str, Any]:
    return worker(name, phase="Ready", epoch=1, node=f"node-{name}", **kwargs)


def session(
    name: str,
    *,
    ns: str = "ns",
    model: str = "m",
    spec: dict[str, Any] | None = None,
    annotations: dict[str, str] | None = None,
    created: float = 300,
    **status: Any,
) -> dict[str, Any]:
    return {
        "apiVersion": V,
        "kind": "AgentSession",
        "metadata": {
            "name": name,
            "namespace": ns,
            "uid": f"uid-{name}",
            "annotations": annotations or {},
            "creationTimestamp": ago(created),
        },
        "spec": {"sessionId": f"id-{name}", "model": model, **(spec or {})},
        "status": status,
    }


def bound(name: str, to: str, **status: Any) -> dict[str, Any]:
    return session(name, phase="Bound", worker=to, **status)


def policy(name: str, ns: str = "ns", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": V,
        "kind": "DrainPolicy",
        "metadata": {"name": name, "namespace": ns},
        "spec": spec,
    }


def draining(name: str, started: float, reason: str = "SessionsPinned", **kwargs: Any) -> dict:
    message = f"waiting; triggered by DrainRequested under DrainPolicy {name}"
    return worker(
        name,
        phase="Draining",
        epoch=1,
        drainStartedAt=ago(started),
        conditions=[cond("Draining", "True", reason, message)],
        **kwargs,
    )


# --- time and tables ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (-5, "<invalid>"),
        (-0.5, "0s"),
        (0, "0s"),
        (119, "119s"),
        (120, "2m"),
        (200, "3m20s"),
        (599, "9m59s"),
        (600, "10m"),
        (179 * 60, "179m"),
        (3 * 3600, "3h"),
        (3 * 3600 + 5 * 60, "3h5m"),
        (9 * 3600, "9h"),
        (50 * 3600, "2d2h"),
        (48 * 3600, "2d"),
        (10 * 86400, "10d"),
        (3 * 365 * 86400 + 4 * 86400, "3y4d"),
        (9 * 365 * 86400, "9y"),
    ],
)
def test_ages_are_written_as_kubectl_writes_them(seconds: float, text: str) -> None:
    assert age(timedelta(seconds=seconds)) == text


@pytest.mark.parametrize(
    ("offset", "text"),
    [
        (581, "in 9m41s"),
        (0.2, "in 1s"),
        (3600 + 1, "in 1h1s"),
        (0, "now"),
        (-12, "12s ago"),
        (-12.7, "12s ago"),
        (-3 * 3600, "3h ago"),
    ],
)
def test_countdowns_are_to_the_second_and_never_early(offset: float, text: str) -> None:
    assert countdown(NOW + timedelta(seconds=offset), NOW) == text


def test_numbers_for_people() -> None:
    assert [tokens(n) for n in (None, 0, 812, 12_345, 2_500_000)] == [
        "-",
        "0",
        "812",
        "12.3K",
        "2.5M",
    ]
    assert percent(None) == "-" and percent(92.54) == "92.5%"
    assert percent(4, 0) == "4%"


def test_a_table_aligns_columns_three_spaces_apart() -> None:
    text = table(("name", "phase"), [["a", "Ready"], ["longer", "-"]])
    assert text.splitlines() == ["NAME     PHASE", "a        Ready", "longer   -"]


def test_times_are_read_from_the_api_server() -> None:
    assert parse_time("2026-01-01T12:00:00Z") == NOW
    assert parse_time("2026-01-01T12:00:00") == NOW
    assert parse_time("yesterday") is None and parse_time(None) is None


# --- status ---------------------------------------------------------------------------


def test_status_rows_count_pinned_sessions_and_show_hit_rate() -> None:
    snap = snapshot(
        [ready("wa", prefixHitRatePercent=92.54, kvCacheUsagePercent=4), ready("wb")],
        [
            bound("s1", "wa"),
            bound("s2", "wa"),
            session("s3", phase="Finished", worker="wa"),
            session("s4", phase="Lost", worker="wb"),
            session("s5"),
        ],
    )
    headers, rows = worker_rows(worker_entries(snap), NOW)
    assert headers == WORKER_HEADERS
    assert rows == [
        ["wa", "m", "Ready", "1", "2", "92.5%", "4%", "node-wa", "default", "-", "-"],
        ["wb", "m", "Ready", "1", "0", "-", "-", "node-wb", "default", "-", "-"],
    ]
    assert phase_totals(snap.sessions) == {"New": 1, "Bound": 2, "Finished": 1, "Lost": 1}


def test_a_draining_worker_shows_its_state_and_the_deadline_countdown() -> None:
    snap = snapshot(
        [draining("wb", started=60, labels={"pool": "b"})],
        [bound("s1", "wb")],
        [
            policy(
                "grace", selector={"matchLabels": {"pool": "b"}}, gracePeriod="2m", deadline="10m"
            )
        ],
    )
    (entry,) = worker_entries(snap)
    assert entry.choice.name == "grace"
    assert entry.drain.started_at == NOW - timedelta(seconds=60)
    assert entry.drain.migrate_at == NOW + timedelta(seconds=60)
    assert entry.drain.deadline_at == NOW + timedelta(seconds=540)
    _, (row,) = worker_rows([entry], NOW)
    assert row[-3:] == ["grace", "SessionsPinned (migrates in 1m)", "in 9m"]
    # Past the grace period and the deadline.
    later = NOW + timedelta(seconds=552)
    _, (row,) = worker_rows([entry], later)
    assert row[-2:] == ["SessionsPinned", "12s ago (Release)"]


@pytest.mark.parametrize(
    ("mode", "migrate_in"),
    [("Wait", None), ("Migrate", 0), ("WaitThenMigrate", 120)],
)
def test_when_a_drain_migrates_depends_on_its_mode(mode: str, migrate_in: int | None) -> None:
    snap = snapshot([draining("w", started=0)], policies=[policy("p", mode=mode, gracePeriod="2m")])
    view = drain_view(snap.workers[0], snap.policy_choice(snap.workers[0]))
    expected = None if migrate_in is None else NOW + timedelta(seconds=migrate_in)
    assert view.migrate_at == expected
    assert view.deadline_at == NOW + timedelta(minutes=10)


def test_drained_and_requested_drains_have_no_countdown() -> None:
    drained = worker("a", phase="Drained", drainStartedAt=ago(100), spec={"drain": True})
    requested = ready("b", spec={"drain": True})
    snap = snapshot([drained, requested])
    rows = worker_rows(worker_entries(snap), NOW)[1]
    assert [r[-2:] for r in rows] == [["Drained", "-"], ["Requested", "-"]]


def test_the_policy_is_resolved_as_the_operator_resolves_it() -> None:
    policies = [
        policy("a", selector={"matchLabels": {"pool": "x"}}),
        policy("b", selector={"matchLabels": {"tier": "gold"}}),
        policy("broken", gracePeriod="20m", deadline="10m"),  # grace beyond the deadline
    ]
    workers = [
        ready("one", labels={"pool": "x"}),
        ready("both", labels={"pool": "x", "tier": "gold"}),
        ready("ref", labels={"pool": "x", "tier": "gold"}, spec={"drainPolicyRef": "b"}),
        ready("missing", spec={"drainPolicyRef": "nope"}),
        ready("invalid", spec={"drainPolicyRef": "broken"}),
        ready("none"),
    ]
    snap = snapshot(workers, policies=policies)
    assert set(snap.invalid_policies["ns"]) == {"broken"}
    labels = {e.worker.metadata.name: policy_label(e.choice) for e in worker_entries(snap)}
    assert labels == {
        "one": "a",
        "both": "default (PolicyConflict)",
        "ref": "b",
        "missing": "default (PolicyNotFound)",
        "invalid": "default (PolicyInvalid)",
        "none": "default",
    }
    # The very function the operator calls, with the same inputs.
    for entry in worker_entries(snap):
        spec = entry.worker.spec
        assert entry.choice == resolve_policy(
            entry.worker.metadata.labels,
            spec.drain_policy_ref,
            snap.policy_specs["ns"],
            snap.invalid_policies["ns"],
        )


def test_status_text_sums_up_and_points_at_explain() -> None:
    snap = snapshot(
        [ready("wa"), draining("wb", started=60)],
        [bound("s1", "wa"), bound("s2", "wb"), session("s3", phase="Pending")],
    )
    text = status_text(snap, NOW, "ns")
    lines = text.splitlines()
    assert lines[:4] == [
        "Namespace:  ns",
        "Workers:    2 (Draining 1, Ready 1)",
        "Sessions:   3 (Pending 1, Bound 2)",
        "Drains:     1 in progress",
    ]
    assert lines[5].split() == [h.upper() for h in WORKER_HEADERS]
    assert "wb: waiting; triggered by DrainRequested under DrainPolicy wb" in lines
    assert "1 session is not bound: kubectl sessionfleet explain session <id> says why" in lines


def test_status_of_an_empty_namespace_and_of_all_namespaces() -> None:
    assert "No InferenceWorkers found in ns namespace." in status_text(snapshot(), NOW, "ns")
    snap = snapshot([ready("a", ns="x"), ready("b", ns="y")])
    text = status_text(snap, NOW, None)
    assert text.startswith("Namespace:  (all namespaces)")
    assert text.splitlines()[5].split()[:2] == ["NAMESPACE", "WORKER"]


def test_status_json_carries_the_drain_and_the_totals() -> None:
    snap = snapshot([draining("w", started=60)], [bound("s1", "w")])
    out = status_json(snap, NOW, "ns")
    json.dumps(out)  # serialisable
    (w,) = out["workers"]
    assert w["pinnedSessions"] == 1 and w["phase"] == "Draining"
    assert w["drain"]["state"] == "SessionsPinned"
    assert w["drain"]["deadlineAt"] == ago(-540)
    assert w["drain"]["deadlineInSeconds"] == 540
    assert out["sessions"] == {"total": 1, "byPhase": {"Bound": 1}}


def test_an_object_the_models_cannot_read_is_reported_not_skipped() -> None:
    bad = worker("bad")
    bad["spec"]["gpus"] = 99
    snap = snapshot([bad, ready("good")])
    assert [w.metadata.name for w in snap.workers] == ["good"]
    (problem,) = snap.unreadable
    assert problem.name == "bad" and "gpus" in problem.problem
    assert "InferenceWorker ns/bad cannot be read: spec.gpus" in status_text(snap, NOW, "ns")


# --- sessions -------------------------------------------------------------------------


def test_session_rows() -> None:
    snap = snapshot(
        sessions=[
            bound("b", "w", turns=3, promptTokens=24_000, hitRatePercent=88.0),
            session("a", created=30),
        ]
    )
    headers, rows = session_rows(snap.sessions, NOW)
    assert headers == ("id", "phase", "worker", "turns", "context", "hit%", "age")
    assert rows == [
        ["id-a", "New", "-", "0", "0", "-", "30s"],
        ["id-b", "Bound", "w", "3", "8.0K", "88.0%", "5m"],
    ]
    record = session_record(snap.sessions[0], NOW)
    assert record["contextTokens"] == 8000 and record["ageSeconds"] == 300
    assert sessions_text([], NOW, "ns") == "No sessions found in ns namespace."


def test_a_session_is_found_by_name_or_by_id() -> None:
    bodies = [session("a"), session("b", spec={"sessionId": "a"}), session("c")]
    assert [b["metadata"]["name"] for b in matching_sessions(bodies, "a")] == ["a"]
    assert [b["metadata"]["name"] for b in matching_sessions(bodies, "id-c")] == ["c"]
    assert matching_sessions(bodies, "zzz") == []


# --- events and explain ---------------------------------------------------------------


def v1_event(uid: str, name: str, reason: str, note: str, kind: str = "AgentSession", **more: Any):
    return {
        "metadata": {"uid": uid},
        "regarding": {"kind": kind, "name": name, "uid": f"uid-{name}"},
        "reason": reason,
        "note": note,
        "type": "Normal",
        "reportingController": "sessionfleet.dev/operator",
        **more,
    }


def core_event(uid: str, name: str, reason: str, message: str, **more: Any) -> dict[str, Any]:
    return {
        "metadata": {"uid": uid},
        "involvedObject": {"kind": "AgentSession", "name": name, "uid": f"uid-{name}"},
        "reason": reason,
        "message": message,
        "type": "Warning",
        "source": {"component": "sessionfleet-operator"},
        **more,
    }


def test_events_from_both_apis_count_once_and_only_about_the_object() -> None:
    v1 = [
        v1_event("e1", "s", "Bound", "bound to w", eventTime="2026-01-01T11:59:00.000000Z"),
        v1_event("e9", "s", "Other", "about a worker", kind="InferenceWorker"),
        v1_event("e8", "other", "Bound", "another session"),
    ]
    core = [
        # e1 again, as core/v1 shows it.
        core_event("e1", "s", "Bound", "bound to w", lastTimestamp=ago(60)),
        core_event("e2", "s", "Pending", "no room", lastTimestamp=ago(120), count=3),
        # An older object of the same name.
        {
            **core_event("e3", "s", "Old", "old"),
            "involvedObject": {"kind": "AgentSession", "name": "s", "uid": "gone"},
        },
    ]
    events = events_about("AgentSession", "s", "uid-s", v1, core)
    assert [(e.reason, e.count) for e in events] == [("Pending", 3), ("Bound", 1)]
    text = events_table(events, NOW)
    assert "Pending   2m (x3)   sessionfleet-operator" in text
    assert "Bound     60s       sessionfleet.dev/operator   bound to w" in text
    assert events_table([], NOW) == "no events"


def test_explain_a_session_no_worker_serves() -> None:
    snap = snapshot(
        [ready("w")],
        [
            s := session(
                "p",
                model="nope",
                phase="Pending",
                conditions=[cond("Ready", "False", "NoReadyWorker", "no Ready worker serves nope")],
            )
        ],
    )
    text = explain_session(snap.sessions[0], [], snap, NOW)
    assert s["spec"]["sessionId"] in text
    lines = text.splitlines()
    assert "Why:         not bound: NoReadyWorker: no Ready worker serves nope" in lines
    assert "             (No Ready worker serves the session's model.)" in lines
    assert "Workers:     no worker in ns serves nope; the workers here serve m" in lines
    assert "Now:         still no place: no Ready worker serves nope" in lines
    assert text.endswith("Events:\n  no events")


def test_explain_a_pending_session_that_would_fit_now() -> None:
    snap = snapshot(
        [ready("w"), worker("full", phase="Ready", spec={"capacity": {"maxSessions": 1}})],
        [
            session(
                "p", phase="Pending", conditions=[cond("Ready", "False", "NoCapacity", "full")]
            ),
            bound("x", "full"),
        ],
    )
    text = explain_session(snap.sessions[0], [], snap, NOW)
    assert "Workers:     serving m: full (Ready, 1/1), w (Ready, 0/32)" in text
    assert "placement would choose w (placed on the least-loaded worker w)" in text


def test_explain_a_session_the_operator_has_not_seen() -> None:
    snap = snapshot(sessions=[session("new")])
    text = explain_session(snap.sessions[0], [], snap, NOW, events_problem="forbidden")
    assert "the operator has not handled this session yet" in text
    assert "is an operator running for namespace ns?" in text
    assert text.endswith("Events:\n  forbidden")


def test_explain_a_migrating_session_names_its_acks_and_likely_target() -> None:
    snap = snapshot(
        [
            draining("src", started=30),
            ready("dst"),
            ready("busy", spec={"capacity": {"maxSessions": 1}}),
        ],
        [
            session(
                "m1",
                phase="Migrating",
                worker="src",
                migratingSince=ago(5),
                annotations={"ack.sessionfleet.dev/router-a": ago(5), "other": "x"},
                conditions=[cond("Ready", "False", "Migrating", "worker src drains")],
            ),
            bound("b", "busy"),
        ],
    )
    text = explain_session(snap.sessions[0], [], snap, NOW)
    assert "Migrating:   leaving src, asked 5s ago" in text
    assert "Because:     src drains: waiting; triggered by DrainRequested" in text
    assert "Acknowledged: router-a" in text
    assert "Target:      dst if it moved now" in text


@pytest.mark.parametrize(("driver", "target"), [("engine", "same"), ("none", "other")])
def test_explain_names_the_target_the_operators_plan_migration_chooses(
    driver: str, target: str
) -> None:
    # With its saved state (driver engine) the session goes to a worker that can load it
    # (same engine as src), though the vllm worker is less loaded; without, to the latter.
    snap = snapshot(
        [
            draining("src", started=30, spec={"checkpoint": {"driver": driver}}),
            ready("same", spec={"capacity": {"maxSessions": 2}}),
            ready("other", spec={"engine": {"type": "vllm"}}),
        ],
        [
            session("m1", phase="Migrating", worker="src", migratingSince=ago(5)),
            bound("b", "same"),
        ],
    )
    text = explain_session(snap.sessions[0], [], snap, NOW)
    assert f"Target:      {target} if it moved now" in text
    record = explain_session_record(snap.sessions[0], [], snap, NOW)
    assert record["placementNow"]["worker"] == target


def test_explain_bound_restoring_finished_and_lost_sessions() -> None:
    snap = snapshot(
        [
            worker(
                "rec",
                phase="Recovering",
                conditions=[cond("Recovering", "True", "PodFailed", "pod rec-1 failed")],
            )
        ],
        [
            bound("b", "gone", boundAt=ago(90), turns=2, promptTokens=3000, hitRatePercent=50.0),
            session("r", phase="Restoring", worker="rec"),
            session(
                "f",
                phase="Finished",
                finishedAt=ago(600),
                conditions=[cond("Ready", "False", "FinishedByClient", "the client finished it")],
                migrations=[
                    {
                        "from": "a",
                        "to": "b",
                        "reason": "Drain",
                        "at": ago(700),
                        "checkpoint": "cp-1",
                        "recomputedTokens": 0,
                    }
                ],
            ),
            session(
                "l",
                phase="Lost",
                conditions=[cond("Ready", "False", "WorkerDeleted", "worker x was deleted")],
            ),
        ],
    )
    texts = {s.metadata.name: explain_session(s, [], snap, NOW) for s in snap.sessions}
    assert "Bound:       to gone since 90s ago" in texts["b"]
    assert "Worker:      gone was not found" in texts["b"]
    assert "Turns:       2, context ~1.5K tokens, hit rate 50.0%" in texts["b"]
    assert "Worker:      PodFailed: pod rec-1 failed" in texts["r"]
    assert "finished: FinishedByClient: the client finished it" in texts["f"]
    assert "deleted in 50m (ttlSecondsAfterFinished 3600)" in texts["f"]
    assert "a -> b (Drain) 11m ago through checkpoint cp-1, 0 tokens recomputed" in texts["f"]
    assert "lost: WorkerDeleted: worker x was deleted" in texts["l"]


REFUSED_HINT = "the hinted worker w was not admitted: it serves m, not nope"
"""The operator's preview says why it would not bind the session where its hint says."""


def test_explain_as_data_of_a_pending_session() -> None:
    snap = snapshot(
        [ready("w")],
        [
            session(
                "p",
                model="nope",
                phase="Pending",
                spec={"workerHint": "w"},
                conditions=[cond("Ready", "False", "NoReadyWorker", "no Ready worker serves nope")],
            )
        ],
    )
    events = events_about(
        "AgentSession",
        "p",
        "uid-p",
        [v1_event("e1", "p", "Pending", "no Ready worker serves nope", eventTime=ago(5))],
    )
    record = explain_session_record(snap.sessions[0], events, snap, NOW)
    json.dumps(record)  # serialisable
    assert record | {"conditions": [], "events": []} == {
        "namespace": "ns",
        "name": "p",
        "id": "id-p",
        "model": "nope",
        "phase": "Pending",
        "worker": None,
        "turns": 0,
        "contextTokens": 0,
        "hitRatePercent": None,
        "createdAt": ago(300),
        "ageSeconds": 300,
        "workerPin": None,
        "workerHint": "w",
        "parentSessionId": None,
        "pod": None,
        "epoch": None,
        "ready": {
            "reason": "NoReadyWorker",
            "message": "no Ready worker serves nope",
            "meaning": "No Ready worker serves the session's model.",
        },
        "explanation": [
            "Why: not bound: NoReadyWorker: no Ready worker serves nope",
            "(No Ready worker serves the session's model.)",
            "Workers: no worker in ns serves nope; the workers here serve m",
            "Now: still no place: no Ready worker serves nope; " + REFUSED_HINT,
        ],
        "placementNow": {
            "worker": None,
            "reason": "NoReadyWorker",
            "message": "no Ready worker serves nope; " + REFUSED_HINT,
        },
        "acknowledgedBy": None,
        "migrations": [],
        "conditions": [],
        "events": [],
        "eventsProblem": None,
    }
    assert record["conditions"] == [
        {
            "type": "Ready",
            "status": "False",
            "reason": "NoReadyWorker",
            "message": "no Ready worker serves nope",
            "lastTransitionTime": ago(30),
        }
    ]
    assert record["events"] == [
        {
            "type": "Normal",
            "reason": "Pending",
            "message": "no Ready worker serves nope",
            "from": "sessionfleet.dev/operator",
            "count": 1,
            "lastSeen": ago(5),
        }
    ]
    problem = explain_session_record(
        snap.sessions[0], [], snap, NOW, events_problem="events could not be listed: no"
    )
    assert (problem["events"], problem["eventsProblem"]) == (None, "events could not be listed: no")


def test_explain_as_data_of_a_migrating_and_a_finished_session() -> None:
    snap = snapshot(
        [draining("src", started=30), ready("dst")],
        [
            session(
                "m1",
                phase="Migrating",
                worker="src",
                epoch=1,
                pod="src-1",
                annotations={"ack.sessionfleet.dev/router-a": ago(5)},
            ),
            session(
                "f",
                phase="Finished",
                migrations=[
                    {"from": "a", "to": "b", "reason": "Drain", "at": ago(700), "checkpoint": "c"}
                ],
            ),
        ],
    )
    records = {s.metadata.name: explain_session_record(s, [], snap, NOW) for s in snap.sessions}
    moving = records["m1"]
    assert (moving["worker"], moving["pod"], moving["epoch"]) == ("src", "src-1", 1)
    assert moving["acknowledgedBy"] == ["router-a"]
    assert moving["placementNow"]["worker"] == "dst"
    assert moving["explanation"][0].startswith("Migrating: leaving src")
    assert "Acknowledged: router-a" in moving["explanation"]
    finished = records["f"]
    assert finished["placementNow"] is None and finished["acknowledgedBy"] is None
    assert finished["migrations"] == [
        {"from": "a", "to": "b", "reason": "Drain", "at": ago(700), "checkpoint": "c"}
    ]


# --- drain preview --------------------------------------------------------------------


def test_a_drain_under_wait_waits_for_the_pinned_sessions() -> None:
    snap = snapshot(
        [ready("w"), ready("other")],
        [bound("s1", "w", turns=2, promptTokens=2000), bound("s2", "w")],
        [policy("hold", mode="Wait", deadline="30m", onDeadline="Hold")],
    )
    text = drain_preview(snap, snap.workers[1], NOW, dry_run=False, was_set=False)
    lines = text.splitlines()
    assert lines[0] == "InferenceWorker ns/w: spec.drain set to true"
    assert "Policy:       DrainPolicy hold (its selector matches the worker's labels)" in lines
    assert lines[
        lines.index("Policy:       DrainPolicy hold (its selector matches the worker's labels)") + 1
    ].startswith("Mode:         Wait: Hold the drain until")
    assert "Grace period: 2m (not used by mode Wait)" in lines
    assert "At deadline:  Hold: the holds stay: the platform's own deadline decides" in lines
    assert "Pinned sessions (2), waited for until they finish, at most 30m:" in lines
    assert "TARGET NOW" not in text and "Migration:" not in text
    assert any(
        line.split()[:3] == ["deadline", "30m,", "in"] and "(2026-01-01T12:30:00Z)" in line
        for line in lines
    )
    assert "hold: no new session goes to w; the 2 pinned sessions keep their turns here" in text


def test_a_drain_that_migrates_shows_where_each_session_would_go() -> None:
    snap = snapshot(
        [
            ready("src", spec={"checkpoint": {"driver": "none"}}),
            ready("a", spec={"capacity": {"maxSessions": 2}}),
            ready("b", spec={"capacity": {"maxSessions": 2}}),
        ],
        [*(bound(f"s{i}", "src") for i in range(1, 5)), bound("x", "a")],
        [policy("now", mode="Migrate")],
    )
    text = drain_preview(snap, snap.workers[2], NOW, dry_run=True, was_set=False)
    assert (
        text.splitlines()[0] == "InferenceWorker ns/src: spec.drain would be set to true (dry run)"
    )
    assert "without its cache (the worker's driver is none)" in text
    assert "Pinned sessions (4), migrated now:" in text
    rows = {line.split()[0]: line.split()[-1] for line in text.splitlines() if "id-s" in line}
    # Each placed session counts for the next, as the operator's plan_migration does: b is
    # empty; then a and b tie (1 of 2) and the name decides; then only b has room; then none.
    assert rows == {"id-s1": "b", "id-s2": "a", "id-s3": "b", "id-s4": "(NoCapacity)"}
    assert any(
        line.split()[:6] == ["now", "the", "pinned", "sessions", "move", "to"]
        for line in text.splitlines()
    )


# A batch where the order counts: a (sim) has room for one more session, b (sim) for four
# but only 10K tokens of context, v (vllm) for one. id-s3 is hinted to v and id-s4 pinned to
# src: a session that migrates keeps neither. id-s6 (20K tokens) fits nowhere once the
# others are placed; id-s5 after it still does. Through a checkpoint the sessions prefer
# the workers that can load src's state (sim engines) and go to v only when none has room.
BATCH_TARGETS = {
    True: {
        "id-s1": "b",
        "id-s2": "b",
        "id-s3": "a",
        "id-s4": "v",
        "id-s6": "none (NoCapacity)",
        "id-s5": "b",
    },
    False: {
        "id-s1": "b",
        "id-s2": "v",
        "id-s3": "b",
        "id-s4": "a",
        "id-s6": "none (NoCapacity)",
        "id-s5": "b",
    },
}


@pytest.mark.parametrize("through_checkpoint", [True, False])
def test_the_drain_preview_is_the_operators_own_plan_migration(through_checkpoint: bool) -> None:
    contexts = {"s1": 4000, "s2": 4000, "s3": 1000, "s4": 4000, "s6": 20000, "s5": 1000}
    wishes = {"s3": {"workerHint": "v"}, "s4": {"workerPin": "src"}}
    snap = snapshot(
        [
            ready("src"),
            ready("a", spec={"capacity": {"maxSessions": 2}}),
            ready("b", spec={"capacity": {"maxSessions": 4, "kvTokens": 10000}}),
            ready("v", spec={"engine": {"type": "vllm"}, "capacity": {"maxSessions": 1}}),
        ],
        [
            *(
                session(
                    name,
                    spec=wishes.get(name),
                    phase="Bound",
                    worker="src",
                    promptTokens=tokens,
                    turns=1,
                )
                for name, tokens in contexts.items()
            ),
            bound("x", "a"),
        ],
        [policy("now", mode="Migrate", checkpoint=through_checkpoint)],
    )
    text = drain_preview(snap, snap.workers[2], NOW, dry_run=True, was_set=False)
    # ID, PHASE, TURNS, CONTEXT, TARGET NOW (which may be two words: none and why).
    shown = {
        line.split()[0]: " ".join(line.split()[4:])
        for line in text.splitlines()
        if line.strip().startswith("id-s")
    }

    # What the operator decides for the same fleet: its plan_migration over its inputs,
    # written out here (each session as if every router had acknowledged).
    def state(name: str, tokens: int) -> SessionState:
        return SessionState(
            "ns",
            name,
            f"id-{name}",
            "m",
            phase=SessionPhase.MIGRATING,
            worker="src",
            migrating_since=NOW,
            prompt_tokens=tokens,
            turns=1,
            hint=wishes.get(name, {}).get("workerHint"),
            pin=wishes.get(name, {}).get("workerPin"),
        )

    steps = plan_migration(
        [state(name, tokens) for name, tokens in contexts.items()],
        "src",
        [
            WorkerLoad("a", "m", True, pinned_sessions=1, max_sessions=2),
            WorkerLoad("b", "m", True, pinned_sessions=0, max_sessions=4, kv_tokens_capacity=10000),
            WorkerLoad(
                "src",
                "m",
                True,
                pinned_sessions=6,
                max_sessions=16,
                kv_tokens_pinned=sum(contexts.values()),
            ),
            WorkerLoad("v", "m", True, pinned_sessions=0, max_sessions=1),
        ],
        (),
        NOW,
        timedelta(seconds=30),
        frozenset({"src", "a", "b"}) if through_checkpoint else None,
    )
    operator = {
        step.session.session_id: step.target
        or f"none ({step.reason.value if step.reason is not None else step.action.name})"
        for step in steps
    }
    assert shown == operator == BATCH_TARGETS[through_checkpoint]


def test_a_drain_already_under_way_counts_from_its_start() -> None:
    snap = snapshot(
        [draining("w", started=90, spec={"drain": True})],
        [bound("s", "w")],
    )
    text = drain_preview(snap, snap.workers[0], NOW, dry_run=False, was_set=True)
    assert text.splitlines()[0] == "InferenceWorker ns/w: spec.drain is already true"
    assert "Draining:     since 90s ago (SessionsPinned); times below count from then" in text
    assert "grace 2m, in 30s (2026-01-01T12:00:30Z)" in text
    assert "Policy:       the built-in default (no DrainPolicy selects the worker)" in text


def test_a_drain_warns_when_spec_drain_does_nothing_or_the_policy_is_wrong() -> None:
    snap = snapshot(
        [ready("w", spec={"drainPolicyRef": "off"}), ready("x", spec={"drainPolicyRef": "gone"})],
        policies=[policy("off", triggers={"workerDrain": False})],
    )
    off = drain_preview(snap, snap.workers[0], NOW, dry_run=True, was_set=False)
    assert "warning: this policy does not drain on spec.drain" in off
    assert "Pinned sessions: none" in off
    assert "no session is pinned: w is Drained: its pod is deleted" in off
    gone = drain_preview(snap, snap.workers[1], NOW, dry_run=True, was_set=False)
    assert "warning: DrainPolicy gone does not exist; using the built-in default" in gone
    assert "Policy:       the built-in default (PolicyNotFound:" in gone


def test_a_whole_worker_migration_is_described_as_such() -> None:
    snap = snapshot(
        [ready("w")],
        [bound("s", "w")],
        [policy("whole", migrationScope="Worker", mode="Migrate")],
    )
    text = drain_preview(snap, snap.workers[0], NOW, dry_run=True, was_set=False)
    assert "w moves whole to a node that is not draining; its sessions follow it" in text
    assert "Migration:    the whole worker is checkpointed and restarted" in text


@pytest.mark.parametrize(
    ("body", "was_set", "expected"),
    [
        (ready("w"), False, "spec.drain is already false"),
        (
            worker("w", phase="Drained", epoch=3, spec={"drain": True}),
            True,
            "It is Drained: a new pod (w-4) starts",
        ),
        (draining("w", 30, spec={"drain": True}), True, "the 1 session(s) still pinned stay on w"),
        (ready("w", spec={"drain": True}), True, "The operator had not started the drain"),
    ],
)
def test_undrain_says_what_follows(body: dict[str, Any], was_set: bool, expected: str) -> None:
    snap = snapshot([body], [bound("s", "w")])
    text = undrain_summary(snap, snap.workers[0], NOW, dry_run=False, was_set=was_set)
    assert expected in text


def test_undrain_of_a_drain_of_the_node_says_it_goes_on() -> None:
    body = worker(
        "w",
        phase="Draining",
        drainStartedAt=ago(10),
        spec={"drain": True},
        conditions=[
            cond("Draining", "True", "SessionsPinned", "waiting; triggered by NodeCordoned")
        ],
    )
    snap = snapshot([body])
    text = undrain_summary(snap, snap.workers[0], NOW, dry_run=True, was_set=True)
    assert "spec.drain would be set to false (dry run)" in text
    assert "draining for another reason (waiting; triggered by NodeCordoned)" in text


# --- checkpoints ----------------------------------------------------------------------


def test_a_manual_checkpoint_is_a_valid_worker_checkpoint() -> None:
    body = manual_checkpoint("w", "ns")
    assert body["metadata"]["generateName"] == "w-manual-"
    assert body["spec"]["reason"] == "Manual" and body["spec"]["worker"] == "w"
    assert "ownerReferences" not in body["metadata"]
    named = {**body, "metadata": {**body["metadata"], "name": "w-manual-abcde"}}
    assert parse(WorkerCheckpoint, named).ok


def test_checkpoint_outcomes() -> None:
    pending: dict[str, Any] = {"metadata": {"name": "c"}, "spec": {"worker": "w"}}
    assert checkpoint_phase(pending) == "Pending" and checkpoint_done(pending) is None
    done = {
        **pending,
        "status": {
            "phase": "Succeeded",
            "epoch": 1,
            "durationSeconds": 0.42,
            "sizeBytes": 3 * 1024 * 1024,
            "location": "/ckpt/ns/w/c",
            "sessions": [{"sessionId": "a", "tokens": 100}],
            "totalTokens": 100,
        },
    }
    assert checkpoint_done(done) is True
    assert checkpoint_summary(done).splitlines() == [
        "written in 0.4s of epoch 1: 3.0 MiB, 1 session(s), 100 tokens",
        "location: /ckpt/ns/w/c",
    ]
    failed = {
        **pending,
        "status": {
            "phase": "Failed",
            "error": "driver none",
            "conditions": [cond("Checkpointed", "False", "DriverUnsupported", "driver none")],
        },
    }
    assert checkpoint_done(failed) is False
    assert checkpoint_summary(failed) == "failed: DriverUnsupported: driver none"


# --- the command line -----------------------------------------------------------------


class FakeApi:
    """The API calls the plugin makes, answered from memory and recorded."""

    def __init__(self, *objects: dict[str, Any], events: list[tuple[str, dict]] | None = None):
        self.store: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for body in objects:
            self.store.setdefault(self._key(self._resource_of(body)), []).append(body)
        self.patches: list[tuple[str, Any]] = []
        self.created: list[dict[str, Any]] = []
        self.watch_events = events or []
        self.watch_args: dict[str, Any] = {}
        self.refuse: dict[tuple[str, str], Exception] = {}
        self.closed = False

    @staticmethod
    def _resource_of(body: dict[str, Any]) -> Resource:
        return {
            "InferenceWorker": WORKERS,
            "AgentSession": SESSIONS,
            "DrainPolicy": DRAIN_POLICIES,
            "WorkerCheckpoint": CHECKPOINTS,
        }[body["kind"]]

    @staticmethod
    def _key(resource: Resource) -> tuple[str, str]:
        return (resource.group, resource.plural)

    def _check(self, verb: str, resource: Resource) -> None:
        error = self.refuse.get((verb, resource.plural))
        if error is not None:
            raise error

    async def get(self, resource: Resource, name: str, namespace: str | None = None) -> dict:
        self._check("get", resource)
        for body in self.store.get(self._key(resource), []):
            if body["metadata"]["name"] == name and body["metadata"]["namespace"] == namespace:
                return body
        raise NotFound(404, f'{resource.plural} "{name}" not found')

    async def list(
        self,
        resource: Resource,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        chunk: int = 500,
    ) -> tuple[list[dict[str, Any]], str]:
        self._check("list", resource)
        items = [
            b
            for b in self.store.get(self._key(resource), [])
            if namespace is None or (b.get("metadata") or {}).get("namespace") == namespace
        ]
        return items, "1"

    async def create(
        self, resource: Resource, body: Mapping[str, Any], namespace: str | None = None
    ) -> dict[str, Any]:
        self._check("create", resource)
        meta = dict(body["metadata"])
        meta["name"] = meta.pop("generateName", "") + "abcde"
        meta["resourceVersion"] = "10"
        created = {**body, "metadata": meta}
        self.created.append(created)
        return created

    async def patch(
        self, resource: Resource, name: str, body: Any, namespace: str | None = None, **_: Any
    ) -> dict[str, Any]:
        self._check("patch", resource)
        self.patches.append((name, body))
        stored = await self.get(resource, name, namespace)
        stored["spec"].update(body.get("spec", {}))  # a merge patch of spec fields
        return stored

    async def watch(
        self, resource: Resource, namespace: str | None = None, **kwargs: Any
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        self.watch_args = kwargs
        for kind, obj in self.watch_events:
            yield kind, obj
        await asyncio.sleep(3600)  # the server keeps the watch open

    async def aclose(self) -> None:
        self.closed = True


def run(api: FakeApi, *argv: str, namespace: str | None = "ns") -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()

    def connector(args: Any) -> cli.Connection:
        return cli.Connection(api, "https://127.0.0.1:6443", namespace)

    status = cli.main(list(argv), connector=connector, out=out, err=err, clock=lambda: NOW)
    return status, out.getvalue(), err.getvalue()


def test_flags_go_before_or_after_the_subcommand() -> None:
    parser = cli.build_parser()
    before = parser.parse_args(["-n", "a", "--context", "c", "status"])
    after = parser.parse_args(["status", "-n", "a", "--context", "c"])
    for args in (before, after):
        assert (args.namespace, args.context, args.kubeconfig) == ("a", "c", None)
    assert parser.parse_args(["status", "-A", "-o", "json"]).all_namespaces
    checkpoint = parser.parse_args(["checkpoint", "w", "--no-wait", "--timeout", "90s"])
    assert (checkpoint.wait, checkpoint.timeout) == (False, timedelta(seconds=90))
    assert parser.parse_args(["checkpoint", "w"]).timeout == timedelta(minutes=15)
    assert parser.parse_args(["checkpoint", "w"]).wait is True


SUBCOMMANDS = [
    ["status"],
    ["sessions"],
    ["explain", "session", "s"],
    ["drain", "w"],
    ["undrain", "w"],
    ["checkpoint", "w"],
]


@pytest.mark.parametrize("argv", SUBCOMMANDS, ids=lambda argv: argv[0])
@pytest.mark.parametrize("where", ["before", "after"])
def test_every_subcommand_takes_the_connection_flags(argv: list[str], where: str) -> None:
    flags = ["--kubeconfig", "/k/config", "--context", "ctx", "-n", "agents"]
    full = flags + argv if where == "before" else argv + flags
    seen: list[Any] = []

    def connector(args: Any) -> cli.Connection:
        seen.append(args)
        raise RuntimeError("no cluster here")

    err = io.StringIO()
    assert cli.main(full, connector=connector, out=io.StringIO(), err=err) == 1
    (args,) = seen
    assert (args.kubeconfig, args.context, args.namespace) == ("/k/config", "ctx", "agents")
    assert "cannot load the Kubernetes configuration: no cluster here" in err.getvalue()


@pytest.mark.parametrize(
    ("argv", "output"),
    [
        (["status"], True),
        (["sessions"], True),
        (["explain", "session", "s"], True),
        (["checkpoint", "w"], True),
        (["drain", "w"], False),
        (["undrain", "w"], False),
    ],
    ids=lambda v: v[0] if isinstance(v, list) else str(v),
)
def test_which_subcommands_take_an_output_format(argv: list[str], output: bool) -> None:
    parser = cli.build_parser()
    if output:
        for fmt in ("text", "json", "yaml"):
            assert parser.parse_args([*argv, "-o", fmt]).output == fmt
        assert parser.parse_args(argv).output == "text"
    else:
        assert not hasattr(parser.parse_args(argv), "output")


def test_render_writes_json_and_block_yaml() -> None:
    data = {"b": [1, {"x": None}], "a": "ünï", "when": "2026-01-01T12:00:00Z"}
    assert cli.render(data, "json") == json.dumps(data, indent=2)
    text = cli.render(data, "yaml")
    assert text.splitlines()[:2] == ["b:", "- 1"]  # the builders' order, block style
    assert "ünï" in text and "!!" not in text and not text.endswith("\n")
    assert yaml.safe_load(text) == data
    assert cli.render([], "yaml") == "[]"
    with pytest.raises(ValueError):
        cli.render(data, "text")


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["nonsense"],
        ["explain", "pod", "x"],
        ["checkpoint", "w", "--timeout", "soon"],
        ["checkpoint", "w", "--timeout", "0s"],
        ["status", "-o", "wide"],
        ["drain", "w", "-o", "json"],
        ["drain"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert run(FakeApi(), *argv)[0] == 2
    assert "usage: kubectl sessionfleet" in capsys.readouterr().err


def test_the_namespace_defaults_to_the_contexts_then_default() -> None:
    api = FakeApi(ready("w", ns="ctx"), ready("v", ns="default"))
    assert "w " in run(api, "status", namespace="ctx")[1]
    assert "v " in run(api, "status", namespace=None)[1]
    assert "Namespace:  other" in run(api, "status", "-n", "other", namespace="ctx")[1]
    every = run(api, "status", "-A")[1]
    assert "ctx" in every and "default" in every
    assert api.closed


def test_status_and_sessions_print_text_and_json() -> None:
    api = FakeApi(ready("w"), bound("s", "w", turns=2, promptTokens=100))
    code, out, _ = run(api, "status")
    assert code == 0 and "Sessions:   1 (Bound 1)" in out
    code, out, _ = run(api, "status", "-o", "json")
    assert code == 0 and json.loads(out)["workers"][0]["pinnedSessions"] == 1
    code, out, _ = run(api, "sessions")
    assert code == 0 and out.split("\n")[1].split()[:4] == ["id-s", "Bound", "w", "2"]
    code, out, _ = run(api, "sessions", "-o", "json")
    assert json.loads(out)[0]["id"] == "id-s"


@pytest.mark.parametrize(
    "argv", [["status"], ["status", "-A"], ["sessions"], ["sessions", "--worker", "w"]]
)
def test_yaml_output_is_the_json_output(argv: list[str]) -> None:
    api = FakeApi(ready("w"), bound("s", "w", turns=2, promptTokens=100), session("p"))
    code, as_json, _ = run(api, *argv, "-o", "json")
    assert code == 0
    code, as_yaml, err = run(api, *argv, "-o", "yaml")
    assert (code, err) == (0, "")
    assert yaml.safe_load(as_yaml) == json.loads(as_json)
    assert not as_yaml.lstrip().startswith(("{", "["))  # block style, not flow


def test_status_and_sessions_in_yaml() -> None:
    api = FakeApi(ready("w"), bound("s", "w", turns=2, promptTokens=100))
    status = yaml.safe_load(run(api, "status", "-o", "yaml")[1])
    assert status["workers"][0]["pinnedSessions"] == 1
    assert status["sessions"] == {"total": 1, "byPhase": {"Bound": 1}}
    (listed,) = yaml.safe_load(run(api, "sessions", "-o", "yaml")[1])
    assert (listed["id"], listed["worker"], listed["turns"]) == ("id-s", "w", 2)
    code, out, _ = run(FakeApi(), "sessions", "-o", "yaml")
    assert (code, yaml.safe_load(out)) == (0, [])


def test_sessions_of_one_worker_and_of_a_missing_one() -> None:
    api = FakeApi(ready("w"), ready("v"), bound("a", "w"), bound("b", "v"))
    code, out, _ = run(api, "sessions", "--worker", "v")
    assert code == 0 and "id-b" in out and "id-a" not in out
    code, out, err = run(api, "sessions", "--worker", "nope")
    assert code == 1 and out == ""
    assert err == 'error: InferenceWorker "nope" not found in namespace "ns"\n'


def test_drain_patches_spec_drain_and_dry_run_does_not() -> None:
    api = FakeApi(ready("w"), bound("s", "w"))
    code, out, _ = run(api, "drain", "w", "--dry-run")
    assert code == 0 and api.patches == [] and "(dry run)" in out
    code, out, _ = run(api, "drain", "w")
    assert code == 0 and api.patches == [("w", {"spec": {"drain": True}})]
    assert "Pinned sessions (1), waited for 2m, then migrated:" in out
    code, out, _ = run(api, "undrain", "w")
    assert code == 0 and api.patches[-1] == ("w", {"spec": {"drain": False}})
    assert "spec.drain set to false" in out


def test_undrain_patches_only_what_changes() -> None:
    api = FakeApi(ready("w", spec={"drain": True}))
    assert run(api, "undrain", "w")[0] == 0
    assert api.patches == [("w", {"spec": {"drain": False}})]
    api = FakeApi(ready("w"))
    code, out, _ = run(api, "undrain", "w")
    assert code == 0 and api.patches == [] and "already false" in out


@pytest.mark.parametrize("command", ["drain", "undrain", "checkpoint"])
def test_a_missing_worker_is_a_clear_message_and_exit_1(command: str) -> None:
    code, out, err = run(FakeApi(), command, "ghost")
    assert (code, out) == (1, "")
    assert err == 'error: InferenceWorker "ghost" not found in namespace "ns"\n'


def test_api_errors_print_the_servers_message_without_a_traceback() -> None:
    api = FakeApi(ready("w"))
    message = (
        'inferenceworkers.sessionfleet.dev "w" is forbidden: User "dev" cannot patch resource '
        '"inferenceworkers" in API group "sessionfleet.dev" in the namespace "ns"'
    )
    api.refuse[("patch", "inferenceworkers")] = Forbidden(403, message)
    code, _, err = run(api, "drain", "w")
    assert code == 1 and err == f"error: {message}\n"
    assert "Traceback" not in err
    api.refuse[("list", "inferenceworkers")] = NotFound(
        404, "the server could not find the requested resource"
    )
    code, _, err = run(api, "status")
    assert code == 1 and "(are the sessionfleet CRDs installed?)" in err
    api.refuse[("list", "inferenceworkers")] = ApiUnavailable(0, "GET /x: ConnectError()")
    code, _, err = run(api, "status")
    assert (
        err
        == "error: cannot reach the API server at https://127.0.0.1:6443: GET /x: ConnectError()\n"
    )


def test_a_kubeconfig_that_cannot_be_loaded_is_one_line(tmp_path: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    missing = str(tmp_path / "nope")
    code = cli.main(["--kubeconfig", missing, "status"], out=out, err=err)
    assert code == 1 and err.getvalue().startswith(
        "error: cannot load the Kubernetes configuration"
    )
    assert "Traceback" not in err.getvalue()


def test_explain_finds_a_session_by_its_id_and_lists_events() -> None:
    routed = session("r", spec={"sessionId": "Sess_42"})
    routed["metadata"]["name"] = session_object_name("Sess_42")
    listed = session("l", spec={"sessionId": "weird/id?"})
    api = FakeApi(routed, listed)
    event = v1_event("e1", routed["metadata"]["name"], "Bound", "bound", eventTime=ago(5))
    event["regarding"]["uid"] = "uid-r"
    event["metadata"]["namespace"] = "ns"
    api.store[(EVENTS.group, EVENTS.plural)] = [event]
    code, out, _ = run(api, "explain", "session", "Sess_42")
    assert code == 0 and "Session:     Sess_42" in out and "bound" in out.split("Events:")[1]
    code, out, _ = run(api, "explain", "session", "weird/id?")
    assert code == 0 and "Session:     weird/id?" in out
    code, _, err = run(api, "explain", "session", "nope")
    assert code == 1 and 'AgentSession "nope" not found in namespace "ns"' in err


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_explain_as_json_or_yaml(fmt: str) -> None:
    lonely = session(
        "p",
        model="nope",
        phase="Pending",
        conditions=[cond("Ready", "False", "NoReadyWorker", "no Ready worker serves nope")],
    )
    api = FakeApi(ready("w"), lonely)
    code, out, err = run(api, "explain", "session", "id-p", "-o", fmt)
    assert (code, err) == (0, "")
    record = json.loads(out) if fmt == "json" else yaml.safe_load(out)
    snap = snapshot([ready("w")], [lonely])
    assert record == explain_session_record(snap.sessions[0], [], snap, NOW)
    assert record["ready"]["reason"] == "NoReadyWorker" and record["events"] == []
    api.refuse[("list", "events")] = Forbidden(403, "events is forbidden")
    code, out, _ = run(api, "explain", "session", "p", "-o", fmt)
    record = json.loads(out) if fmt == "json" else yaml.safe_load(out)
    assert code == 0 and record["events"] is None
    assert record["eventsProblem"].startswith("events could not be listed")


def test_explain_says_when_events_cannot_be_listed() -> None:
    api = FakeApi(session("s", phase="Pending"))
    api.refuse[("list", "events")] = Forbidden(403, "events is forbidden")
    code, out, _ = run(api, "explain", "session", "s")
    assert code == 0
    assert "Events:\n  events could not be listed: events.k8s.io/v1: events is forbidden" in out
    assert CORE_EVENTS.plural == EVENTS.plural  # both refused by the one rule above


def test_an_id_carried_by_two_sessions_is_ambiguous() -> None:
    api = FakeApi(session("a", spec={"sessionId": "x"}), session("b", spec={"sessionId": "x"}))
    code, _, err = run(api, "explain", "session", "x")
    assert code == 1 and "carried by several AgentSessions: a, b" in err


def checkpoint_at(phase: str, version: str, **status: Any) -> dict[str, Any]:
    return {
        "kind": "WorkerCheckpoint",
        "apiVersion": V,
        "metadata": {"name": "w-manual-abcde", "namespace": "ns", "resourceVersion": version},
        "spec": {"worker": "w", "reason": "Manual"},
        "status": {"phase": phase, **status},
    }


def test_checkpoint_waits_for_success_and_prints_phase_changes() -> None:
    api = FakeApi(
        ready("w"),
        events=[
            ("MODIFIED", checkpoint_at("Running", "11")),
            ("MODIFIED", checkpoint_at("Running", "12")),
            ("MODIFIED", checkpoint_at("Succeeded", "13", location="/c", totalTokens=5)),
        ],
    )
    code, out, _ = run(api, "checkpoint", "w")
    assert code == 0
    (created,) = api.created
    assert created["spec"] == {"worker": "w", "reason": "Manual", "sessions": []}
    assert api.watch_args["field_selector"] == "metadata.name=w-manual-abcde"
    assert api.watch_args["resource_version"] == "10"
    phases = [
        line.split()[-1]
        for line in out.splitlines()
        if line.strip().endswith(("Pending", "Running", "Succeeded"))
    ]
    assert phases == ["Pending", "Running", "Succeeded"]
    assert out.splitlines()[0] == (
        "WorkerCheckpoint ns/w-manual-abcde created for worker w (reason Manual)"
    )
    assert "location: /c" in out


def test_checkpoint_failure_and_timeout_exit_1() -> None:
    failed = FakeApi(
        ready("w"),
        events=[("MODIFIED", checkpoint_at("Failed", "11", error="driver none cannot save"))],
    )
    code, out, _ = run(failed, "checkpoint", "w")
    assert code == 1 and "failed: driver none cannot save" in out
    stuck = FakeApi(ready("w"), events=[("MODIFIED", checkpoint_at("Running", "11"))])
    code, out, _ = run(stuck, "checkpoint", "w", "--timeout", "1s")
    assert code == 1 and "timed out after 1s: the checkpoint is still Running" in out
    code, out, _ = run(FakeApi(ready("w")), "checkpoint", "w", "--no-wait")
    assert code == 0 and out.count("\n") == 1


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_checkpoint_as_json_or_yaml_prints_the_final_object(fmt: str) -> None:
    def load(text: str) -> Any:
        return json.loads(text) if fmt == "json" else yaml.safe_load(text)

    done = checkpoint_at("Succeeded", "12", location="/c", totalTokens=5)
    api = FakeApi(
        ready("w"), events=[("MODIFIED", checkpoint_at("Running", "11")), ("MODIFIED", done)]
    )
    code, out, err = run(api, "checkpoint", "w", "-o", fmt)
    assert code == 0 and load(out) == done
    # The progress people read goes to stderr, beside the document.
    assert err.splitlines()[0] == (
        "WorkerCheckpoint ns/w-manual-abcde created for worker w (reason Manual)"
    )
    assert err.splitlines()[-1] == "location: /c"
    assert [line.split()[-1] for line in err.splitlines()[1:4]] == [
        "Pending",
        "Running",
        "Succeeded",
    ]

    failed = checkpoint_at("Failed", "11", error="driver none cannot save")
    code, out, err = run(
        FakeApi(ready("w"), events=[("MODIFIED", failed)]), "checkpoint", "w", "-o", fmt
    )
    assert code == 1 and load(out) == failed and "failed: driver none cannot save" in err

    running = checkpoint_at("Running", "11")
    stuck = FakeApi(ready("w"), events=[("MODIFIED", running)])
    code, out, err = run(stuck, "checkpoint", "w", "--timeout", "1s", "-o", fmt)
    assert code == 1 and load(out) == running and "timed out after 1s" in err

    nowait = FakeApi(ready("w"))
    code, out, err = run(nowait, "checkpoint", "w", "--no-wait", "-o", fmt)
    assert code == 0 and load(out) == nowait.created[0]
    assert load(out)["spec"] == {"worker": "w", "reason": "Manual", "sessions": []}
    assert err.count("\n") == 1


# --- the kubeconfig's namespace -------------------------------------------------------


def kubeconfig(tmp_path: Path, contexts: dict[str, str | None], current: str) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "c",
                "cluster": {"server": "https://127.0.0.1:6443", "insecure-skip-tls-verify": True},
            }
        ],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [
            {
                "name": name,
                "context": {"cluster": "c", "user": "u", **({"namespace": ns} if ns else {})},
            }
            for name, ns in contexts.items()
        ],
        "current-context": current,
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return path


def test_the_kubeconfig_context_names_the_namespace(tmp_path: Path) -> None:
    path = str(kubeconfig(tmp_path, {"dev": "agents", "bare": None}, "dev"))
    assert KubeConfig.from_kubeconfig(path).namespace == "agents"
    assert KubeConfig.load(path, "bare").namespace is None
    assert KubeConfig.load(path, "dev").server == "https://127.0.0.1:6443"


def test_the_plugin_reads_the_namespace_from_the_kubeconfig(tmp_path: Path) -> None:
    path = str(kubeconfig(tmp_path, {"dev": "agents"}, "dev"))
    args = cli.build_parser().parse_args(["--kubeconfig", path, "status"])
    connection = cli.connect(args)
    try:
        assert connection.namespace == "agents"
        assert isinstance(connection.api, cli.Kube)
        assert connection.api.field_manager == "kubectl-sessionfleet"
    finally:
        asyncio.run(connection.api.aclose())


def test_the_worker_model_round_trips_for_previews() -> None:
    # The preview parses the worker the API server returned; a parse failure is a message.
    bad = ready("w")
    bad["spec"]["gpus"] = 99
    assert not parse(InferenceWorker, bad).ok
    code, _, err = run(FakeApi(bad), "drain", "w")
    assert code == 1 and err.startswith('error: InferenceWorker "w" cannot be read: spec.gpus')
