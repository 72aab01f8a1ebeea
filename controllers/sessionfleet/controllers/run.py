"""``sessionfleet operator``: run the controllers under kopf."""

from __future__ import annotations

import argparse
import asyncio
import logging
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx

from sessionfleet.api import parse_duration
from sessionfleet.checkpoint.criu import AGENT_PORT
from sessionfleet.cliargs import fraction, positive_int
from sessionfleet.controllers.config import OperatorConfig
from sessionfleet.resources.pods import EngineImages
from sessionfleet.supervise import EXIT_TASK_FAILED, Supervisor

DEFAULTS = OperatorConfig()


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
        help="seconds between full reconciles without events (default 2)",
    )
    parser.add_argument(
        "--scrape-interval",
        type=float,
        default=DEFAULTS.scrape_interval_seconds,
        help="seconds between engine metric scrapes (default 15)",
    )
    parser.add_argument(
        "--ack-timeout",
        type=_duration,
        default=DEFAULTS.ack_timeout,
        help="longest a migration waits for every router replica to acknowledge (default 30s)",
    )
    parser.add_argument(
        "--checkpoint-timeout",
        type=_duration,
        default=DEFAULTS.checkpoint_timeout,
        help="longest a checkpoint runs before it is marked Failed; also how long a "
        "Running one left by a restarted operator waits (default 15m)",
    )
    parser.add_argument(
        "--agent-token-file",
        help="the node agents' shared secret; enables the criu checkpoint driver",
    )
    parser.add_argument(
        "--agent-port",
        type=int,
        default=AGENT_PORT,
        help=f"the node agents' port on their node's InternalIP (a hostPort; default {AGENT_PORT})",
    )
    parser.add_argument("--metrics-port", type=int, default=DEFAULTS.metrics_port)
    parser.add_argument("--health-port", type=int, default=DEFAULTS.health_port)
    parser.add_argument("--vllm-image", default=DEFAULTS.images.vllm)
    parser.add_argument("--sim-image", default=DEFAULTS.images.sim)
    parser.add_argument("--verbose", "-v", action="store_true", help="log debug messages")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    config = OperatorConfig(
        namespaces=tuple(args.namespace),
        kubeconfig=args.kubeconfig,
        idle_timeout=args.idle_timeout,
        node_not_ready_toleration=args.node_not_ready_toleration,
        max_concurrent_node_recoveries=args.max_node_recoveries,
        unhealthy_node_threshold=args.unhealthy_node_threshold,
        resync_seconds=args.resync,
        scrape_interval_seconds=args.scrape_interval,
        ack_timeout=args.ack_timeout,
        checkpoint_timeout=args.checkpoint_timeout,
        metrics_port=args.metrics_port,
        health_port=args.health_port,
        images=EngineImages(vllm=args.vllm_image, sim=args.sim_image),
    )
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:
        # Per-request and per-event lines would drown what matters at fleet scale.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    return asyncio.run(run_operator(config, args.agent_token_file, args.agent_port))


async def run_operator(
    config: OperatorConfig, agent_token_file: str | None = None, agent_port: int = AGENT_PORT
) -> int:
    """Run kopf with the sessionfleet handlers until it is stopped; return the exit status.

    The fleet loop and the engine scraper run under a :class:`Supervisor`: when one of
    them dies, the liveness probe fails and the operator stops with status 1, so that
    Kubernetes restarts it rather than leaving a process that answers but decides nothing.

    The ``engine`` and ``kubelet`` checkpoint drivers are always available (the second
    needs ``nodes/proxy`` RBAC, which the chart grants only when asked); ``criu`` needs
    the node agents' token, since the agent acts on other pods' processes.
    """
    import kopf
    from prometheus_client import start_http_server

    from sessionfleet.api import CheckpointDriver
    from sessionfleet.checkpoint import Driver
    from sessionfleet.checkpoint.criu import CriuDriver, node_address_locator
    from sessionfleet.checkpoint.engine import EngineDriver
    from sessionfleet.checkpoint.kubelet import KubeletDriver
    from sessionfleet.controllers import handlers  # noqa: F401 - registers the handlers
    from sessionfleet.controllers.fleet import Fleet
    from sessionfleet.kube import Kube, KubeConfig

    kube_config = KubeConfig.load(config.kubeconfig)
    http = httpx.AsyncClient()
    kube = Kube(kube_config, user_agent="sessionfleet-operator")
    drivers: dict[CheckpointDriver, Driver] = {
        CheckpointDriver.ENGINE: EngineDriver(http),
        # A kubelet checkpoint holds the request open while the runtime dumps memory.
        CheckpointDriver.KUBELET: KubeletDriver(
            Kube(kube_config, timeout=660.0, user_agent="sessionfleet-operator")
        ),
    }
    if agent_token_file:
        token = Path(agent_token_file).read_text().strip()
        locate = node_address_locator(kube, agent_port)
        drivers[CheckpointDriver.CRIU] = CriuDriver(http, kube, locate=locate, token=token)
    fleet = Fleet(config=config, kube=kube, http=http, drivers=drivers)
    start_http_server(config.metrics_port)
    supervisor = Supervisor(logging.getLogger("sessionfleet.operator"))
    stop = asyncio.Event()
    watchdog = asyncio.create_task(_stop_on_failure(supervisor, stop))
    try:
        await kopf.operator(
            clusterwide=not config.namespaces,
            namespaces=config.namespaces,
            standalone=True,
            liveness_endpoint=f"http://0.0.0.0:{config.health_port}/healthz",
            memo=kopf.Memo(fleet=fleet, supervisor=supervisor),
            stop_flag=stop,
        )
    finally:
        watchdog.cancel()
    return EXIT_TASK_FAILED if supervisor.failure is not None else 0


async def _stop_on_failure(supervisor: Supervisor, stop: asyncio.Event) -> None:
    failure = await supervisor.wait()
    logging.getLogger("sessionfleet.operator").error("stopping: %s", failure)
    stop.set()
