"""Drain triggers, policy resolution and the drain step decision."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from sessionfleet.api import DrainPolicySpec, HoldMechanism, Reason
from sessionfleet.api.drainpolicy import DrainTriggers
from sessionfleet.policy.drain import (
    DEFAULT_POLICY,
    PinnedSession,
    decide_drain,
    drain_trigger,
    holds_while_pinned,
    resolve_policy,
)
from sessionfleet.policy.observed import NodeState

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def policy(**spec: object) -> DrainPolicySpec:
    return DrainPolicySpec.model_validate(spec)


@pytest.mark.parametrize(
    ("worker_drain", "node", "triggers", "expected"),
    [
        (False, None, {}, None),
        (True, None, {}, Reason.DRAIN_REQUESTED),
        (True, None, {"workerDrain": False}, None),
        (False, NodeState("n", unschedulable=True), {}, Reason.NODE_CORDONED),
        (False, NodeState("n", unschedulable=True), {"nodeCordon": False}, None),
        (
            False,
            NodeState("n", taint_keys=frozenset({"karpenter.sh/disrupted"})),
            {},
            Reason.DISRUPTION_TAINT,
        ),
        (
            False,
            NodeState("n", taint_keys=frozenset({"ToBeDeletedByClusterAutoscaler"})),
            {},
            Reason.DISRUPTION_TAINT,
        ),
        (False, NodeState("n", taint_keys=frozenset({"other"})), {}, None),
        (
            False,
            NodeState("n", taint_keys=frozenset({"custom/spot"})),
            {"taints": ["custom/spot"]},
            Reason.DISRUPTION_TAINT,
        ),
        (False, NodeState("n"), {}, None),
    ],
)
def test_drain_trigger(
    worker_drain: bool, node: NodeState | None, triggers: dict[str, object], expected: Reason | None
) -> None:
    assert drain_trigger(worker_drain, node, DrainTriggers.model_validate(triggers)) is expected


POOL_A = policy(selector={"matchLabels": {"pool": "a"}}, mode="Wait")
POOL_B = policy(selector={"matchLabels": {"pool": "b"}}, mode="Migrate")
EVERYTHING = policy(mode="Migrate")


@pytest.mark.parametrize(
    ("labels", "ref", "policies", "name", "reason"),
    [
        ({"pool": "a"}, None, {"a": POOL_A, "b": POOL_B}, "a", None),
        ({"pool": "c"}, None, {"a": POOL_A, "b": POOL_B}, None, None),
        ({"pool": "a"}, "b", {"a": POOL_A, "b": POOL_B}, "b", None),
        ({"pool": "a"}, "zz", {"a": POOL_A}, None, Reason.POLICY_NOT_FOUND),
        ({"pool": "a"}, None, {"a": POOL_A, "all": EVERYTHING}, None, Reason.POLICY_CONFLICT),
        ({}, None, {}, None, None),
    ],
)
def test_resolve_policy(
    labels: dict[str, str],
    ref: str | None,
    policies: dict[str, DrainPolicySpec],
    name: str | None,
    reason: Reason | None,
) -> None:
    choice = resolve_policy(labels, ref, policies)
    assert (choice.name, choice.reason) == (name, reason)
    if name is None:
        assert choice.spec == DEFAULT_POLICY
    if reason is Reason.POLICY_CONFLICT:
        assert "a, all" in choice.message


def test_a_reference_to_an_invalid_policy_says_it_is_invalid_not_missing() -> None:
    problem = "spec: gracePeriod must not be longer than deadline"
    choice = resolve_policy({"pool": "a"}, "broken", {"a": POOL_A}, {"broken": problem})
    assert (choice.name, choice.reason, choice.spec) == (
        None,
        Reason.POLICY_INVALID,
        DEFAULT_POLICY,
    )
    assert choice.message == (
        f"DrainPolicy broken is invalid: {problem}; using the built-in default"
    )
    # Without the invalid ones, the same reference reads as missing.
    assert resolve_policy({}, "broken", {"a": POOL_A}).reason is Reason.POLICY_NOT_FOUND
    # An invalid policy selects nothing: the valid one alone governs the worker.
    assert resolve_policy({"pool": "a"}, None, {"a": POOL_A}, {"b": problem}).name == "a"


def test_a_conflict_names_the_policies() -> None:
    choice = resolve_policy({"pool": "a"}, None, {"a": POOL_A, "all": EVERYTHING})
    assert choice.conflicting == ("a", "all")


def test_default_policy_fits_eks() -> None:
    assert DEFAULT_POLICY.mode.value == "WaitThenMigrate"
    assert DEFAULT_POLICY.deadline == "10m" and DEFAULT_POLICY.grace_period == "2m"


PINNED = [PinnedSession("s1"), PinnedSession("s2")]


@pytest.mark.parametrize(
    ("spec", "elapsed_s", "pinned", "hold", "migrate", "done", "released", "reason"),
    [
        # nothing pinned: done at once, whatever the mode
        ({"mode": "Wait"}, 0, [], False, (), True, False, Reason.DRAINED),
        # Wait holds until the deadline
        (
            {"mode": "Wait", "deadline": "10m"},
            300,
            PINNED,
            True,
            (),
            False,
            False,
            Reason.SESSIONS_PINNED,
        ),
        # ... then releases
        (
            {"mode": "Wait", "deadline": "10m"},
            600,
            PINNED,
            False,
            (),
            False,
            True,
            Reason.DEADLINE_REACHED,
        ),
        # ... or keeps holding when the policy says Hold
        (
            {"mode": "Wait", "deadline": "10m", "onDeadline": "Hold"},
            900,
            PINNED,
            True,
            (),
            False,
            False,
            Reason.DEADLINE_REACHED,
        ),
        # Migrate names every pinned session at once (each moves at its turn boundary:
        # policy.migration's handshake)
        ({"mode": "Migrate"}, 0, PINNED, True, ("s1", "s2"), False, False, Reason.MIGRATING),
        # WaitThenMigrate waits for the grace period ...
        (
            {"mode": "WaitThenMigrate", "gracePeriod": "2m"},
            119,
            PINNED,
            True,
            (),
            False,
            False,
            Reason.SESSIONS_PINNED,
        ),
        # ... then migrates
        (
            {"mode": "WaitThenMigrate", "gracePeriod": "2m"},
            120,
            PINNED,
            True,
            ("s1", "s2"),
            False,
            False,
            Reason.GRACE_PERIOD_EXPIRED,
        ),
    ],
)
def test_decide_drain(
    spec: dict[str, object],
    elapsed_s: int,
    pinned: list[PinnedSession],
    hold: bool,
    migrate: tuple[str, ...],
    done: bool,
    released: bool,
    reason: Reason,
) -> None:
    decision = decide_drain(policy(**spec), T0, T0 + timedelta(seconds=elapsed_s), pinned)
    assert (decision.hold, decision.migrate, decision.done, decision.released, decision.reason) == (
        hold,
        migrate,
        done,
        released,
        reason,
    ), decision.message
    if hold:
        assert decision.holds == frozenset(HoldMechanism)


def test_wait_rechecks_at_the_deadline_and_grace() -> None:
    wait = decide_drain(policy(mode="Wait", deadline="10m"), T0, T0 + timedelta(minutes=4), PINNED)
    assert wait.recheck_after == pytest.approx(360)
    grace = decide_drain(
        policy(mode="WaitThenMigrate", gracePeriod="2m"), T0, T0 + timedelta(seconds=30), PINNED
    )
    assert grace.recheck_after == pytest.approx(90)


def test_holds_while_pinned_follow_the_policy() -> None:
    only_pdb = policy(holds=["PodDisruptionBudget"])
    assert holds_while_pinned(only_pdb, 3) == {HoldMechanism.POD_DISRUPTION_BUDGET}
    assert holds_while_pinned(only_pdb, 0) == frozenset()
