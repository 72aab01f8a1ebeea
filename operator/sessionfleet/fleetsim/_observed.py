"""What the simulated operator observes: the inputs of the operator's own decisions.

The operator reconciles a worker by building a
:class:`~sessionfleet.policy.worker.WorkerObservation` from its indexes and calling
:func:`~sessionfleet.policy.worker.plan_worker`, and moves a draining worker's sessions
by calling :func:`~sessionfleet.policy.migration.plan_migration` with their
:class:`~sessionfleet.policy.sessions.SessionState`, the workers' loads and the router
replicas' Leases. The simulator calls the same two functions; this module builds their
inputs from the simulation's state, as the operator builds them from the cluster's.

A simulated drain is a node drain: the node is cordoned (a ``nodeCordon`` trigger) and
the platform evicts the worker's pod as soon as nothing holds it. One router replica
stands for the routers: its Lease is always live, and it acknowledges a Migrating
session as soon as none of the session's turns is in flight.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from sessionfleet.api import (
    EngineType,
    InferenceWorkerSpec,
    InferenceWorkerStatus,
    SessionPhase,
    WorkerPhase,
)
from sessionfleet.api.worker import CheckpointSettings, EngineSpec
from sessionfleet.fleetsim._config import FleetConfig, OperatorSettings
from sessionfleet.policy.drain import PinnedSession, PolicyChoice
from sessionfleet.policy.handshake import RouterLease, stamp
from sessionfleet.policy.holds import takes_new_sessions
from sessionfleet.policy.observed import NodeState, PodState
from sessionfleet.policy.placement import WorkerLoad
from sessionfleet.policy.sessions import SessionState
from sessionfleet.policy.worker import WorkerObservation, WorkerPlan, pod_name

if TYPE_CHECKING:
    from sessionfleet.fleetsim._state import Live, Worker

EPOCH = datetime(2026, 1, 1, tzinfo=UTC)
"""The policies reason in wall-clock datetimes; the simulation's second 0 is this."""
NAMESPACE = "sim"
ROUTER = "router-0"
"""The one router replica of the simulation."""
POLICY_NAME = "simulated"
"""The name the simulated DrainPolicy goes by in conditions."""


def at(seconds: float) -> datetime:
    """Return the wall-clock time of simulated second ``seconds``."""
    return EPOCH + timedelta(seconds=seconds)


def worker_spec(config: FleetConfig, settings: OperatorSettings) -> InferenceWorkerSpec:
    """Return the spec every simulated worker has: its model and checkpoint driver."""
    return InferenceWorkerSpec(
        model=config.model,
        engine=EngineSpec(type=EngineType.SIM),
        checkpoint=CheckpointSettings(driver=settings.checkpoint_driver),
    )


def node_name(worker: Worker) -> str:
    """Return the name of the node a worker's pod runs on."""
    return f"node-{worker.index}"


def serving_status(worker: Worker) -> InferenceWorkerStatus:
    """Return the status of a worker whose current pod is Ready."""
    return InferenceWorkerStatus(
        phase=WorkerPhase.READY,
        epoch=worker.epoch,
        pod=pod_name(worker.name, worker.epoch),
        node=node_name(worker),
    )


def written(status: InferenceWorkerStatus, plan: WorkerPlan) -> InferenceWorkerStatus:
    """Return the status once the operator has written what ``plan`` describes."""
    return status.model_copy(
        update={
            "phase": plan.phase,
            "epoch": plan.epoch,
            "pod": plan.pod,
            "node": plan.node,
            "drain_started_at": plan.drain_started_at,
            "consecutive_failures": plan.consecutive_failures,
            "last_recovery_at": plan.last_recovery_at,
        }
    )


def running_pod(worker: Worker, *, ready: bool = True, failed: bool = False) -> PodState:
    """Return the worker's current pod: Running and Ready, or failed, or on a lost node."""
    return PodState(
        name=pod_name(worker.name, worker.epoch),
        epoch=worker.epoch,
        phase="Failed" if failed else "Running",
        scheduled=True,
        ready=ready and not failed,
        node=node_name(worker),
        pod_ip=f"127.1.{worker.index // 256}.{worker.index % 256}",  # a label; never dialled
        terminated=failed,
    )


def worker_observation(
    worker: Worker,
    spec: InferenceWorkerSpec,
    settings: OperatorSettings,
    now: float,
    pod: PodState,
    node: NodeState,
) -> WorkerObservation:
    """Return what the operator observes of ``worker``, as its ``observe`` builds it."""
    return WorkerObservation(
        name=worker.name,
        spec=spec,
        status=worker.status,
        pods=(pod,),
        node=node,
        pinned=tuple(PinnedSession(live.session.session_id) for live in worker.bound),
        policy=PolicyChoice(POLICY_NAME, settings.drain_policy),
        now=at(now),
        node_not_ready_toleration=timedelta(seconds=settings.node_not_ready_toleration),
    )


def cordoned_node(worker: Worker) -> NodeState:
    """Return the node of a worker being drained: Ready, cordoned."""
    return NodeState(name=node_name(worker), unschedulable=True)


def worker_loads(workers: Iterable[Worker], config: FleetConfig, now: float) -> list[WorkerLoad]:
    """Return placement's view of the workers, with live figures.

    A worker is ready for placement when the operator would let it take new sessions:
    serving and neither draining nor recovering.
    """
    capacity = config.kv_tokens
    loads = []
    for worker in workers:
        worker.expire(now)
        loads.append(
            WorkerLoad(
                name=worker.name,
                model=config.model,
                ready=worker.up and not worker.recovering and worker.accepting,
                pinned_sessions=len(worker.bound),
                max_sessions=config.max_sessions,
                kv_tokens_capacity=config.capacity_kv_tokens,
                kv_tokens_pinned=worker.pinned_tokens,
                kv_usage=worker.inflight_tokens / capacity,
            )
        )
    return loads


def accepting(plan: WorkerPlan) -> bool:
    """Whether the worker takes new sessions after ``plan`` (the drain is not spec.drain)."""
    return takes_new_sessions(plan.phase, False)


def prompt_tokens(live: Live) -> int:
    """Return the prompt tokens of the session's turns so far, as its router counts them."""
    session = live.session
    compactions = set(session.compactions)
    prompt = total = 0
    for turn in range(live.turn):
        base = session.system_prompt_tokens if turn in compactions else prompt
        prompt = base + session.new_tokens[turn]
        total += prompt
    return total


def acknowledged(live: Live, now: float) -> bool:
    """Whether the router has acknowledged the session's migration: no turn in flight.

    The router holds a Migrating session's next turn, so once its turn in flight ends
    no other starts before the session moves.
    """
    return live.migrating_since is not None and live.busy_until <= now


def session_state(live: Live, worker: Worker, model: str, now: float) -> SessionState:
    """Return what the operator keeps of a session bound to ``worker``."""
    session_id = live.session.session_id
    since = live.migrating_since
    migrating_since = at(since) if since is not None else None
    return SessionState(
        namespace=NAMESPACE,
        name=session_id,
        session_id=session_id,
        model=model,
        phase=SessionPhase.BOUND if since is None else SessionPhase.MIGRATING,
        worker=worker.name,
        epoch=worker.epoch,
        last_activity=at(min(live.busy_until, now)),
        prompt_tokens=prompt_tokens(live),
        turns=live.turn,
        migrating_since=migrating_since,
        acks=(
            ((ROUTER, stamp(migrating_since)),)
            if migrating_since is not None and acknowledged(live, now)
            else ()
        ),
    )


def router_leases(now: float) -> tuple[RouterLease, ...]:
    """Return the router replicas' Leases: the one replica, renewed just now."""
    return (RouterLease(ROUTER, at(now), 15),)
