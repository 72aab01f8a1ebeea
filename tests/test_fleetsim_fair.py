"""The fair comparison: gateway admission for every strategy, timeouts, steady state."""

from __future__ import annotations

import pytest

from sessionfleet.fleetsim import STRATEGIES, FleetConfig, LlmdScheduler, simulate
from sessionfleet.workload import WorkloadConfig, generate


def _sessions(count: int = 300, rate: float = 2.0) -> list:
    return list(generate(WorkloadConfig(sessions=count, arrival_rate=rate), seed=4))


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_admission_cap_holds_every_strategy_to_the_same_number_of_live_sessions(
    strategy: str,
) -> None:
    """Behind a cap of 20, sessions queue at the gateway whatever the strategy."""
    fleet = FleetConfig(workers=4, admission_cap=20)
    result = simulate(_sessions(), strategy, fleet)
    assert result.queue_max > 0
    assert result.admission_max > 0
    assert result.sessions == 300
    uncapped = simulate(_sessions(), strategy, FleetConfig(workers=4))
    assert uncapped.queue_max == 0


def test_admission_wait_is_reported_apart_from_time_to_first_token() -> None:
    """A session queued at the gateway waits there; its first token counts from admission."""
    fleet = FleetConfig(workers=4, admission_cap=5)
    result = simulate(_sessions(100), "affinity", fleet)
    assert result.admission_quantile(0.99) > result.ttft_quantile(0.99)


def test_client_timeout_counts_abandoned_sessions_as_failed() -> None:
    """Overloaded and impatient: clients give up, and those sessions are failed, not done."""
    fleet = FleetConfig(workers=1, admission_cap=10, client_timeout_seconds=30.0)
    result = simulate(_sessions(200, rate=5.0), "round-robin", fleet)
    assert result.sessions_failed > 0
    assert result.sessions + result.sessions_failed == 200


def test_steady_state_window_measures_only_turns_inside_it() -> None:
    """Warm-up and drain are served but not measured."""
    everything = simulate(_sessions(), "affinity", FleetConfig(workers=4))
    window = FleetConfig(workers=4, warmup_seconds=30.0, measure_until_seconds=120.0)
    steady = simulate(_sessions(), "affinity", window)
    assert 0 < steady.turns < everything.turns
    assert steady.window_start == 30.0
    assert steady.window_end == 120.0
    assert 0 < steady.prefill_utilisation < 1
    assert steady.turns_on_target <= steady.turns
    assert steady.goodput == pytest.approx(steady.turns_on_target / 90.0)


def test_llmd_binding_lapses_after_its_ttl() -> None:
    """With the TTL at zero the session score never counts; with a long one it does."""
    sessions = _sessions(200, rate=4.0)
    kept = simulate(sessions, "llm-d", FleetConfig(workers=4, session_ttl_seconds=1e9))
    lapsed = simulate(sessions, "llm-d", FleetConfig(workers=4, session_ttl_seconds=0.0))
    assert kept.hit_rate != lapsed.hit_rate


def test_llmd_waits_when_every_worker_is_saturated() -> None:
    """The saturation signal: no worker under the threshold, no placement (a retry)."""
    fleet = FleetConfig(workers=1, saturation_seconds=0.0)
    result = simulate(_sessions(50, rate=10.0), LlmdScheduler(), fleet)
    assert result.retried_turns > 0
