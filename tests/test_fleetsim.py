"""The fleet simulator: calibration against the published figures, drains, failures."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sessionfleet.api import CheckpointDriver, DrainMode, DrainPolicySpec
from sessionfleet.fleetsim import (
    STRATEGIES,
    Drain,
    Failure,
    FleetConfig,
    OperatorSettings,
    SimResult,
    Simulation,
    format_table,
    make_strategy,
    simulate,
)
from sessionfleet.workload import Session, WorkloadConfig, generate

AMPLE = FleetConfig(kv_tokens=50_000_000)
"""Far more KV than the live sessions' prefixes need."""
TIGHT = FleetConfig(workers=4, kv_tokens=300_000)
"""Room for one long context per worker, with up to 90 sessions bound to each (CROWDED)."""
PUBLISHED = WorkloadConfig.back_of_envelope(600)
"""33 turns of 2,242 new tokens from a 12K first prompt: the published per-turn figures."""
AGENTIC = WorkloadConfig(sessions=600)
CROWDED = WorkloadConfig(sessions=600, arrival_rate=0.5)
"""On TIGHT's 4 workers, the live sessions' prefixes need 10 to 17 times the KV there is."""


_RUNS: dict[object, SimResult] = {}


def run(
    workload: WorkloadConfig,
    strategy: str,
    fleet: FleetConfig = AMPLE,
    operator: OperatorSettings | None = None,
    disruptions: tuple[Drain | Failure, ...] = (),
    seed: int = 1,
) -> SimResult:
    """Simulate; runs with the default operator settings are shared between tests."""
    if operator is not None:
        return simulate(generate(workload, seed), strategy, fleet, operator, disruptions)
    key = repr((workload, strategy, fleet, disruptions, seed))
    if key not in _RUNS:
        _RUNS[key] = simulate(generate(workload, seed), strategy, fleet, None, disruptions)
    return _RUNS[key]


# --- calibration --------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["affinity", "operator"])
def test_affinity_with_ample_memory_matches_the_published_hit_rate(strategy: str) -> None:
    # Published: 94.2% measured; 94.7% by a back-of-envelope count from the same figures.
    result = run(PUBLISHED, strategy)
    assert 0.940 <= result.hit_rate <= 0.952
    assert result.recomputed_tokens == 0 and result.sessions_lost_cache == 0
    assert result.sessions == 600 and result.turns == 600 * 33


def test_round_robin_over_16_workers_loses_much_of_it() -> None:
    affinity = run(PUBLISHED, "affinity").hit_rate
    for strategy in ("round-robin", "least-loaded"):
        result = run(PUBLISHED, strategy)
        # Even with ample memory each turn finds only the prefix the session left on
        # that worker ~16 turns ago.
        assert result.hit_rate < 0.7
        assert affinity - result.hit_rate > 0.25
        assert result.sessions_lost_cache == result.sessions


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_every_strategy_loses_it_when_kv_cannot_hold_the_prefixes(strategy: str) -> None:
    tight = run(CROWDED, strategy, TIGHT)
    ample = run(CROWDED, strategy, replace(TIGHT, kv_tokens=50_000_000))
    # The published miss case, where only the system prompt stayed cached: 1.7%.
    assert tight.hit_rate < 0.2
    assert ample.hit_rate > tight.hit_rate + 0.3


def test_the_system_prompt_stays_cached_when_nothing_else_does() -> None:
    sessions = list(generate(CROWDED, 1))
    system_share = sum(s.system_prompt_tokens * s.turn_count for s in sessions) / sum(
        s.input_tokens for s in sessions
    )
    result = run(CROWDED, "round-robin", TIGHT)
    # Every turn touches the shared system prompt, so LRU keeps it: the floor.
    assert system_share <= result.hit_rate < system_share + 0.05


def test_hit_rate_grows_with_the_share_of_prefixes_that_fit() -> None:
    rates = [
        run(AGENTIC, "affinity", replace(AMPLE, kv_tokens=kv)).hit_rate
        for kv in (300_000, 1_000_000, 4_000_000, 50_000_000)
    ]
    assert rates == sorted(rates)
    assert rates[-1] - rates[0] > 0.5


def test_agentic_workload_with_affinity_stays_near_the_published_rate() -> None:
    # The spread of session lengths weighs long sessions (higher hit rates) more:
    # docs/simulator.md explains why this lands above 94.2%.
    for strategy in ("affinity", "affinity-gated", "operator"):
        assert 0.935 <= run(AGENTIC, strategy).hit_rate <= 0.97


def test_operator_puts_children_on_their_parents_worker() -> None:
    operator = run(AGENTIC, "operator")
    affinity = run(AGENTIC, "affinity")
    # With ample memory the only losses of plain hashing are forked subagents sent
    # away from the parent's context; parent-aware placement avoids them.
    assert operator.sessions_lost_cache == 0 and operator.recomputed_tokens == 0
    assert affinity.sessions_lost_cache > 0
    assert operator.hit_rate > affinity.hit_rate


def test_time_to_first_token_reflects_recomputation_and_load() -> None:
    slow = replace(AMPLE, cost=replace(AMPLE.cost, prefill_seconds_per_token=40e-6))
    round_robin = run(AGENTIC, "round-robin", slow)
    operator = run(AGENTIC, "operator", slow)
    assert round_robin.ttft_mean > 3 * operator.ttft_mean
    assert round_robin.ttft_p95 > operator.ttft_p95 >= operator.ttft_quantile(0.5)
    few = run(AGENTIC, "operator", replace(slow, workers=3))
    assert few.ttft_mean > 2 * operator.ttft_mean  # queueing behind other prefills


def test_runs_are_reproducible() -> None:
    first = run(AGENTIC, "least-loaded", FleetConfig(), disruptions=(Drain(300, 2),))
    second = run(AGENTIC, "least-loaded", FleetConfig(), disruptions=(Drain(300, 2),))
    assert first.as_dict() == second.as_dict()
    assert first.ttft_histogram == second.ttft_histogram


def test_policy_functions_are_the_operators_own() -> None:
    from sessionfleet.fleetsim import _sim, _strategies
    from sessionfleet.policy import drain, placement, recovery, sessions

    assert _strategies.place is placement.place
    assert _sim.decide_drain is drain.decide_drain
    assert _sim.recovery_reason is recovery.recovery_reason
    assert _sim.decide_session is sessions.decide_session


def test_operator_placement_calls_the_policy_once_per_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sessionfleet.fleetsim import _strategies

    calls = []

    def spy(request: object, workers: object) -> object:
        calls.append(request)
        return placement_place(request, workers)  # type: ignore[arg-type]

    placement_place = _strategies.place
    monkeypatch.setattr(_strategies, "place", spy)
    result = run(WorkloadConfig(sessions=80), "operator")
    assert len(calls) == result.sessions


# --- drains -------------------------------------------------------------------------

SMALL = FleetConfig(workers=4)
BUSY = WorkloadConfig(sessions=300, arrival_rate=0.3)
DRAIN = (Drain(400, 1),)


def operator(mode: DrainMode, checkpoint: bool = True, **policy: str) -> OperatorSettings:
    return OperatorSettings(
        drain_policy=DrainPolicySpec(mode=mode, checkpoint=checkpoint, **policy),  # type: ignore[arg-type]
        checkpoint_driver=CheckpointDriver.ENGINE if checkpoint else CheckpointDriver.NONE,
    )


def test_without_an_operator_a_drain_evicts_at_once() -> None:
    result = run(BUSY, "affinity", SMALL, disruptions=DRAIN)
    (drain,) = result.drains
    assert drain.pinned_at_start > 0 and drain.evicted == drain.pinned_at_start
    assert drain.duration is not None and drain.duration <= SMALL.termination_grace_seconds
    assert result.sessions_lost_cache >= drain.evicted
    quiet = run(BUSY, "affinity", SMALL)
    assert result.recomputed_tokens > quiet.recomputed_tokens


def test_migrate_moves_sessions_with_their_cache() -> None:
    result = run(BUSY, "operator", SMALL, operator(DrainMode.MIGRATE), DRAIN)
    (drain,) = result.drains
    assert drain.pinned_at_start > 0
    assert drain.migrated_with_checkpoint == drain.pinned_at_start
    assert drain.duration is not None and drain.duration < 60  # turns in flight end first
    assert result.held_turns > 0  # held while their KV moved
    cold = run(BUSY, "operator", SMALL, operator(DrainMode.MIGRATE, checkpoint=False), DRAIN)
    assert cold.drains[0].migrated_without_checkpoint == cold.drains[0].pinned_at_start
    assert cold.recomputed_tokens > result.recomputed_tokens + 1_000_000
    assert cold.sessions_lost_cache > result.sessions_lost_cache


def test_wait_holds_until_the_sessions_finish_or_the_deadline() -> None:
    result = run(BUSY, "operator", SMALL, operator(DrainMode.WAIT), DRAIN)
    (drain,) = result.drains
    assert drain.duration is not None
    assert drain.migrated_with_checkpoint == drain.migrated_without_checkpoint == 0
    if drain.released:
        assert drain.duration == pytest.approx(600)  # the default 10m deadline
    else:
        assert drain.duration < 600
    longer = run(BUSY, "operator", SMALL, operator(DrainMode.WAIT, deadline="1h"), DRAIN)
    assert longer.drains[0].released == 0
    assert longer.drains[0].duration >= drain.duration  # type: ignore[operator]


def test_wait_then_migrate_waits_the_grace_period() -> None:
    policy = operator(DrainMode.WAIT_THEN_MIGRATE, grace_period="1m")
    result = run(BUSY, "operator", SMALL, policy, DRAIN)
    (drain,) = result.drains
    assert drain.duration is not None and 60 <= drain.duration < 120
    assert drain.migrated_with_checkpoint > 0
    assert drain.migrated_with_checkpoint < drain.pinned_at_start  # some finished first


def test_drained_worker_comes_back_empty() -> None:
    simulation = Simulation(
        generate(BUSY, 1), make_strategy("operator"), SMALL, operator(DrainMode.MIGRATE), DRAIN
    )
    result = simulation.run()
    worker = simulation.workers[1]
    assert worker.up and worker.epoch == 2
    assert result.drains[0].finished is not None


# --- failures -----------------------------------------------------------------------

FAIL = (Failure(500, 2),)


def test_a_failed_worker_restores_its_last_checkpoint() -> None:
    saved = replace(operator(DrainMode.MIGRATE), checkpoint_interval=60.0)
    result = run(BUSY, "operator", SMALL, saved, FAIL)
    (failure,) = result.failures
    assert result.checkpoints > 0
    assert failure.restored_tokens > 0 and failure.sessions > 0
    assert failure.detected == 500
    assert failure.ready is not None and failure.ready > 500 + SMALL.restart_seconds
    assert result.held_turns > 0  # its sessions wait for the new epoch (Restoring)
    cold = run(BUSY, "operator", SMALL, operator(DrainMode.MIGRATE, checkpoint=False), FAIL)
    assert cold.failures[0].restored_tokens == 0
    assert cold.recomputed_tokens > result.recomputed_tokens


def test_a_lost_node_is_noticed_after_the_toleration() -> None:
    result = run(BUSY, "operator", SMALL, disruptions=(Failure(500, 2, node=True),))
    (failure,) = result.failures
    assert failure.detected == pytest.approx(530, abs=1.0)
    assert result.retried_turns > 0  # turns sent to the dead worker before it was noticed


def test_without_an_operator_a_failure_sends_sessions_elsewhere_at_once() -> None:
    result = run(BUSY, "affinity", SMALL, disruptions=FAIL)
    (failure,) = result.failures
    assert failure.detected == 500 and result.held_turns == 0
    assert result.sessions_lost_cache >= failure.sessions > 0


# --- edges --------------------------------------------------------------------------


def test_sessions_wait_when_no_worker_has_room() -> None:
    crowded = FleetConfig(workers=2, max_sessions=3)
    result = run(WorkloadConfig(sessions=60, arrival_rate=2.0), "operator", crowded)
    assert result.retried_turns > 0
    assert result.sessions == 60  # all of them eventually ran


def test_workload_must_give_roots_in_arrival_order() -> None:
    sessions = list(generate(WorkloadConfig(sessions=5, child_share=0.0), 1))
    with pytest.raises(ValueError, match="arrival order"):
        simulate(reversed(sessions), "affinity")


def test_disruptions_must_name_a_worker() -> None:
    with pytest.raises(ValueError, match="no worker 9"):
        Simulation([], make_strategy("affinity"), SMALL, disruptions=(Drain(1, 9),))


def test_unknown_strategy() -> None:
    with pytest.raises(ValueError, match="choose from"):
        make_strategy("random")


def test_trace_sessions_run_too() -> None:
    sessions = [
        Session(
            session_id=f"t{n}",
            arrival=float(n),
            new_tokens=(5_000, 800, 900, 1_200),
            output_tokens=(50, 60, 70, 80),
            pauses=(2.0, 3.0, 1.0, 0.0),
            system_prompt_tokens=1_000,
            prefix_group="trace",
        )
        for n in range(40)
    ]
    affinity = simulate(sessions, "affinity", SMALL)
    round_robin = simulate(sessions, "round-robin", SMALL)
    assert affinity.sessions == 40 and affinity.turns == 160
    assert affinity.hit_rate > round_robin.hit_rate


def test_table_lists_every_run() -> None:
    results = [run(WorkloadConfig(sessions=30), name) for name in STRATEGIES]
    table = format_table(results)
    for name in STRATEGIES:
        assert name in table
    assert "hit rate" in table.splitlines()[0]
