"""``sessionfleet router``: run the session-aware OpenAI-compatible router."""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sessionfleet.cliargs import non_negative_float, positive_float, positive_int
from sessionfleet.fronts.options import (
    add_body_limit_arguments,
    add_fleet_arguments,
    default_namespace,
    lease_slots_from_args,
)
from sessionfleet.router.limits import (
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_INFLIGHT_HEADER_BYTES,
)

if TYPE_CHECKING:
    from sessionfleet.router.server import RouterSettings

DESCRIPTION = """\
An OpenAI-compatible reverse proxy that keeps each agent session on its worker.
Turns are recognised by the configured session header or the ones Claude Code, Codex
and OpenCode send; a session's first turn is placed on a Ready InferenceWorker and
recorded as an AgentSession; later turns go to that worker with no API call; usage is
written to the session's status in coalesced patches. See docs/router.md.
"""


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """Add the ``router`` subcommand to ``commands`` (an argparse subparsers object)."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "router",
        help="run the session-aware OpenAI-compatible router",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (default: 0.0.0.0)")
    parser.add_argument("--port", type=int, default=8080, help="port to bind (default: 8080)")
    add_fleet_arguments(parser)
    timing = parser.add_argument_group("timing")
    timing.add_argument(
        "--flush-interval",
        type=positive_float,
        default=10.0,
        help="seconds between usage writes to one session's status (default: 10)",
    )
    timing.add_argument(
        "--flush-writes-per-second",
        type=positive_float,
        default=50.0,
        help="most usage writes started per second, all sessions together (default: 50)",
    )
    timing.add_argument(
        "--hold-timeout",
        type=positive_float,
        default=30.0,
        help="seconds a turn of a Migrating or Restoring session waits before a 503 (default: 30)",
    )
    timing.add_argument(
        "--retry-after",
        type=positive_int,
        default=5,
        help="Retry-After seconds on 503 answers (default: 5)",
    )
    timing.add_argument(
        "--sync-timeout",
        type=positive_float,
        default=10.0,
        help="seconds a request waits for the bindings to load at start (default: 10)",
    )
    timing.add_argument(
        "--create-timeout",
        type=positive_float,
        default=5.0,
        help="seconds a first turn waits to record its session (default: 5)",
    )
    timing.add_argument(
        "--connect-timeout",
        type=positive_float,
        default=5.0,
        help="seconds to connect to a worker (default: 5)",
    )
    timing.add_argument(
        "--read-timeout",
        type=positive_float,
        default=600.0,
        help="seconds without a byte from a worker before giving up (default: 600)",
    )
    limits = parser.add_argument_group("limits (docs/router.md, Limits)")
    add_body_limit_arguments(limits)
    limits.add_argument(
        "--max-header-bytes",
        type=positive_int,
        default=DEFAULT_MAX_HEADER_BYTES,
        help="largest request line and headers together, 431 beyond it (default: 32 KiB)",
    )
    limits.add_argument(
        "--max-inflight-header-bytes",
        type=positive_int,
        default=DEFAULT_MAX_INFLIGHT_HEADER_BYTES,
        help="bytes of request headers held at once (arriving, queued or in progress), "
        "503 beyond it (default: 16 MiB)",
    )
    limits.add_argument(
        "--body-timeout",
        type=positive_float,
        default=30.0,
        help="seconds for a request body to arrive, 408 beyond it (default: 30)",
    )
    limits.add_argument(
        "--idle-timeout",
        type=positive_float,
        default=30.0,
        help="seconds for a connection to send a request's headers, or to stay idle "
        "between requests, before it is closed (default: 30)",
    )
    limits.add_argument(
        "--max-connections",
        type=positive_int,
        default=4096,
        help="open client connections; a new one beyond it is answered 503 (default: 4096)",
    )
    limits.add_argument(
        "--new-sessions-per-client",
        type=non_negative_float,
        default=20.0,
        help="new sessions a second one client may open, 429 beyond it; 0: no limit (default: 20)",
    )
    limits.add_argument(
        "--new-sessions-burst-per-client",
        type=non_negative_float,
        default=40.0,
        help="new sessions one client may open at once after a quiet time (default: 40)",
    )
    limits.add_argument(
        "--new-sessions-per-second",
        type=non_negative_float,
        default=200.0,
        help="new sessions a second, all clients together; 0: no limit (default: 200)",
    )
    limits.add_argument(
        "--trusted-proxy",
        action="append",
        default=[],
        metavar="CIDR",
        help="a network of proxies (a gateway, a load balancer) whose X-Forwarded-For "
        "names the client that new sessions count against; repeatable or comma-separated; "
        "default: none, the peer address counts (with API keys on, the client's name)",
    )
    limits.add_argument(
        "--new-sessions-burst",
        type=non_negative_float,
        default=400.0,
        help="new sessions at once, all clients together (default: 400)",
    )
    parser.add_argument(
        "--api-keys-dir",
        type=Path,
        default=None,
        help="require an API key: a folder with one file per client, the file's name "
        "the client's, its content the key (a mounted Secret); default: no authentication",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    parser.set_defaults(func=run)
    return parser


def settings_from_args(args: argparse.Namespace) -> RouterSettings:
    """Return the router's settings from the parsed flags."""
    from sessionfleet.fronts.admission import SessionRates
    from sessionfleet.fronts.identity import HeaderConfig
    from sessionfleet.fronts.requester import TrustedProxies, parse_networks
    from sessionfleet.router.limits import IntakeLimits
    from sessionfleet.router.proxy import RouterConfig
    from sessionfleet.router.server import RouterSettings

    return RouterSettings(
        namespace=args.namespace or default_namespace(),
        replica=args.replica or os.environ.get("POD_NAME") or socket.gethostname(),
        lease_slots=lease_slots_from_args(args, "router"),
        config=RouterConfig(
            headers=HeaderConfig(args.session_header, args.parent_header, args.final_header),
            hold_timeout=args.hold_timeout,
            retry_after=args.retry_after,
            sync_timeout=args.sync_timeout,
            intake=IntakeLimits(
                max_body_bytes=args.max_body_bytes,
                max_inflight_body_bytes=args.max_inflight_body_bytes,
                body_timeout=args.body_timeout,
                max_header_bytes=args.max_header_bytes,
                max_inflight_header_bytes=args.max_inflight_header_bytes,
            ),
            session_rates=SessionRates(
                per_client=args.new_sessions_per_client,
                per_client_burst=args.new_sessions_burst_per_client,
                total=args.new_sessions_per_second,
                total_burst=args.new_sessions_burst,
            ),
            trusted_proxies=TrustedProxies(parse_networks(args.trusted_proxy)),
        ),
        flush_interval=args.flush_interval,
        flush_writes_per_second=args.flush_writes_per_second,
        create_timeout=args.create_timeout,
        connect_timeout=args.connect_timeout,
        read_timeout=args.read_timeout,
        api_keys_dir=args.api_keys_dir,
        max_connections=args.max_connections,
        idle_timeout=args.idle_timeout,
    )


def run(args: argparse.Namespace) -> int:
    """Run the ``router`` subcommand; return the exit status."""
    # Imported here so that other subcommands start without aiohttp and httpx.
    from sessionfleet.kube.service import run_service
    from sessionfleet.router.server import serve

    return run_service(
        "router",
        args,
        settings_from_args,
        lambda kube, settings: serve(kube, settings, args.host, args.port),
        lambda settings: f"sessionfleet-router/{settings.replica}",
    )
