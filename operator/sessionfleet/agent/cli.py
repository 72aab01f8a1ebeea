"""``sessionfleet agent``: the node agent (GPU telemetry and the ``criu`` driver's endpoint)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sessionfleet.checkpoint.agent_api import AGENT_PORT
from sessionfleet.checkpoint.paths import DEFAULT_STORAGE_ROOT
from sessionfleet.cliargs import port

if TYPE_CHECKING:
    from sessionfleet.agent.server import AgentSettings
    from sessionfleet.kube import Kube

DESCRIPTION = """\
Runs on every GPU node (a DaemonSet with hostPID). Serves NVML telemetry per GPU and
per process, each process mapped to its pod through its cgroup, as Prometheus metrics
on /metrics; where NVML is absent it says so once and keeps serving. Hosts the criu
checkpoint driver's endpoint: GET /capability says whether this node can checkpoint
GPU processes (NVIDIA driver >= 570, CRIU >= 4.0, root) and why not; POST /checkpoint
and POST /restore, which write and read images only under --storage-root/<namespace>/.
Those need the operator: a token of an --operator identity for this node's audience
(sessionfleet-agent:<node>, checked with a TokenReview), or the static --token-file;
/metrics then needs one too (or a --metrics-reader's). Serves HTTPS: --tls-cert-file
and --tls-key-file, else a self-signed certificate made at start. /readyz fails, and
the agent exits 1, when a background loop dies. See docs/checkpoints.md.
"""


MAX_SECONDS = 86_400.0
"""The longest interval or cache time a flag takes: a day."""


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= MAX_SECONDS:  # NaN fails both comparisons
        raise argparse.ArgumentTypeError(f"must be above 0 and at most {MAX_SECONDS:g}, not {text}")
    return value


def _absolute_path(text: str) -> Path:
    if not text.startswith("/"):
        raise argparse.ArgumentTypeError(f"must be an absolute path, not {text!r}")
    return Path(text)


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """Add the ``agent`` subcommand to ``commands`` (an argparse subparsers object)."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "agent",
        help="run the node agent (GPU telemetry, criu checkpoint endpoint)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (default: 0.0.0.0)")
    parser.add_argument(
        "--port",
        type=port,
        default=AGENT_PORT,
        help=f"port to bind; the operator reaches the agent on its node's InternalIP at this "
        f"port, a hostPort in the chart (default: {AGENT_PORT})",
    )
    parser.add_argument(
        "--node-name",
        default=None,
        help="this node's name, a label on every metric (default: $NODE_NAME, else the host name)",
    )
    parser.add_argument(
        "--interval",
        type=_seconds,
        default=10.0,
        help="seconds between GPU samples (default: 10)",
    )
    parser.add_argument(
        "--operator",
        action="append",
        default=[],
        metavar="USER",
        help="a user name (system:serviceaccount:<namespace>:<name>) whose tokens for this "
        "node's audience may checkpoint, restore and read /capability and /metrics, checked "
        "with a TokenReview; repeatable. Needs API access (in-cluster or --kubeconfig)",
    )
    parser.add_argument(
        "--metrics-reader",
        action="append",
        default=[],
        metavar="USER",
        help="a user name whose ordinary ServiceAccount token may read /metrics (a "
        "Prometheus); with --operator only; repeatable",
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        default=None,
        help="instead of --operator, where the agent cannot reach the API server: a file "
        "holding one static bearer token for every node; without either, the endpoints that "
        "act or probe are disabled and /metrics is open",
    )
    parser.add_argument(
        "--tls-cert-file",
        type=Path,
        default=None,
        help="the HTTPS certificate (PEM); with --tls-key-file. Default: a self-signed "
        "certificate made at start, naming the node and $HOST_IP",
    )
    parser.add_argument("--tls-key-file", type=Path, default=None, help="its private key (PEM)")
    parser.add_argument(
        "--plain-http",
        action="store_true",
        help="serve plain HTTP: only for an agent bound to loopback in a test; tokens "
        "would travel in clear text",
    )
    parser.add_argument(
        "--storage-root",
        type=_absolute_path,
        default=DEFAULT_STORAGE_ROOT,
        help="the only directory tree checkpoint images are written to and restored from: "
        "a request's imagesDir must resolve (symlinks followed) inside it; mount the "
        f"workers' checkpoint storage here (default: {DEFAULT_STORAGE_ROOT}, a worker's "
        "default checkpoint.storage.path)",
    )
    parser.add_argument(
        "--kubeconfig",
        default=None,
        help="read this node's pods for namespace and name labels with this kubeconfig "
        "(default: the in-cluster config inside a pod, else no names: pod UIDs only)",
    )
    parser.add_argument("--criu", default="criu", help="the criu command (default: criu)")
    parser.add_argument(
        "--proc", type=Path, default=Path("/proc"), help="the host's /proc (default: /proc)"
    )
    parser.add_argument(
        "--capability-ttl",
        type=_seconds,
        default=300.0,
        help="seconds a capability probe is reused (default: 300)",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    parser.set_defaults(func=run)
    return parser


def settings_from_args(args: argparse.Namespace) -> AgentSettings:
    """Return the agent's settings from the parsed flags; reads the token file."""
    from sessionfleet.agent.server import AgentSettings

    token = args.token_file.read_text().strip() if args.token_file else None
    if args.token_file and not token:
        raise ValueError(f"{args.token_file} is empty")
    if args.operator and args.token_file:
        raise ValueError("--operator and --token-file exclude each other: choose one")
    if args.metrics_reader and not args.operator:
        raise ValueError("--metrics-reader needs --operator (TokenReview)")
    if (args.tls_cert_file is None) != (args.tls_key_file is None):
        raise ValueError("--tls-cert-file and --tls-key-file go together")
    host_ip = os.environ.get("HOST_IP", "")
    return AgentSettings(
        node=args.node_name or os.environ.get("NODE_NAME") or socket.gethostname(),
        host=args.host,
        port=args.port,
        interval=args.interval,
        capability_ttl=args.capability_ttl,
        token=token,
        operators=frozenset(args.operator),
        metrics_readers=frozenset(args.metrics_reader),
        tls_cert_file=args.tls_cert_file,
        tls_key_file=args.tls_key_file,
        plain_http=args.plain_http,
        addresses=(host_ip,) if host_ip else (),
        proc=args.proc,
        criu=args.criu,
        storage_root=args.storage_root,
    )


def _kube(kubeconfig: str | None) -> Kube | None:
    """Return a Kube client when one can be configured, else ``None`` (pod UIDs only)."""
    from sessionfleet.kube import Kube, KubeConfig

    if kubeconfig is None and not os.environ.get("KUBERNETES_SERVICE_HOST"):
        return None
    try:
        return Kube(KubeConfig.load(kubeconfig), user_agent="sessionfleet-agent")
    except Exception as error:  # the kubernetes loader raises many kinds
        logging.getLogger(__name__).warning(
            "no Kubernetes access (%s): process metrics carry pod UIDs only", error
        )
        return None


def run(args: argparse.Namespace) -> int:
    """Run the ``agent`` subcommand; return the exit status."""
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # The server's dependencies are imported only when it runs.
    from sessionfleet.agent.server import Agent, serve

    try:
        settings = settings_from_args(args)
    except (OSError, ValueError) as error:
        print(f"agent: {error}", file=sys.stderr)
        return 2

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        kube = _kube(args.kubeconfig)
        if settings.operators and kube is None:
            print(
                "agent: --operator needs access to the API server for TokenReviews "
                "(in-cluster, or --kubeconfig)",
                file=sys.stderr,
            )
            return 2
        return await serve(Agent(settings, kube=kube), stop)

    try:
        # Non-zero when a background loop died: Kubernetes then restarts the agent.
        return asyncio.run(main())
    except OSError as error:
        print(f"agent: cannot serve on {args.host}:{args.port}: {error}", file=sys.stderr)
        return 1
