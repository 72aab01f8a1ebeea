"""The controllers' pure parts: records, status patches, conditions, engine metrics."""

from __future__ import annotations

from datetime import UTC, datetime

from sessionfleet.api import ConditionStatus, ConditionType, Reason, SessionPhase
from sessionfleet.controllers.fleet import Freshness
from sessionfleet.controllers.loop import parse_engine_metrics
from sessionfleet.controllers.records import session_record, worker_record
from sessionfleet.controllers.status import status_patch
from sessionfleet.policy.worker import ConditionPlan
from sessionfleet.resources.status import merge_conditions

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def test_status_patch_carries_only_changes_and_deletions() -> None:
    current = {"phase": "Ready", "epoch": 1, "node": "n1", "pinnedSessions": 3}
    desired = {"phase": "Ready", "epoch": 2, "node": None, "pinnedSessions": 3, "pod": None}
    assert status_patch(current, desired) == {"epoch": 2, "node": None}


def test_conditions_keep_their_transition_time_when_status_holds() -> None:
    old = [
        {
            "type": "Ready",
            "status": "True",
            "reason": "PodReady",
            "message": "",
            "lastTransitionTime": "2026-11-29T11:00:00Z",
        }
    ]
    same = ConditionPlan(ConditionType.READY, ConditionStatus.TRUE, Reason.POD_READY, "")
    merged = merge_conditions(old, [same], NOW)
    assert merged[0]["lastTransitionTime"] == "2026-11-29T11:00:00Z"
    assert status_patch({"conditions": old}, {"conditions": merged}) == {}
    flipped = ConditionPlan(ConditionType.READY, ConditionStatus.FALSE, Reason.POD_FAILED, "x")
    merged = merge_conditions(old, [flipped], NOW)
    assert merged[0]["lastTransitionTime"] == "2026-11-29T12:00:00Z"
    assert "conditions" in status_patch({"conditions": old}, {"conditions": merged})


def test_freshness_waits_for_the_watch_to_catch_up() -> None:
    fresh = Freshness()
    fresh.mark(("ns", "a"), {"metadata": {"resourceVersion": "120"}})
    assert fresh.is_stale(("ns", "a"), 119)
    assert not fresh.is_stale(("ns", "a"), 120)
    assert not fresh.is_stale(("ns", "a"), 1)  # forgotten once caught up


def test_session_record_from_a_body() -> None:
    body = {
        "apiVersion": "sessionfleet.dev/v1alpha1",
        "kind": "AgentSession",
        "metadata": {
            "name": "s",
            "namespace": "ns",
            "generation": 2,
            "resourceVersion": "77",
            "creationTimestamp": "2026-11-29T11:59:00Z",
        },
        "spec": {"sessionId": "sid", "model": "m", "workerHint": "w"},
        "status": {"phase": "Bound", "worker": "w", "promptTokens": 9000, "turns": 3},
    }
    state = session_record(body)
    assert (state.phase, state.worker, state.hint, state.resource_version) == (
        SessionPhase.BOUND,
        "w",
        "w",
        77,
    )
    assert state.context_tokens == 3000 and state.invalid is None


def test_invalid_bodies_keep_their_reason() -> None:
    session = session_record(
        {"metadata": {"name": "s", "namespace": "ns"}, "spec": {"sessionId": "x"}}
    )
    assert session.invalid is not None and "spec.model" in session.invalid
    worker = worker_record(
        {"metadata": {"name": "w", "namespace": "ns"}, "spec": {"model": "m", "gpus": -1}}
    )
    assert worker.worker is None and worker.invalid is not None and "spec.gpus" in worker.invalid


def test_engine_metrics_use_current_vllm_names() -> None:
    text = """# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.42
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{model_name="m"} 1000.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{model_name="m"} 940.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 1.0
"""
    stats = parse_engine_metrics(text)
    assert stats.kv_usage == 0.42 and stats.running == 3 and stats.waiting == 1
    assert stats.prefix_hits == 940.0 and stats.prefix_queries == 1000.0


def test_engine_metrics_are_read_from_a_whole_vllm_page_with_two_engines() -> None:
    """A page as vLLM's prometheus_client renders it: HELP, TYPE, histograms, ``_created``
    lines, label values with spaces and braces, and names that begin like the ones read."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    models = [('org/m {x} "q"', "0"), ('org/m {x} "q"', "1")]
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        histogram = Histogram(name, "latency", labels, registry=registry)
        for model in models:
            histogram.labels(*model).observe(0.25)
    figures = {
        "vllm:num_requests_running": (Gauge, 2.0),
        "vllm:num_requests_waiting": (Gauge, 1.0),
        "vllm:num_requests_waiting_by_reason": (Gauge, 50.0),  # not waiting's figure
        "vllm:kv_cache_usage_perc": (Gauge, 0.25),
        "vllm:prefix_cache_queries": (Counter, 500.0),
        "vllm:prefix_cache_hits": (Counter, 400.0),
        "vllm:external_prefix_cache_hits": (Counter, 999.0),
    }
    for name, (kind, value) in figures.items():
        metric = kind(name, "figure", labels, registry=registry)
        for model in models:
            if kind is Gauge:
                metric.labels(*model).set(value)
            else:
                metric.labels(*model).inc(value)
    page = generate_latest(registry).decode()
    assert page.count("\n") > 60 and "_created" in page

    stats = parse_engine_metrics(page)
    # Both engines' counts add up, their KV caches' usage is the mean; look-alike names
    # are not read.
    assert (stats.running, stats.waiting) == (4, 2)
    assert (stats.prefix_queries, stats.prefix_hits) == (1000.0, 800.0)
    assert stats.kv_usage == 0.25 and stats.ignored == ()


def test_deprecated_metric_names_alone_give_no_figures() -> None:
    stats = parse_engine_metrics("vllm:gpu_cache_usage_perc 0.5\n")
    assert stats.kv_usage is None


def test_non_finite_engine_metrics_are_ignored_and_named() -> None:
    text = """vllm:kv_cache_usage_perc{model_name="m"} NaN
vllm:num_requests_running{model_name="m"} +Inf
vllm:num_requests_waiting{model_name="m"} 2.0
vllm:prefix_cache_hits_total{model_name="m"} -Inf
vllm:prefix_cache_queries_total{model_name="m"} 10.0
"""
    stats = parse_engine_metrics(text)
    assert stats.kv_usage is None and stats.running is None and stats.prefix_hits is None
    assert stats.waiting == 2 and stats.prefix_queries == 10.0
    assert stats.ignored == (
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:prefix_cache_hits_total",
    )
    # Out-of-range usage is clamped: a status percentage stays within 0-100.
    assert parse_engine_metrics("vllm:kv_cache_usage_perc 7.5\n").kv_usage == 1.0


async def test_one_failing_job_is_recorded_and_stops_no_other() -> None:
    from datetime import UTC, datetime

    from sessionfleet.controllers.faults import Faults, Job, run_isolated
    from sessionfleet.kube import SESSIONS, WORKERS, Conflict

    faults = Faults()
    recorded: list[tuple[str, str]] = []
    ran: list[str] = []

    async def record(job: Job, message: str, _now: datetime) -> None:
        recorded.append((job.key[1], message))

    async def breaks() -> None:
        raise ValueError("cannot convert float NaN to integer")

    async def conflicts() -> None:
        raise Conflict(409, "the object has been modified")

    async def works() -> None:
        ran.append("fine")

    now = datetime.now(UTC)
    for job in (
        Job(WORKERS, ("ns", "nan-worker"), breaks),
        Job(WORKERS, ("ns", "racing"), conflicts),
        Job(SESSIONS, ("ns", "fine"), works),
    ):
        await run_isolated(job, faults, record, now)
    assert ran == ["fine"]
    assert recorded == [("nan-worker", "ValueError: cannot convert float NaN to integer")]
    assert faults.of(WORKERS, ("ns", "nan-worker")) == recorded[0][1]
    assert faults.of(WORKERS, ("ns", "racing")) is None  # a 409 is not a fault
    # Logged once while the same failure repeats; cleared by a clean run.
    assert faults.failed(WORKERS, ("ns", "nan-worker"), recorded[0][1]) is False
    await run_isolated(Job(WORKERS, ("ns", "nan-worker"), works), faults, record, now)
    assert faults.of(WORKERS, ("ns", "nan-worker")) is None


def test_fault_messages_are_one_bounded_line() -> None:
    from sessionfleet.controllers.faults import MAX_MESSAGE_CHARS, describe, with_condition
    from sessionfleet.controllers.faults import reconciled_condition as reconciled

    assert describe(RuntimeError("a\nb")) == "RuntimeError: a b"
    assert len(describe(RuntimeError("x" * 5000))) == MAX_MESSAGE_CHARS
    from datetime import UTC, datetime

    now = datetime.now(UTC)
    existing = [{"type": "Ready", "status": "True"}, {"type": "Reconciled", "status": "True"}]
    merged = with_condition(existing, reconciled("RuntimeError: boom"), now)
    assert [(c["type"], c["status"]) for c in merged] == [
        ("Ready", "True"),
        ("Reconciled", "False"),
    ]


def test_engine_figures_out_of_range_are_clamped() -> None:
    text = """vllm:num_requests_running -3
vllm:num_requests_waiting -1
vllm:prefix_cache_hits_total -5
vllm:prefix_cache_queries_total 10
"""
    stats = parse_engine_metrics(text)
    assert (stats.running, stats.waiting, stats.prefix_hits) == (0, 0, 0.0)
