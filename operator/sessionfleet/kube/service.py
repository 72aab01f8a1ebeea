"""Run a long-lived service against the API server from a subcommand: the common frame.

The router and the Endpoint Picker start alike: log to stderr at the chosen level,
turn the flags into settings (a ValueError is a usage error, status 2), load the
Kubernetes configuration (a failure is status 2), then serve until stopped (an address
that cannot be bound is status 1).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import TypeVar

from sessionfleet.kube.client import Kube
from sessionfleet.kube.config import KubeConfig

Settings = TypeVar("Settings")


def run_service(
    command: str,
    args: argparse.Namespace,
    settings_from_args: Callable[[argparse.Namespace], Settings],
    serve: Callable[[Kube, Settings], Awaitable[int]],
    user_agent: Callable[[Settings], str],
) -> int:
    """Run ``serve`` with a client built from ``args``; return the exit status."""
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        settings = settings_from_args(args)
    except ValueError as error:
        print(f"{command}: {error}", file=sys.stderr)
        return 2
    try:
        kube_config = KubeConfig.load(args.kubeconfig)
    except Exception as error:  # the kubernetes loader raises many kinds
        print(f"{command}: cannot load the Kubernetes configuration: {error}", file=sys.stderr)
        return 2

    async def main() -> int:
        return await serve(Kube(kube_config, user_agent=user_agent(settings)), settings)

    try:
        return asyncio.run(main())
    except OSError as error:
        print(f"{command}: cannot serve on {args.host}:{args.port}: {error}", file=sys.stderr)
        return 1
