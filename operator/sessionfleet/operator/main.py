"""``sessionfleet operator``: run the controllers under kopf."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import httpx

from sessionfleet.api import parse_duration
from sessionfleet.checkpoint.agent_api import AGENT_PORT
from sessionfleet.cliargs import fraction, non_negative_float, positive_float, positive_int
from sessionfleet.controllers.config import OperatorConfig
from sessionfleet.operator.drivers.criu import AgentAccess, service_account_ref
from sessionfleet.operator.leader import DEFAULT_LEASE_NAME
from sessionfleet.policy.leadership import ElectionTiming
from sessionfleet.resources.networkpolicies import parse_peers
from sessionfleet.resources.pods import EngineImages
from sessionfleet.supervise import EXIT_TASK_FAILED, Supervisor

DEFAULTS = OperatorConfig()
ELECTION = ElectionTiming()
SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
DEFAULT_CHECKPOINT_KEY_SECRET = "sessionfleet-checkpoint-key"


def _duration(text: str) -> timedelta:
    try:
        return parse_duration(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def add_parser(commands: Any) -> None:
    """Register the ``operator`` subcommand."""
    parser = commands.add_parser(
        "operator",
        help="run the operator (InferenceWorker, AgentSession, DrainPolicy controllers)",
        description="Run the sessionfleet operator against the cluster in the kubeconfig "
        "(or the pod's ServiceAccount).",
    )
    _add_session_flags(parser)
    _add_engine_and_checkpoint_flags(parser)
    _add_agent_flags(parser)
    _add_election_flags(parser)
    _add_serving_flags(parser)
    # Checks across flags need the parser to report them as usage errors (status 2).
    parser.set_defaults(func=_run, parser_error=parser.error)


def _add_session_flags(parser: argparse.ArgumentParser) -> None:
    """Add where the operator looks and how it paces sessions, recovery and writes."""
    parser.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="serve only this namespace (repeatable); default: the whole cluster",
    )
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, in-cluster)")
    parser.add_argument(
        "--idle-timeout",
        type=_duration,
        default=DEFAULTS.idle_timeout,
        help="finish sessions with no turn for this long (default 30m)",
    )
    parser.add_argument(
        "--lost-session-timeout",
        type=_duration,
        default=DEFAULTS.lost_timeout,
        help="finish a Lost session (its worker was deleted) this long after it became "
        "Lost or after its last turn, whichever is later; it is then deleted after its "
        "ttlSecondsAfterFinished (default 30m)",
    )
    parser.add_argument(
        "--node-not-ready-toleration",
        type=_duration,
        default=DEFAULTS.node_not_ready_toleration,
        help="replace a worker whose node is NotReady this long (default 30s)",
    )
    parser.add_argument(
        "--max-node-recoveries",
        type=positive_int,
        default=DEFAULTS.max_concurrent_node_recoveries,
        help="most workers moved off NotReady nodes at once (default "
        f"{DEFAULTS.max_concurrent_node_recoveries})",
    )
    parser.add_argument(
        "--unhealthy-node-threshold",
        type=fraction,
        default=DEFAULTS.unhealthy_node_threshold,
        help="beyond this share of NotReady nodes no worker is moved off one: likely a "
        f"control-plane fault (default {DEFAULTS.unhealthy_node_threshold})",
    )
    parser.add_argument(
        "--resync",
        type=float,
        default=DEFAULTS.resync_seconds,
        help="longest the fleet loop waits without an event; deadlines are met within "
        "it (default 2)",
    )
    parser.add_argument(
        "--full-resync",
        type=float,
        default=DEFAULTS.full_resync_seconds,
        help="seconds between passes over every worker and session; the others take "
        f"only what events touched (default {DEFAULTS.full_resync_seconds:g})",
    )
    parser.add_argument(
        "--session-writes",
        type=positive_int,
        default=DEFAULTS.session_writes,
        help="session writes (binds, finishes, moves, deletions) in flight at once; the "
        "others wait, those that hold a drain or a recovery first "
        f"(default {DEFAULTS.session_writes})",
    )
    parser.add_argument(
        "--counter-writes",
        type=non_negative_float,
        default=DEFAULTS.counter_writes_per_second,
        help="workers' counter-only status writes per second, fleet-wide: with more "
        "workers, each one's counters are written less often than every "
        f"{DEFAULTS.status_coalesce_seconds:g} s; 0: no budget "
        f"(default {DEFAULTS.counter_writes_per_second:g})",
    )


def _add_engine_and_checkpoint_flags(parser: argparse.ArgumentParser) -> None:
    """Add how the operator reads engines and takes checkpoints."""
    parser.add_argument(
        "--scrape-interval",
        type=float,
        default=DEFAULTS.scrape_interval_seconds,
        help="seconds between engine metric scrapes (default 15)",
    )
    parser.add_argument(
        "--kv-store-interval",
        type=positive_float,
        default=DEFAULTS.kv_store_interval_seconds,
        help="seconds between telling each vLLM KV store its live sessions, so finished "
        "sessions' blocks go (default 60)",
    )
    parser.add_argument(
        "--kv-store-grace",
        type=non_negative_float,
        default=DEFAULTS.kv_store_grace_seconds,
        help="seconds a session not live for the operator must have been idle before its "
        "KV store forgets it (default 300)",
    )
    parser.add_argument(
        "--ack-timeout",
        type=_duration,
        default=DEFAULTS.ack_timeout,
        help="longest a migration waits for every router replica to acknowledge (default 30s)",
    )
    parser.add_argument(
        "--checkpoint-key-secret",
        metavar="NAMESPACE/NAME",
        type=_object_ref,
        help="the Secret whose key signs the WorkerCheckpoints the operator creates, so "
        "that every replica tells them from a user's (created if missing; docs/checkpoints.md"
        f", Provenance); default {DEFAULT_CHECKPOINT_KEY_SECRET} in $POD_NAMESPACE, else the "
        "--leader-election-namespace, else the pod's ServiceAccount namespace",
    )
    parser.add_argument(
        "--checkpoint-timeout",
        type=_duration,
        default=DEFAULTS.checkpoint_timeout,
        help="longest a checkpoint runs before it is marked Failed; also how long a "
        "Running one left by a restarted operator waits (default 15m)",
    )
    parser.add_argument(
        "--event-series-interval",
        type=float,
        default=DEFAULTS.event_series_seconds,
        help="seconds between two updates of a repeated Event's count (its series; "
        f"default {DEFAULTS.event_series_seconds:g})",
    )


def _add_agent_flags(parser: argparse.ArgumentParser) -> None:
    """Add how the operator reaches and authenticates to the node agents."""
    parser.add_argument(
        "--agent-service-account",
        metavar="NAMESPACE/NAME",
        type=_service_account,
        help="the operator's own ServiceAccount: it requests a token of it for each node's "
        "agent (audience sessionfleet-agent:<node>, TokenRequest), which only that node's "
        "agent accepts; enables the criu checkpoint driver",
    )
    parser.add_argument(
        "--agent-token-file",
        help="instead of --agent-service-account, for agents started with --token-file: "
        "their one shared secret; enables the criu checkpoint driver",
    )
    parser.add_argument(
        "--agent-ca-file",
        help="verify the agents' HTTPS certificates against this CA; default: encrypted "
        "but unverified (each agent's self-signed certificate)",
    )
    parser.add_argument(
        "--agent-port",
        type=int,
        default=AGENT_PORT,
        help=f"the node agents' port on their node's InternalIP (a hostPort; default {AGENT_PORT})",
    )


def _add_election_flags(parser: argparse.ArgumentParser) -> None:
    """Add leader election among the operator replicas."""
    election = parser.add_argument_group(
        "leader election",
        "Run two or more replicas with --leader-elect: one leads and writes, the others "
        "keep their indexes warm and take over when it stops renewing the Lease "
        "(docs/operator.md, High availability).",
    )
    election.add_argument(
        "--leader-elect",
        action="store_true",
        help="elect a leader on a coordination.k8s.io Lease; without it this process "
        "writes alone, so never run two",
    )
    election.add_argument(
        "--leader-election-namespace",
        help="the Lease's namespace (default: $POD_NAMESPACE, else the pod's ServiceAccount "
        "namespace)",
    )
    election.add_argument(
        "--leader-election-id",
        default=DEFAULT_LEASE_NAME,
        help=f"the Lease's name (default {DEFAULT_LEASE_NAME})",
    )
    election.add_argument(
        "--lease-duration",
        type=_duration,
        default=ELECTION.lease_duration,
        help="how long a standby waits after the Lease last changed before taking it (default 15s)",
    )
    election.add_argument(
        "--renew-deadline",
        type=_duration,
        default=ELECTION.renew_deadline,
        help="how long the leader tries to renew before it stops writing and exits "
        "(default 10s; shorter than --lease-duration)",
    )
    election.add_argument(
        "--retry-period",
        type=_duration,
        default=ELECTION.retry_period,
        help="how often candidates try for the Lease and the leader renews it (default 2s)",
    )


def _add_serving_flags(parser: argparse.ArgumentParser) -> None:
    """Add the ports, the engine images, the engine NetworkPolicy and logging."""
    parser.add_argument("--metrics-port", type=int, default=DEFAULTS.metrics_port)
    parser.add_argument("--health-port", type=int, default=DEFAULTS.health_port)
    parser.add_argument("--vllm-image", default=DEFAULTS.images.vllm)
    parser.add_argument("--sim-image", default=DEFAULTS.images.sim)
    parser.add_argument(
        "--engine-peers",
        type=_engine_peers,
        default=DEFAULTS.engine_peers,
        help="a JSON list of NetworkPolicyPeer objects (the routers, the gateway, this "
        "operator, the node agent): every worker gets a NetworkPolicy admitting only them "
        "to its engine port (default: none, no policy)",
    )
    parser.add_argument(
        "--stock-kopf-start",
        action="store_true",
        help="leave kopf's start as it is: its wait for the indexes costs time quadratic in "
        "the watched objects (minutes at 20,000 sessions); for comparison only",
    )
    parser.add_argument("--verbose", "-v", action="store_true", help="log debug messages")


def _engine_peers(text: str) -> tuple[dict[str, Any], ...]:
    try:
        return parse_peers(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


@dataclass(frozen=True, slots=True)
class ElectionConfig:
    """Where and how the replicas elect their leader."""

    namespace: str
    name: str
    timing: ElectionTiming


def _election(args: argparse.Namespace, parser_error: Any) -> ElectionConfig | None:
    if not args.leader_elect:
        return None
    timing = ElectionTiming(args.lease_duration, args.renew_deadline, args.retry_period)
    if problems := timing.problems():
        parser_error("; ".join(problems))
    namespace = args.leader_election_namespace or _own_namespace()
    if not namespace:
        parser_error(
            "--leader-elect needs --leader-election-namespace outside a pod (or $POD_NAMESPACE)"
        )
    return ElectionConfig(str(namespace), args.leader_election_id, timing)


def _own_namespace() -> str | None:
    """Return the namespace the operator runs in: $POD_NAMESPACE, else its ServiceAccount's."""
    namespace = os.environ.get("POD_NAMESPACE")
    if not namespace and os.path.exists(SERVICE_ACCOUNT_NAMESPACE):
        with open(SERVICE_ACCOUNT_NAMESPACE) as file:
            namespace = file.read().strip()
    return namespace or None


def _checkpoint_key_secret(
    args: argparse.Namespace, election: ElectionConfig | None
) -> tuple[str, str] | None:
    if args.checkpoint_key_secret is not None:
        return args.checkpoint_key_secret  # type: ignore[no-any-return]
    namespace = os.environ.get("POD_NAMESPACE") or (election.namespace if election else None)
    namespace = namespace or _own_namespace()
    return (namespace, DEFAULT_CHECKPOINT_KEY_SECRET) if namespace else None


def _object_ref(text: str) -> tuple[str, str]:
    try:
        return service_account_ref(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not NAMESPACE/NAME: {text!r}") from None


def _run(args: argparse.Namespace) -> int:
    election = _election(args, args.parser_error)
    config = OperatorConfig(
        namespaces=tuple(args.namespace),
        kubeconfig=args.kubeconfig,
        idle_timeout=args.idle_timeout,
        lost_timeout=args.lost_session_timeout,
        node_not_ready_toleration=args.node_not_ready_toleration,
        max_concurrent_node_recoveries=args.max_node_recoveries,
        unhealthy_node_threshold=args.unhealthy_node_threshold,
        resync_seconds=args.resync,
        full_resync_seconds=args.full_resync,
        counter_writes_per_second=args.counter_writes,
        session_writes=args.session_writes,
        scrape_interval_seconds=args.scrape_interval,
        kv_store_interval_seconds=args.kv_store_interval,
        kv_store_grace_seconds=args.kv_store_grace,
        ack_timeout=args.ack_timeout,
        checkpoint_timeout=args.checkpoint_timeout,
        checkpoint_key_secret=_checkpoint_key_secret(args, election),
        event_series_seconds=args.event_series_interval,
        metrics_port=args.metrics_port,
        health_port=args.health_port,
        images=EngineImages(vllm=args.vllm_image, sim=args.sim_image),
        engine_peers=args.engine_peers,
        stock_kopf_start=args.stock_kopf_start,
    )
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:
        # Per-request and per-event lines would drown what matters at fleet scale.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    agents = AgentAccess(
        args.agent_port, args.agent_token_file, args.agent_service_account, args.agent_ca_file
    )
    return asyncio.run(run_operator(config, agents=agents, election=election))


def _service_account(text: str) -> str:
    try:
        service_account_ref(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


async def run_operator(
    config: OperatorConfig,
    agents: AgentAccess | None = None,
    election: ElectionConfig | None = None,
) -> int:
    """Run kopf with the sessionfleet handlers until it is stopped; return the exit status.

    The fleet loop and the engine scraper run under a :class:`Supervisor`: when one of
    them dies, the liveness probe fails and the operator stops with status 1, so that
    Kubernetes restarts it rather than leaving a process that answers but decides nothing.

    With ``election``, the process stands by until it holds the Lease; every write of
    its API clients is refused unsent while it does not (:mod:`sessionfleet.operator.leader`),
    and losing the Lease stops it like a dead task does.

    The ``engine`` and ``kubelet`` checkpoint drivers are always available (the second
    needs ``nodes/proxy`` RBAC, which the chart grants only when asked); ``criu`` needs
    a way to authenticate to the node agents (``agents``), since an agent acts on other
    pods' processes.
    """
    import kopf
    from prometheus_client import start_http_server

    from sessionfleet import __version__
    from sessionfleet.api import CheckpointDriver
    from sessionfleet.checkpoint import Driver
    from sessionfleet.controllers import (
        handlers,  # noqa: F401 - registers the handlers
        kopfstart,
        metrics,
        served,
        sessionwatch,
    )
    from sessionfleet.controllers.checkpointwork import CheckpointWork
    from sessionfleet.controllers.events import EventRecorder
    from sessionfleet.controllers.fleet import Fleet
    from sessionfleet.controllers.health import serve_health
    from sessionfleet.controllers.kopfcompat import Insights
    from sessionfleet.controllers.leadership import Leadership, Solo
    from sessionfleet.controllers.sessionbook import SessionBook
    from sessionfleet.controllers.turns import WriteTurns
    from sessionfleet.controllers.work import WorkQueue
    from sessionfleet.kube import SESSIONS, Kube, KubeConfig
    from sessionfleet.operator.drivers.engine import EngineDriver
    from sessionfleet.operator.drivers.kubelet import KubeletDriver
    from sessionfleet.operator.leader import LeaderElector, default_identity
    from sessionfleet.policy.events import Coalescer

    operator_log = logging.getLogger("sessionfleet.operator")
    operator_log.info(
        "sessionfleet %s operator starting: %s",
        __version__,
        ", ".join(config.namespaces) if config.namespaces else "every namespace",
    )
    kube_config = KubeConfig.load(config.kubeconfig)
    leadership: Leadership = Solo()
    if election is not None:
        identity = default_identity()
        # Its own client: a renewal must not queue behind a burst of session writes.
        election_kube = Kube(
            kube_config,
            timeout=election.timing.renew_deadline.total_seconds(),
            user_agent=f"sessionfleet-operator-election/{identity}",
        )
        leadership = LeaderElector(
            election_kube,
            election.namespace,
            election.name,
            identity=identity,
            timing=election.timing,
        )

    def may_write() -> bool:
        return leadership.leading

    http = httpx.AsyncClient()
    # Every replica names itself to the API server (its audit log records the agent).
    user_agent = f"sessionfleet-operator/{leadership.identity}"
    write_timeout = election.timing.write_timeout if election is not None else None
    kube = Kube(
        kube_config, user_agent=user_agent, write_gate=may_write, write_timeout=write_timeout
    )
    drivers: dict[CheckpointDriver, Driver] = {
        CheckpointDriver.ENGINE: EngineDriver(http, write_gate=may_write),
        # A kubelet checkpoint holds the request open while the runtime dumps memory: its
        # gate is asked when it is admitted and when it is sent, its answer not bounded.
        CheckpointDriver.KUBELET: KubeletDriver(
            Kube(kube_config, timeout=660.0, user_agent=user_agent, write_gate=may_write)
        ),
    }
    if agents is not None and (criu := agents.driver(kube, write_gate=may_write)) is not None:
        drivers[CheckpointDriver.CRIU] = criu
    events = EventRecorder(
        kube, leadership.identity, coalescer=Coalescer(flush_every=config.event_series_seconds)
    )
    session_sources = sessionwatch.sources(config.namespaces)
    fleet = Fleet(
        config=config,
        kube=kube,
        http=http,
        sessions=SessionBook(
            sources=len(session_sources), writes=WriteTurns(config.session_writes)
        ),
        checkpointing=CheckpointWork(drivers=drivers),
        leadership=leadership,
        events=events,
        work=WorkQueue(full_every=config.full_resync_seconds),
    )
    metrics.LEADER.set_function(lambda: 1.0 if leadership.leading else 0.0)
    start_http_server(config.metrics_port)
    supervisor = Supervisor(operator_log)
    stop = asyncio.Event()
    watchdog = asyncio.create_task(_stop_on_failure(supervisor, stop))
    health = await serve_health(fleet, supervisor, config.health_port)
    # Neither lead nor let kopf scan the API before it serves every kind watched
    # (controllers/sessionfleet/controllers/served.py: kopf would never look again).
    kinds = served.watched_kinds(kopf.get_default_registry())
    sessions = served.WatchedKind(SESSIONS.group, SESSIONS.version, SESSIONS.plural)
    await served.wait_until_served(kube, kinds | {sessions})
    insights = Insights()
    supervisor.start(
        "kopf's scan of the API", served.check_kopf_scan(insights, kinds, kube), forever=False
    )
    if isinstance(leadership, LeaderElector):
        supervisor.start("leader election", leadership.run())
    supervisor.start("event recorder", events.run())
    # The session watches hold a connection each for as long as they run: a client of
    # their own, so that many namespaces' watches never take the writes' connections.
    watch_kube = Kube(kube_config, user_agent=user_agent)
    for source in session_sources:
        where = source.namespace or "the cluster"
        supervisor.start(
            f"AgentSession watch of {where}", sessionwatch.follow(fleet, source, watch_kube)
        )
    if not config.stock_kopf_start:
        kopfstart.install()  # before kopf makes its toggle sets: a start linear in the objects
    try:
        await kopf.operator(
            clusterwide=not config.namespaces,
            namespaces=config.namespaces,
            standalone=True,
            memo=kopf.Memo(fleet=fleet, supervisor=supervisor),
            stop_flag=stop,
            insights=insights,
        )
    finally:
        watchdog.cancel()
        await watch_kube.aclose()
        await health.cleanup()
        if isinstance(leadership, LeaderElector):
            await leadership.kube.aclose()
    return EXIT_TASK_FAILED if supervisor.failure is not None else 0


async def _stop_on_failure(supervisor: Supervisor, stop: asyncio.Event) -> None:
    failure = await supervisor.wait()
    logging.getLogger("sessionfleet.operator").error("stopping: %s", failure)
    stop.set()
