"""The operator's Kubernetes Events, against the real API server and a real operator.

What a person sees in ``kubectl describe``: binds coalesced on the worker, a drain
started, held and completed, a checkpoint taken, a missing policy warned about.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from e2e.helpers import Kubectl
from e2e.localcluster import LocalCluster
from e2e.operator import (
    Custom,
    OperatorProcess,
    drain_policy,
    ready_workers,
    session,
    sim_worker,
    wait_for,
)

pytestmark = pytest.mark.timeout(180)

SESSIONS = 500


@pytest.fixture
def fast_series(cluster: LocalCluster, namespace: str, crds_installed: None, tmp_path: Path) -> Any:
    """An operator that writes a repeated Event's count every second (30 s by default)."""
    process = OperatorProcess(cluster.kubeconfig, namespace, tmp_path, "--event-series-interval=1")
    process.start()
    yield process
    process.stop()


def events_about(api: Any, namespace: str, name: str) -> list[Any]:
    listed = client.EventsV1Api(api).list_namespaced_event(namespace)
    return [e for e in listed.items if e.regarding and e.regarding.name == name]


def by_reason(events: list[Any]) -> dict[str, list[Any]]:
    found: dict[str, list[Any]] = {}
    for event in events:
        found.setdefault(event.reason, []).append(event)
    return found


def test_binds_coalesce_into_one_event_and_a_drain_tells_its_story(
    fast_series: OperatorProcess,
    crs: Custom,
    api: Any,
    namespace: str,
    kubectl: Kubectl,
) -> None:
    crs.create(drain_policy("wait", mode="Wait", deadline="10m"))
    crs.create(sim_worker("w", capacity={"maxSessions": 1000}))
    ready_workers(crs, 1, fast_series)
    # A burst: one request creates them all.
    burst = {
        "apiVersion": "v1",
        "kind": "List",
        "items": [session(f"s{i}") for i in range(SESSIONS)],
    }
    kubectl("create", f"--namespace={namespace}", "-f", "-", input=json.dumps(burst))
    wait_for(
        fast_series,
        crs.all_in_phase("agentsessions", "Bound", SESSIONS),
        timeout=120,
        what="sessions bound",
    )

    def bound_event() -> Any:
        (event,) = by_reason(events_about(api, namespace, "w")).get("SessionsBound", [None])
        return event if event is not None and (event.series and event.series.count) else None

    # One Event for the burst, whose series counts every bind.
    event = wait_for(fast_series, bound_event, timeout=30, what="the SessionsBound series")
    wait_for(
        fast_series,
        lambda: bound_event().series.count == SESSIONS,
        timeout=30,
        what=f"a series count of {SESSIONS}",
    )
    assert event.type == "Normal"
    assert event.reporting_controller == "sessionfleet.dev/operator"
    assert event.regarding.uid == crs.get("inferenceworkers", "w")["metadata"]["uid"]

    crs.patch("inferenceworkers", "w", {"spec": {"drain": True}})
    wait_for(
        fast_series,
        lambda: {"DrainStarted", "DrainHeld"} <= set(by_reason(events_about(api, namespace, "w"))),
        timeout=30,
        what="DrainStarted and DrainHeld",
    )
    held = by_reason(events_about(api, namespace, "w"))["DrainHeld"][0]
    assert held.note.startswith(f"{SESSIONS} session(s) pinned"), held.note
    finish = {
        "apiVersion": "v1",
        "kind": "List",
        "items": [session(f"s{i}", finished=True) for i in range(SESSIONS)],
    }
    kubectl("apply", f"--namespace={namespace}", "-f", "-", input=json.dumps(finish))
    wait_for(
        fast_series,
        lambda: "DrainCompleted" in by_reason(events_about(api, namespace, "w")),
        timeout=60,
        what="DrainCompleted",
    )

    # 500 binds and a drain: a bounded number of Events about the worker, not 500.
    events = events_about(api, namespace, "w")
    reasons = [e.reason for e in events]
    assert len(reasons) == len(set(reasons)) <= 6, reasons
    # Each part of the drain was told once, though the operator looked at the worker on
    # every pass while it ran: a repeat would have been written back as a series.
    for event in events:
        if event.reason.startswith("Drain"):
            assert event.series is None, (event.reason, event.series)
    # kubectl describe finds them: they name the worker by its uid.
    described = kubectl("describe", "inferenceworker", "w", f"--namespace={namespace}").stdout
    for reason in ("SessionsBound", "DrainStarted", "DrainHeld", "DrainCompleted"):
        assert reason in described, described


def test_a_missing_policy_is_a_warning_and_a_checkpoint_is_an_event_on_it(
    operator: OperatorProcess,
    crs: Custom,
    api: Any,
    namespace: str,
    tmp_path: Path,
    kubectl: Kubectl,
) -> None:
    crs.create(
        sim_worker(
            "w",
            drainPolicyRef="nowhere",
            checkpoint={"driver": "engine", "storage": {"path": str(tmp_path)}},
        )
    )
    ready_workers(crs, 1, operator)
    warning = wait_for(
        operator,
        lambda: by_reason(events_about(api, namespace, "w")).get("PolicyNotFound"),
        timeout=30,
        what="a PolicyNotFound Event",
    )[0]
    assert warning.type == "Warning" and "nowhere" in warning.note

    crs.create(
        {
            "apiVersion": "sessionfleet.dev/v1alpha1",
            "kind": "WorkerCheckpoint",
            "metadata": {"name": "by-hand"},
            "spec": {"worker": "w"},
        }
    )
    taken = wait_for(
        operator,
        lambda: by_reason(events_about(api, namespace, "by-hand")).get("CheckpointTaken"),
        timeout=60,
        what="a CheckpointTaken Event",
    )[0]
    assert "worker w saved to" in taken.note
    described = kubectl("describe", "workercheckpoint", "by-hand", f"--namespace={namespace}")
    assert "CheckpointTaken" in described.stdout


def test_a_recovery_is_an_epoch_replaced_with_its_reason(
    operator: OperatorProcess, crs: Custom, core: Any, api: Any, namespace: str
) -> None:
    crs.create(sim_worker("w"))
    ready_workers(crs, 1, operator)
    core.delete_namespaced_pod("w-1", namespace, grace_period_seconds=0)
    replaced = wait_for(
        operator,
        lambda: by_reason(events_about(api, namespace, "w")).get("EpochReplaced"),
        timeout=60,
        what="an EpochReplaced Event",
    )[0]
    assert replaced.note == "epoch 2 replaces epoch 1: PodDeleted", replaced.note
    assert replaced.regarding.kind == "InferenceWorker"
    ready_workers(crs, 1, operator)
