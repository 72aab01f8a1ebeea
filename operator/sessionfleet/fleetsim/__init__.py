"""The fleet simulator: agentic workloads against routing strategies, in virtual time.

A discrete-event simulation of a fleet of inference workers — each with a KV prefix
cache of limited capacity, a prefill queue and a decode cost — serving agent
sessions whose context grows turn by turn between tool pauses. It compares
routing strategies, among them the operator's own placement, drain and recovery
policies (imported from :mod:`sessionfleet.policy`, never copied)::

    from sessionfleet.fleetsim import FleetConfig, simulate
    from sessionfleet.workload import WorkloadConfig, generate

    result = simulate(generate(WorkloadConfig(sessions=500)), "operator", FleetConfig())
    print(f"{result.hit_rate:.1%}")

``sessionfleet simulate`` runs it from the command line; docs/simulator.md
describes the model and how it is calibrated.
"""

from sessionfleet.fleetsim._cache import PrefixCache
from sessionfleet.fleetsim._config import (
    CostModel,
    Disruption,
    Drain,
    Failure,
    FleetConfig,
    OperatorSettings,
)
from sessionfleet.fleetsim._replay import REPLAY_STRATEGIES, ReplayResult, replay
from sessionfleet.fleetsim._results import (
    DrainRecord,
    FailureRecord,
    SimResult,
    format_fair_table,
    format_table,
)
from sessionfleet.fleetsim._sim import Simulation, make_strategy, simulate
from sessionfleet.fleetsim._strategies import (
    STRATEGIES,
    GatedAffinity,
    HardAffinity,
    LeastLoaded,
    LlmdScheduler,
    Operator,
    RoundRobin,
    Strategy,
)
from sessionfleet.fleetsim._traces import Trace, TraceRequest, load_trace, trace_sessions

__all__ = [
    "REPLAY_STRATEGIES",
    "STRATEGIES",
    "CostModel",
    "Disruption",
    "Drain",
    "DrainRecord",
    "Failure",
    "FailureRecord",
    "FleetConfig",
    "GatedAffinity",
    "HardAffinity",
    "LeastLoaded",
    "LlmdScheduler",
    "Operator",
    "OperatorSettings",
    "PrefixCache",
    "ReplayResult",
    "RoundRobin",
    "SimResult",
    "Simulation",
    "Strategy",
    "Trace",
    "TraceRequest",
    "format_fair_table",
    "format_table",
    "load_trace",
    "make_strategy",
    "replay",
    "simulate",
    "trace_sessions",
]
