"""The command line of the local cluster: ``up``, ``down``, ``status``, ``run``.

``up`` starts a detached cluster (default state dir ``.e2e-state/``) and prints the
``export KUBECONFIG=...`` line; ``down`` stops it; ``status`` reports it; ``run``
starts an owned cluster, runs a command with ``KUBECONFIG`` and
``SESSIONFLEET_E2E_KUBECONFIG`` set to it, and stops the cluster however the command
ends.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import FrameType

from ._cluster import (
    DEFAULT_STATE_DIR,
    ENV_KUBECONFIG,
    ClusterError,
    ClusterState,
    LocalCluster,
)
from ._components import Layout
from ._process import is_running
from ._tools import ToolsMissingError


def _up(args: argparse.Namespace) -> int:
    cluster = LocalCluster.start(
        args.state_dir, owned=False, gpu_nodes=args.gpu_nodes, gpus_per_node=args.gpus_per_node
    )
    print(f"export KUBECONFIG={cluster.kubeconfig}")
    return 0


def _down(args: argparse.Namespace) -> int:
    state_file = Layout(args.state_dir).state_file
    if not state_file.is_file():
        print(f"no cluster recorded in {args.state_dir}; nothing to stop", file=sys.stderr)
        return 0
    cluster = LocalCluster.from_state_dir(args.state_dir)
    cluster.stop(remove_state=False)
    print(
        f"cluster in {args.state_dir} stopped (logs kept in {cluster.layout.logs})", file=sys.stderr
    )
    return 0


def _status(args: argparse.Namespace) -> int:
    state_file = Layout(args.state_dir).state_file
    if not state_file.is_file():
        print(f"down: no cluster recorded in {args.state_dir}")
        return 1
    state = ClusterState.load(state_file)
    running = 0
    for record in state.processes:
        alive = is_running(record)
        running += alive
        print(
            f"{record.name:<24} pid {record.pid:<8} {'running' if alive else 'EXITED'}  "
            f"log {record.log}"
        )
    print(f"API server {state.api_server}; started in {state.startup_seconds} s")
    print(f"export KUBECONFIG={Layout(args.state_dir).kubeconfig}")
    return 0 if running == len(state.processes) else 1


def _run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("run: give a command after --", file=sys.stderr)
        return 2
    cluster = LocalCluster.start(gpu_nodes=args.gpu_nodes, gpus_per_node=args.gpus_per_node)
    env = {
        **os.environ,
        "KUBECONFIG": str(cluster.kubeconfig),
        ENV_KUBECONFIG: str(cluster.kubeconfig),
    }
    try:
        child = subprocess.Popen(command, env=env)

        def forward(signum: int, frame: FrameType | None) -> None:
            child.send_signal(signum)

        # The child shares our terminal, so Ctrl-C reaches it directly; SIGTERM and
        # SIGHUP are forwarded so it can clean up before the cluster goes.
        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGHUP, forward)
        while True:
            try:
                returncode = child.wait()
                break
            except KeyboardInterrupt:
                continue  # the child got the same SIGINT; wait for it to finish
    except BaseException:
        cluster.stop()
        raise
    # Keep the logs of a failed run: they are what explains it.
    cluster.stop(remove_state=False if returncode != 0 else None)
    if returncode != 0:
        print(f"localcluster: logs kept in {cluster.layout.logs}", file=sys.stderr)
    return returncode


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and run one subcommand; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["backer"]:
        # Internal: how the harness starts the pod backer (see _cluster.py).
        from .backer import main as backer_main

        backer_main(argv[1:])
        return 0
    parser = argparse.ArgumentParser(prog="python e2e/localcluster", description=__doc__)
    commands = parser.add_subparsers(dest="action", required=True)
    for name, help_text in (
        ("up", "start a detached cluster and print the KUBECONFIG export line"),
        ("down", "stop the cluster recorded in the state dir"),
        ("status", "show the cluster's processes; exit 1 unless all run"),
    ):
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument(
            "--state-dir",
            type=Path,
            default=DEFAULT_STATE_DIR,
            help=f"cluster state directory (default {DEFAULT_STATE_DIR})",
        )
    run = commands.add_parser("run", help="run a command against a fresh, owned cluster")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    for sub in (commands.choices["up"], run):
        sub.add_argument("--gpu-nodes", type=int, default=3)
        sub.add_argument("--gpus-per-node", type=int, default=4)
    args = parser.parse_args(argv)
    if hasattr(args, "state_dir"):
        args.state_dir = args.state_dir.resolve()
    handlers = {"up": _up, "down": _down, "status": _status, "run": _run}
    try:
        return handlers[args.action](args)
    except (ClusterError, ToolsMissingError) as error:
        print(f"localcluster: {error}", file=sys.stderr)
        return 1
