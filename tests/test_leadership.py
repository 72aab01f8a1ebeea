"""Leader election's decisions (client-go's rules) and the Lease bodies they write."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sessionfleet.kube import NotFound
from sessionfleet.operator.leader import LeaderElector
from sessionfleet.policy.leadership import (
    ElectionTiming,
    LeaseRecord,
    Observation,
    Step,
    lease_record,
    next_step,
    observe,
    still_leading,
)
from sessionfleet.resources.leases import leader_lease, leader_lease_claim, leader_lease_release

TIMING = ElectionTiming()


def record(holder: str = "a", version: str = "1", transitions: int = 0) -> LeaseRecord:
    return LeaseRecord(holder, 15, transitions, "2026-12-01T00:00:00.000000Z", version)


def test_the_defaults_are_client_gos_and_valid() -> None:
    assert TIMING.lease_duration == timedelta(seconds=15)
    assert TIMING.renew_deadline == timedelta(seconds=10)
    assert TIMING.retry_period == timedelta(seconds=2)
    assert TIMING.problems() == []


@pytest.mark.parametrize(
    ("lease", "renew", "retry", "problem"),
    [
        (10, 10, 2, "longer than the renew deadline"),
        (15, 2, 2, "1.2 times the retry period"),
        (15, 10, 0, "must be positive"),
        (2.5, 2, 1, "whole number of seconds"),
    ],
)
def test_settings_that_break_the_safety_margin_are_refused(
    lease: float, renew: float, retry: float, problem: str
) -> None:
    timing = ElectionTiming(
        timedelta(seconds=lease), timedelta(seconds=renew), timedelta(seconds=retry)
    )
    assert any(problem in text for text in timing.problems())


def test_a_missing_lease_is_created_and_ones_own_is_renewed() -> None:
    assert next_step(None, "a", 0.0) is Step.CREATE
    assert next_step(Observation(record("a"), 0.0), "a", 100.0) is Step.RENEW


def test_a_released_lease_is_taken_at_once() -> None:
    assert next_step(Observation(record(""), 50.0), "b", 50.0) is Step.TAKE


def test_another_holder_is_presumed_alive_for_a_lease_duration_after_it_last_changed() -> None:
    seen = observe(None, record("a", "7"), 100.0)
    assert next_step(seen, "b", 114.9) is Step.WAIT
    assert next_step(seen, "b", 115.0) is Step.TAKE
    # A renewal (new resourceVersion) restarts the clock; the same record does not.
    assert observe(seen, record("a", "7"), 110.0) is seen
    renewed = observe(seen, record("a", "8"), 110.0)
    assert next_step(renewed, "b", 124.9) is Step.WAIT


@given(
    renewed_at=st.floats(0, 1e6),
    seen_after=st.floats(0, 30),
    elapsed=st.floats(0, 60),
)
def test_a_leader_stops_writing_before_any_standby_may_take_over(
    renewed_at: float, seen_after: float, elapsed: float
) -> None:
    """The safety property: from the renewal sent at ``renewed_at``, a standby sees the
    record change no earlier than that, and may take it a lease duration later; the
    leader's gate has closed by then."""
    standby_seen = renewed_at + seen_after
    now = renewed_at + elapsed
    standby_takes = next_step(Observation(record("a"), standby_seen), "b", now) is Step.TAKE
    assert not (standby_takes and still_leading(renewed_at, now, TIMING))


def test_never_leading_before_a_renewal() -> None:
    assert not still_leading(None, 0.0, TIMING)
    assert still_leading(5.0, 14.9, TIMING)
    assert not still_leading(5.0, 15.0, TIMING)


def test_the_lease_bodies_carry_holder_times_transitions_and_the_precondition() -> None:
    created = leader_lease("sf", "a", duration_seconds=15, now=0.0)
    assert created["spec"]["holderIdentity"] == "a"
    assert created["spec"]["acquireTime"] == created["spec"]["renewTime"]
    assert created["spec"]["renewTime"] == "1970-01-01T00:00:00.000000Z"

    held = lease_record({**created, "metadata": {"name": "sf", "resourceVersion": "41"}})
    renewal = leader_lease_claim(held, "a", duration_seconds=15, now=10.0)
    assert renewal["metadata"] == {"resourceVersion": "41"}
    assert renewal["spec"]["acquireTime"] == created["spec"]["acquireTime"]
    assert renewal["spec"]["leaseTransitions"] == 0

    takeover = leader_lease_claim(held, "b", duration_seconds=15, now=30.0)
    assert takeover["spec"]["holderIdentity"] == "b"
    assert takeover["spec"]["acquireTime"] == "1970-01-01T00:00:30.000000Z"
    assert takeover["spec"]["leaseTransitions"] == 1

    released = leader_lease_release(held, now=40.0)
    assert released["spec"]["holderIdentity"] is None  # a merge patch deletes it
    assert released["spec"]["leaseDurationSeconds"] == 1
    assert released["metadata"] == {"resourceVersion": "41"}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lease-duration=10s", "--renew-deadline=10s"], "longer than the renew deadline"),
        (["--renew-deadline=2s", "--retry-period=2s"], "1.2 times the retry period"),
        ([], "--leader-election-namespace"),
    ],
)
def test_the_operator_refuses_election_settings_that_are_unsafe_or_incomplete(
    flags: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sessionfleet.cli import main
    from sessionfleet.operator import main as run

    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    monkeypatch.setattr(run, "SERVICE_ACCOUNT_NAMESPACE", "/nonexistent/namespace")
    if flags:
        flags = [*flags, "--leader-election-namespace=ops"]
    with pytest.raises(SystemExit) as exited:
        main(["operator", "--leader-elect", *flags])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


class SlowApi:
    """A Kube stand-in with no Lease yet, whose every request takes ``seconds`` of a clock."""

    def __init__(self, seconds: float) -> None:
        self.now = 100.0
        self.seconds = seconds

    async def get(self, *_: object) -> dict[str, object]:
        self.now += self.seconds
        raise NotFound(404, "no lease")

    async def create(self, _: object, body: dict[str, Any], __: object) -> dict[str, Any]:
        self.now += self.seconds
        return {**body, "metadata": {**body["metadata"], "resourceVersion": "1"}}


@pytest.mark.parametrize(("seconds", "warned"), [(0.5, False), (1.5, True)])
async def test_a_slow_lease_write_is_logged_with_how_long_it_took(
    seconds: float, warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    api = SlowApi(seconds)  # a get and a create: twice ``seconds``; 1/4 of 10 s is 2.5 s
    elector = LeaderElector(api, "ns", identity="me", clock=lambda: api.now)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="sessionfleet.operator.leader"):
        assert await elector._attempt(10.0)
    assert elector.leading
    found = [r.getMessage() for r in caplog.records if "written after" in r.getMessage()]
    assert found == (
        [
            f"leader election: Lease ns/sessionfleet-operator written after {2 * seconds:.1f} s "
            "(renew deadline 10 s)"
        ]
        if warned
        else []
    )


@given(
    renewed_at=st.floats(0, 1000),
    admitted_after=st.floats(0, 30),
    took=st.floats(0, 1),
    seen_after=st.floats(0, 30),
)
def test_a_write_admitted_while_leading_lands_before_any_standby_may_take_over(
    renewed_at: float, admitted_after: float, took: float, seen_after: float
) -> None:
    """Fencing: a write let through by the gate and bounded by ``write_timeout`` lands
    before a standby may take the Lease (docs/operator.md, "Fencing")."""
    admitted = renewed_at + admitted_after
    landed = admitted + took * TIMING.write_timeout
    standby_seen = renewed_at + seen_after
    standby_takes = next_step(Observation(record("a"), standby_seen), "b", landed) is Step.TAKE
    assert not (still_leading(renewed_at, admitted, TIMING) and standby_takes)


@pytest.mark.parametrize(
    ("lease", "renew", "retry"), [(15, 10, 2), (60, 40, 5), (137, 107, 26), (4, 3, 1)]
)
def test_the_write_timeout_is_inside_the_margin(lease: int, renew: int, retry: int) -> None:
    timing = ElectionTiming(
        timedelta(seconds=lease), timedelta(seconds=renew), timedelta(seconds=retry)
    )
    assert 0 < timing.write_timeout < timing.margin == lease - renew
