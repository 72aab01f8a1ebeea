"""``sessionfleet epp``: run the Endpoint Picker for the Gateway API Inference Extension."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import TYPE_CHECKING, Any

from sessionfleet.cliargs import non_negative_float, positive_float, positive_int
from sessionfleet.fronts.options import (
    add_body_limit_arguments,
    add_fleet_arguments,
    default_namespace,
    lease_slots_from_args,
)

if TYPE_CHECKING:
    from sessionfleet.epp.server import EppSettings, Listeners

DESCRIPTION = """\
An Envoy ext_proc v3 gRPC server implementing the Gateway API Inference Extension's
Endpoint Picker protocol: it names the InferenceWorker that holds each agent session
(x-gateway-destination-endpoint), from the AgentSession bindings held in memory, and
records new sessions and their usage as the router does. Work in progress: docs/epp.md.
"""

_MODES = ("NONE", "STREAMED", "BUFFERED", "BUFFERED_PARTIAL", "FULL_DUPLEX_STREAMED")


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """Add the ``epp`` subcommand to ``commands`` (an argparse subparsers object)."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "epp",
        help="run the Endpoint Picker (Envoy ext_proc) for the Gateway API Inference Extension",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (default: 0.0.0.0)")
    parser.add_argument(
        "--port", type=int, default=9002, help="gRPC port (ext_proc and health; default: 9002)"
    )
    parser.add_argument(
        "--health-port",
        type=int,
        default=9003,
        help="plaintext gRPC health port for Kubernetes' probes, which cannot speak TLS; "
        "0: none (default: 9003)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=9090,
        help="Prometheus metrics port; 0: none (default: 9090)",
    )
    parser.add_argument(
        "--secure-serving",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve ext_proc over TLS, as gateways connect (default: on; "
        "--no-secure-serving serves plaintext)",
    )
    parser.add_argument(
        "--cert-path",
        default=None,
        help="a directory with tls.crt and tls.key (a mounted Secret), read again when they "
        "change (default: a self-signed certificate made at start)",
    )
    add_fleet_arguments(parser)
    parser.add_argument(
        "--hold-timeout",
        type=non_negative_float,
        default=0.0,
        help="seconds a request of a Migrating or Restoring session waits before a 503 with "
        "Retry-After; raise Envoy's ext_proc message_timeout above it (default: 0, answer at once)",
    )
    parser.add_argument(
        "--retry-after",
        type=positive_int,
        default=5,
        help="Retry-After seconds on 503 answers (default: 5)",
    )
    parser.add_argument(
        "--fallbacks",
        type=int,
        default=0,
        help="fallback endpoints after the first, for new sessions and stateless requests; "
        "only a data plane that reads an endpoint list (Envoy's override-host load "
        "balancer) can use them (default: 0, one endpoint, docs/gateway.md)",
    )
    parser.add_argument(
        "--request-body-mode",
        choices=_MODES,
        default="FULL_DUPLEX_STREAMED",
        help="the request body mode assumed when Envoy does not announce it "
        "(default: FULL_DUPLEX_STREAMED, with the mode probe)",
    )
    parser.add_argument(
        "--mode-probe-seconds",
        type=non_negative_float,
        default=0.1,
        help="with no announced mode and FULL_DUPLEX_STREAMED assumed: how long to wait for "
        "a body after the headers before deciding at the headers, as a gateway waiting "
        "for their answer needs; keep it under the gateway's message timeout (Envoy: "
        "200 ms); 0: never (default: 0.1)",
    )
    add_body_limit_arguments(parser)
    parser.add_argument(
        "--response-body-mode",
        choices=_MODES,
        default="FULL_DUPLEX_STREAMED",
        help="the response body mode assumed when Envoy does not announce it "
        "(default: FULL_DUPLEX_STREAMED)",
    )
    parser.add_argument(
        "--flush-interval",
        type=positive_float,
        default=10.0,
        help="seconds between usage writes to one session's status (default: 10)",
    )
    parser.add_argument(
        "--pool-name",
        default=None,
        help="the InferencePool (inference.networking.k8s.io/v1, in --namespace) this EPP "
        "serves: only the workers whose pods it selects are named, at its first target "
        "port (default: every InferenceWorker of the namespace, at its own endpoint)",
    )
    parser.add_argument(
        "--unobserved-turn-seconds",
        type=positive_float,
        default=120.0,
        help="how long a turn counts as in flight when the gateway ends the stream before "
        "the response (NGINX Gateway Fabric), unless the session's next turn comes first "
        "(default: 120)",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    parser.set_defaults(func=run)
    return parser


def settings_from_args(args: argparse.Namespace) -> EppSettings:
    """Return the EPP's settings from the parsed flags."""
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2

    from sessionfleet.epp.picker import PickerConfig
    from sessionfleet.epp.protocol import ExchangeSettings
    from sessionfleet.epp.server import EppSettings
    from sessionfleet.fronts.identity import HeaderConfig

    if args.fallbacks < 0:
        raise ValueError("--fallbacks must not be negative")
    if args.max_inflight_body_bytes < args.max_body_bytes:
        raise ValueError("--max-inflight-body-bytes must be at least --max-body-bytes")
    modes = processing_mode_pb2.ProcessingMode.BodySendMode
    return EppSettings(
        namespace=args.namespace or default_namespace(),
        replica=args.replica or os.environ.get("POD_NAME") or socket.gethostname(),
        lease_slots=lease_slots_from_args(args, "epp"),
        picker=PickerConfig(
            headers=HeaderConfig(args.session_header, args.parent_header, args.final_header),
            fallbacks=args.fallbacks,
            retry_after=args.retry_after,
        ),
        exchange=ExchangeSettings(
            request_body_mode=modes.Value(args.request_body_mode),
            response_body_mode=modes.Value(args.response_body_mode),
            max_body_bytes=args.max_body_bytes,
            retry_after=args.retry_after,
        ),
        hold_timeout=args.hold_timeout,
        flush_interval=args.flush_interval,
        pool_name=args.pool_name or None,
        unobserved_turn_seconds=args.unobserved_turn_seconds,
        mode_probe_seconds=args.mode_probe_seconds,
        max_inflight_body_bytes=args.max_inflight_body_bytes,
    )


def run(args: argparse.Namespace) -> int:
    """Run the ``epp`` subcommand; return the exit status."""
    try:
        from sessionfleet.epp.server import serve
    except ImportError as error:
        print(f"epp: install the epp extra (sessionfleet[epp]): {error}", file=sys.stderr)
        return 2
    from sessionfleet.kube.service import run_service

    return run_service(
        "epp",
        args,
        settings_from_args,
        lambda kube, settings: serve(kube, settings, listeners_from_args(args)),
        lambda settings: f"sessionfleet-epp/{settings.replica}",
    )


def listeners_from_args(args: argparse.Namespace) -> Listeners:
    """Return where and how the EPP listens, from the parsed flags."""
    from sessionfleet.epp.server import Listeners

    return Listeners(
        host=args.host,
        port=args.port,
        health_port=args.health_port,
        metrics_port=args.metrics_port,
        secure=args.secure_serving,
        cert_path=args.cert_path or None,
    )
