"""The bodies the router writes, from the pure builders in sessionfleet.resources.

Literal expected dicts: the wire shape is the contract with the API server and with
the other replicas (which read ``firstTurnAt`` back to order first turns).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sessionfleet.api import AgentSessionSpec, SessionClient
from sessionfleet.fronts.identity import Identity
from sessionfleet.fronts.kubesync import new_session
from sessionfleet.fronts.ledger import _EARLIEST, Totals, status_patch
from sessionfleet.resources.leases import (
    LeaseSlots,
    lease_release,
    lease_renewal,
    router_lease,
    slot_claimable,
)
from sessionfleet.resources.sessions import acknowledgement_patch, agent_session, finished_patch
from sessionfleet.resources.times import rfc3339
from sessionfleet.resources.usage import UsageFigures, usage_status_patch

T0 = 1_800_000_000.25  # 2027-01-15T08:00:00.25Z


# --- times -------------------------------------------------------------------------


def test_times_have_fixed_shapes() -> None:
    assert rfc3339(T0) == "2027-01-15T08:00:00Z"  # whole seconds, truncated
    assert rfc3339(T0 + 0.9) == "2027-01-15T08:00:01Z"
    assert rfc3339(T0, micros=True) == "2027-01-15T08:00:00.250000Z"
    assert rfc3339(1_800_000_000, micros=True) == "2027-01-15T08:00:00.000000Z"


# --- the usage status patch ----------------------------------------------------------


def test_usage_status_patch_with_every_field() -> None:
    figures = UsageFigures(
        turns=3,
        prompt_tokens=400,
        cached_tokens=300,
        completion_tokens=7,
        recomputed_tokens=20,
        hit_rate_percent=75.0,
        last_activity=T0,
        first_turn_at=T0 - 10.123456,
        first_turn_uncached_tokens=80,
    )
    assert usage_status_patch(figures, "42") == {
        "metadata": {"resourceVersion": "42"},
        "status": {
            "turns": 3,
            "promptTokens": 400,
            "cachedTokens": 300,
            "completionTokens": 7,
            "recomputedTokens": 20,
            "hitRatePercent": 75.0,
            "lastActivity": "2027-01-15T08:00:00Z",
            "firstTurnAt": "2027-01-15T07:59:50.126544Z",
            "firstTurnUncachedTokens": 80,
        },
    }


def test_usage_status_patch_leaves_out_what_is_unknown() -> None:
    figures = UsageFigures(
        turns=1,
        prompt_tokens=0,
        cached_tokens=0,
        completion_tokens=0,
        recomputed_tokens=0,
        hit_rate_percent=0.0,
        first_turn_uncached_tokens=5,  # ignored without a first turn
    )
    assert usage_status_patch(figures, "1") == {
        "metadata": {"resourceVersion": "1"},
        "status": {
            "turns": 1,
            "promptTokens": 0,
            "cachedTokens": 0,
            "completionTokens": 0,
            "recomputedTokens": 0,
            "hitRatePercent": 0.0,
        },
    }


def test_status_patch_from_the_ledger() -> None:
    observed = Totals(turns=2, prompt_tokens=200, cached_tokens=200, completion_tokens=2)
    observed.first_turn_at = _EARLIEST  # written before first turns were recorded
    delta = Totals(1, 100, 0, 1, last_activity=T0, first_turn_at=T0 - 1, first_turn_uncached=100)
    assert status_patch(observed, delta, "9") == {
        "metadata": {"resourceVersion": "9"},
        "status": {
            "turns": 3,
            "promptTokens": 300,
            "cachedTokens": 200,
            "completionTokens": 3,
            "recomputedTokens": 100,
            "hitRatePercent": 66.67,
            "lastActivity": "2027-01-15T08:00:00Z",
        },
    }
    assert status_patch(Totals(), delta, "1") == {
        "metadata": {"resourceVersion": "1"},
        "status": {
            "turns": 1,
            "promptTokens": 100,
            "cachedTokens": 0,
            "completionTokens": 1,
            "recomputedTokens": 0,
            "hitRatePercent": 0.0,
            "lastActivity": "2027-01-15T08:00:00Z",
            "firstTurnAt": "2027-01-15T07:59:59.250000Z",
            "firstTurnUncachedTokens": 100,
        },
    }


def test_the_hit_rate_is_capped_at_100() -> None:
    observed = Totals(turns=1, prompt_tokens=10, cached_tokens=30)  # a status written by hand
    assert status_patch(observed, Totals(turns=1), "1")["status"]["hitRatePercent"] == 100.0


def _reference_status_patch(observed: Totals, delta: Totals, version: str) -> dict[str, Any]:
    """The hand-typed body the router wrote before the builders: the shape to keep."""
    total = observed.add(delta)
    hit = 100.0 * total.cached_tokens / total.prompt_tokens if total.prompt_tokens else 0.0
    status: dict[str, Any] = {
        "turns": total.turns,
        "promptTokens": total.prompt_tokens,
        "cachedTokens": total.cached_tokens,
        "completionTokens": total.completion_tokens,
        "recomputedTokens": total.recomputed_tokens,
        "hitRatePercent": round(min(hit, 100.0), 2),
    }
    if total.last_activity:
        status["lastActivity"] = rfc3339(total.last_activity)
    if total.first_turn_at > _EARLIEST:
        status["firstTurnAt"] = rfc3339(total.first_turn_at, micros=True)
        status["firstTurnUncachedTokens"] = total.first_turn_uncached
    return {"metadata": {"resourceVersion": version}, "status": status}


counts = st.integers(min_value=0, max_value=10**9)
times = st.one_of(
    st.just(0.0), st.just(_EARLIEST), st.floats(min_value=1.0, max_value=4e9, allow_nan=False)
)
totals = st.builds(Totals, counts, counts, counts, counts, times, times, counts)


@given(totals, totals, st.text(min_size=1, max_size=8))
def test_the_builder_writes_what_the_hand_typed_body_did(
    observed: Totals, delta: Totals, version: str
) -> None:
    got = status_patch(observed, delta, version)
    assert got == _reference_status_patch(observed, delta, version)
    assert type(got["status"]["hitRatePercent"]) is float


# --- the AgentSession and its patches ------------------------------------------------


def test_agent_session_with_an_owner() -> None:
    spec = AgentSessionSpec(
        session_id="abc",
        model="qwen",
        client=SessionClient.CLAUDE_CODE,
        worker_hint="w-1",
    )
    assert agent_session("s-abc", "ns", spec, created_by="r1", owner_label="alice") == {
        "apiVersion": "sessionfleet.dev/v1alpha1",
        "kind": "AgentSession",
        "metadata": {
            "name": "s-abc",
            "namespace": "ns",
            "labels": {"sessionfleet.dev/owner": "alice"},
            "annotations": {"sessionfleet.dev/created-by": "r1"},
        },
        "spec": {
            "sessionId": "abc",
            "model": "qwen",
            "client": "ClaudeCode",
            "workerHint": "w-1",
        },
    }


def test_new_session_of_a_subagent_without_an_owner() -> None:
    identity = Identity("child", "parent", SessionClient.HEADER, final=False, header="X")
    body = new_session(
        "s-child", "ns", identity, "qwen", worker_hint="w-0", owner=None, replica="r2"
    )
    assert body == {
        "apiVersion": "sessionfleet.dev/v1alpha1",
        "kind": "AgentSession",
        "metadata": {
            "name": "s-child",
            "namespace": "ns",
            "annotations": {"sessionfleet.dev/created-by": "r2"},
        },
        "spec": {
            "sessionId": "child",
            "parentSessionId": "parent",
            "model": "qwen",
            "client": "Header",
            "workerHint": "w-0",
        },
    }


def test_session_patches() -> None:
    assert finished_patch() == {"spec": {"finished": True}}
    since = "2026-11-29T12:00:00.123456Z"
    assert acknowledgement_patch("ack.sessionfleet.dev/r1", since) == {
        "metadata": {"annotations": {"ack.sessionfleet.dev/r1": since}}
    }


# --- the router's Lease --------------------------------------------------------------


def test_router_lease_and_its_renewal() -> None:
    assert router_lease("router-3", "r1", duration_seconds=15, now=T0) == {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "router-3", "labels": {"sessionfleet.dev/component": "router"}},
        "spec": {
            "holderIdentity": "r1",
            "leaseDurationSeconds": 15,
            "acquireTime": "2027-01-15T08:00:00.250000Z",
            "renewTime": "2027-01-15T08:00:00.250000Z",
        },
    }
    assert lease_renewal("r1", now=T0 + 5) == {
        "spec": {"renewTime": "2027-01-15T08:00:05.250000Z", "holderIdentity": "r1"}
    }


def test_lease_release_clears_the_holder_and_times() -> None:
    assert lease_release() == {
        "spec": {"holderIdentity": None, "acquireTime": None, "renewTime": None}
    }


# --- slot Leases ---------------------------------------------------------------------


def test_slots_are_fixed_names_each_replica_tries_from_its_own_place() -> None:
    slots = LeaseSlots("sf-router", 4)
    assert slots.names() == ["sf-router-0", "sf-router-1", "sf-router-2", "sf-router-3"]
    for replica in ("sf-router-7d9f-abcde", "sf-router-7d9f-vwxyz", "r1"):
        order = slots.order_for(replica)
        names = slots.names()
        rotations = [names[i:] + names[:i] for i in range(len(names))]
        assert order in rotations  # every slot, each once, from the replica's own place
        assert order == slots.order_for(replica)  # the same place at every restart
    starts = {LeaseSlots("p", 8).order_for(f"replica-{n}")[0] for n in range(40)}
    assert len(starts) > 1, "replicas do not all start at slot 0"


@given(st.text(min_size=1, max_size=60), st.integers(min_value=1, max_value=64))
def test_every_replica_tries_every_slot_once(replica: str, count: int) -> None:
    slots = LeaseSlots("router", count)
    assert sorted(slots.order_for(replica)) == sorted(slots.names())


def test_slots_refuse_what_could_not_be_named() -> None:
    with pytest.raises(ValueError, match="at least one"):
        LeaseSlots("router", 0)
    with pytest.raises(ValueError, match="prefix"):
        LeaseSlots("", 4)
    with pytest.raises(ValueError, match="prefix"):
        LeaseSlots("x" * 252, 10)


def _slot(holder: str | None, renewed: float, duration: int = 15) -> dict[str, Any]:
    spec: dict[str, Any] = {"leaseDurationSeconds": duration, "renewTime": rfc3339(renewed)}
    if holder is not None:
        spec["holderIdentity"] = holder
    return {"metadata": {"name": "router-0"}, "spec": spec}


@pytest.mark.parametrize(
    ("body", "claimable"),
    [
        (_slot("r2", T0 - 5), False),  # held and renewed: another replica's
        (_slot("r2", T0 - 16), True),  # not renewed within its 15 s: its holder stopped
        (_slot("r2", T0 - 16, duration=60), False),  # a longer duration still runs
        (_slot("r1", T0 - 5), True),  # our own, from before a restart
        (_slot(None, T0 - 5), True),  # released
        (_slot("", T0 - 5), True),
        ({"metadata": {"name": "router-0"}, "spec": {"holderIdentity": "r2"}}, True),
    ],
)
def test_which_slot_a_replica_may_take(body: dict[str, Any], claimable: bool) -> None:
    now = datetime.fromtimestamp(T0, UTC)
    assert slot_claimable(body, "r1", now) is claimable
