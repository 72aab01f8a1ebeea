"""DrainPolicy status: the pure plan of every policy's status, and the writes of it."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest

from sessionfleet.api import ConditionStatus, ConditionType, DrainPolicy, DrainPolicySpec, Reason
from sessionfleet.api.drainpolicy import MAX_LISTED_WORKERS
from sessionfleet.controllers.config import OperatorConfig
from sessionfleet.controllers.fleet import Fleet
from sessionfleet.controllers.policies import desired_status, reconcile_policies
from sessionfleet.controllers.records import PolicyRecord, policy_record, worker_record
from sessionfleet.kube import DRAIN_POLICIES, Invalid, NotFound, Resource
from sessionfleet.policy.policies import (
    PolicyStatusPlan,
    WorkerView,
    named,
    plan_policy_statuses,
)

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def spec(**fields: object) -> DrainPolicySpec:
    return DrainPolicySpec.model_validate(fields)


POOL_A = spec(selector={"matchLabels": {"pool": "a"}}, mode="Wait")
POOL_B = spec(selector={"matchLabels": {"pool": "b"}})
EVERYTHING = spec()
A = WorkerView("wa", {"pool": "a"})
A_DRAINING = WorkerView("wa2", {"pool": "a"}, draining=True)
B = WorkerView("wb", {"pool": "b"})
C = WorkerView("wc", {"pool": "c"})


def summary(plan: PolicyStatusPlan) -> tuple[tuple[str, ...], int, dict[str, tuple[str, str]]]:
    """(matched, active drains, {condition type: (status, reason)})."""
    return (
        plan.matched,
        plan.active_drains,
        {c.type.value: (c.status.value, c.reason.value) for c in plan.conditions},
    )


VALID = {"Valid": ("True", "Parsed")}
CONFLICT = {**VALID, "Conflict": ("True", "PolicyConflict")}
INVALID = {"Valid": ("False", "InvalidSpec")}


@pytest.mark.parametrize(
    ("policies", "invalid", "workers", "expected"),
    [
        pytest.param({}, {}, [A, B], {}, id="no policy, no status"),
        pytest.param(
            {"a": POOL_A, "b": POOL_B},
            {},
            [A, A_DRAINING, B, C],
            {"a": (("wa", "wa2"), 1, VALID), "b": (("wb",), 0, VALID)},
            id="selectors split the workers; drains counted",
        ),
        pytest.param(
            {"a": POOL_A}, {}, [C], {"a": ((), 0, VALID)}, id="a policy that selects nothing"
        ),
        pytest.param(
            {"a": POOL_A, "b": POOL_B},
            {},
            [WorkerView("wa", {"pool": "a"}, reference="b"), B],
            {"a": ((), 0, VALID), "b": (("wa", "wb"), 0, VALID)},
            id="a reference wins over a selector",
        ),
        pytest.param(
            {"a": POOL_A, "all": EVERYTHING},
            {},
            [A, B],
            {"a": ((), 0, CONFLICT), "all": (("wb",), 0, CONFLICT)},
            id="two selectors on one worker: it counts for neither, both say so",
        ),
        pytest.param(
            {"a": POOL_A, "all": EVERYTHING},
            {},
            [WorkerView("wa", {"pool": "a"}, reference="a"), B],
            {"a": (("wa",), 0, VALID), "all": (("wb",), 0, VALID)},
            id="a reference settles the overlap",
        ),
        pytest.param(
            {"a": POOL_A},
            {"broken": "spec.deadline: too long"},
            [A, WorkerView("wx", {}, reference="broken")],
            {"a": (("wa",), 0, VALID), "broken": ((), 0, INVALID)},
            id="an invalid policy governs nothing and says why",
        ),
        pytest.param(
            {},
            {},
            [WorkerView("wx", {}, reference="missing")],
            {},
            id="a reference to a missing policy writes no policy's status",
        ),
    ],
)
def test_plan_policy_statuses(
    policies: dict[str, DrainPolicySpec],
    invalid: dict[str, str],
    workers: list[WorkerView],
    expected: dict[str, tuple[tuple[str, ...], int, dict[str, tuple[str, str]]]],
) -> None:
    plans = plan_policy_statuses(policies, workers, invalid)
    assert {name: summary(plan) for name, plan in plans.items()} == expected


def test_conflict_and_invalid_messages_name_the_workers() -> None:
    plans = plan_policy_statuses(
        {"a": POOL_A, "all": EVERYTHING, "also": EVERYTHING},
        [A, WorkerView("wx", {}, reference="broken"), WorkerView("wy", {}, reference="broken")],
        {"broken": "spec: gracePeriod must not be longer than deadline"},
    )
    (conflict,) = [c for c in plans["a"].conditions if c.type is ConditionType.CONFLICT]
    assert conflict.message.startswith("DrainPolicies all, also also select worker(s) wa:")
    assert "spec.drainPolicyRef" in conflict.message
    (valid,) = plans["broken"].conditions
    assert (valid.status, valid.reason) == (ConditionStatus.FALSE, Reason.INVALID_SPEC)
    assert valid.message == (
        "spec: gracePeriod must not be longer than deadline; worker(s) wx, wy reference it "
        "and drain under the built-in default meanwhile"
    )


def test_the_listed_names_are_bounded_and_the_count_is_not() -> None:
    workers = [WorkerView(f"w{i:03d}", {"pool": "a"}) for i in range(MAX_LISTED_WORKERS + 20)]
    plan = plan_policy_statuses({"a": POOL_A}, reversed(workers))["a"]
    assert len(plan.matched) == MAX_LISTED_WORKERS + 20
    assert plan.listed == tuple(w.name for w in workers[:MAX_LISTED_WORKERS])
    assert (
        named([f"w{i}" for i in range(12)]) == "w0, w1, w2, w3, w4, w5, w6, w7, w8, w9 and 2 more"
    )


def test_the_desired_status_is_what_the_model_accepts() -> None:
    record = PolicyRecord("a", POOL_A, namespace="ns", generation=3)
    plan = plan_policy_statuses({"a": POOL_A}, [A, A_DRAINING])["a"]
    status = desired_status(record, plan, NOW)
    assert {k: status[k] for k in ("observedGeneration", "matchedWorkers", "activeDrains")} == {
        "observedGeneration": 3,
        "matchedWorkers": 2,
        "activeDrains": 1,
    }
    assert status["workers"] == ["wa", "wa2"]
    assert [(c["type"], c["observedGeneration"]) for c in status["conditions"]] == [("Valid", 3)]
    body = {"metadata": {"name": "a", "namespace": "ns"}, "spec": {}, "status": status}
    assert DrainPolicy.model_validate(body).status.matched_workers == 2
    empty = desired_status(record, plan_policy_statuses({"a": POOL_A}, [])["a"], NOW)
    assert empty["workers"] is None and empty["matchedWorkers"] == 0  # the list is omitted


# --- the controller ----------------------------------------------------------------------


class FakeKube:
    """Records status patches; answers each with a resourceVersion, or raises."""

    def __init__(self, fail: dict[str, Exception] | None = None) -> None:
        self.patches: list[tuple[str, dict[str, Any]]] = []
        self.preconditions: list[int | str | None] = []
        self.fail = fail or {}
        self.version = 100

    async def patch(
        self,
        resource: Resource,
        name: str,
        body: dict[str, Any],
        namespace: str | None = None,
        *,
        status: bool = False,
        resource_version: int | str | None = None,
    ) -> dict[str, Any]:
        assert resource is DRAIN_POLICIES and status
        self.patches.append((name, body["status"]))
        self.preconditions.append(resource_version)
        if name in self.fail:
            raise self.fail[name]
        self.version += 1
        return {"metadata": {"resourceVersion": str(self.version)}}


def policy_body(name: str, spec: dict[str, Any], **status: Any) -> dict[str, Any]:
    return {
        "apiVersion": "sessionfleet.dev/v1alpha1",
        "kind": "DrainPolicy",
        "metadata": {"name": name, "namespace": "ns", "generation": 1, "resourceVersion": "10"},
        "spec": spec,
        "status": status,
    }


def worker_body(name: str, labels: dict[str, str], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "sessionfleet.dev/v1alpha1",
        "kind": "InferenceWorker",
        "metadata": {"name": name, "namespace": "ns", "labels": labels, "resourceVersion": "5"},
        "spec": {"model": "m", "engine": {"type": "sim"}, **spec},
    }


def fleet_of(
    kube: FakeKube, policies: list[dict[str, Any]], workers: list[dict[str, Any]]
) -> Fleet:
    fleet = Fleet(config=OperatorConfig(), kube=kube, http=None)  # type: ignore[arg-type]
    fleet.indexes.policies = {"ns": [policy_record(p) for p in policies]}  # type: ignore[assignment]
    fleet.indexes.workers = {  # type: ignore[assignment]
        ("ns", w["metadata"]["name"]): [worker_record(w)] for w in workers
    }
    return fleet


async def test_reconcile_writes_each_policy_once_and_only_what_changed() -> None:
    kube = FakeKube()
    workers = [worker_body("wa", {"pool": "a"}), worker_body("wb", {"pool": "b"})]
    policies = [
        policy_body("a", {"selector": {"matchLabels": {"pool": "a"}}}),
        policy_body("late", {"selector": {"matchLabels": {"pool": "b"}}}),
    ]
    fleet = fleet_of(kube, policies, workers)
    await reconcile_policies(fleet, NOW)
    written = dict(kube.patches)
    assert written["a"]["matchedWorkers"] == 1 and written["a"]["workers"] == ["wa"]
    assert written["late"]["workers"] == ["wb"] and written["a"]["observedGeneration"] == 1
    # Each write applies only to the copy it was decided from (fencing a stale replica).
    assert kube.preconditions == [10, 10]

    # The index still shows the old copies: nothing is written again meanwhile.
    kube.patches.clear()
    await reconcile_policies(fleet, NOW)
    assert kube.patches == []

    # The watch brings the written status back: nothing differs, nothing is written.
    fleet.indexes.policies = {  # type: ignore[assignment]
        "ns": [
            replace(
                policy_record(body),
                resource_version=200,
                raw_status=written[body["metadata"]["name"]],
            )
            for body in policies
        ]
    }
    await reconcile_policies(fleet, NOW)
    assert kube.patches == []

    # A new worker joins pool a: only policy a's count and list change.
    fleet.indexes.workers[("ns", "wa2")] = [worker_record(worker_body("wa2", {"pool": "a"}))]  # type: ignore[index]
    await reconcile_policies(fleet, NOW)
    assert kube.patches == [("a", {"matchedWorkers": 2, "workers": ["wa", "wa2"]})]
    assert kube.preconditions[-1] == 200


async def test_an_invalid_policy_is_reported_and_a_failed_write_stops_no_other() -> None:
    # The write of a's status fails, and so does the record of that failure.
    kube = FakeKube(fail={"a": Invalid(422, "status.workers: Too many")})
    policies = [
        policy_body("a", {}),
        policy_body("broken", {"gracePeriod": "30m", "deadline": "10m"}),
    ]
    workers = [worker_body("wx", {}, drainPolicyRef="broken")]
    fleet = fleet_of(kube, policies, workers)
    await reconcile_policies(fleet, NOW)
    written = {name: status for name, status in kube.patches if name == "broken"}
    (valid,) = written["broken"]["conditions"]
    assert (valid["type"], valid["status"], valid["reason"]) == ("Valid", "False", "InvalidSpec")
    assert "gracePeriod must not be longer than deadline" in valid["message"]
    assert "worker(s) wx reference it" in valid["message"]
    assert written["broken"]["matchedWorkers"] == 0
    assert fleet.faults.of(DRAIN_POLICIES, ("ns", "a")) == "Invalid: 422: status.workers: Too many"


async def test_a_policy_deleted_meanwhile_is_no_fault() -> None:
    kube = FakeKube(fail={"gone": NotFound(404, "drainpolicies.sessionfleet.dev gone")})
    fleet = fleet_of(kube, [policy_body("gone", {})], [])
    await reconcile_policies(fleet, NOW)
    assert fleet.faults.of(DRAIN_POLICIES, ("ns", "gone")) is None


def test_a_worker_referencing_an_invalid_policy_reads_why_from_its_record() -> None:
    from sessionfleet.policy.drain import resolve_policy

    fleet = fleet_of(
        FakeKube(),
        [
            policy_body("broken", {"gracePeriod": "30m", "deadline": "10m"}),
            policy_body("fine", {}),
        ],
        [],
    )
    # What a worker's observation passes: the parsed specs, and the others' problems.
    parsed, invalid = fleet.indexes.policy_specs("ns")
    assert set(parsed) == {"fine"} and set(invalid) == {"broken"}
    choice = resolve_policy({}, "broken", parsed, invalid)
    assert choice.reason is Reason.POLICY_INVALID
    assert choice.message == (
        "DrainPolicy broken is invalid: spec: gracePeriod must not be longer than deadline; "
        "using the built-in default"
    )
