"""The flags both fronts take: where the bindings live, who this replica is, the headers.

The router (:mod:`sessionfleet.router.cli`) and the Endpoint Picker
(:mod:`sessionfleet.epp.cli`) each add these to their own parser.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Final

from sessionfleet.cliargs import positive_int
from sessionfleet.resources.leases import DEFAULT_SLOTS, LeaseSlots

DEFAULT_MAX_BODY_BYTES: Final = 8 << 20
"""8 MiB. A 200K-token conversation is about 0.8 MB of JSON (4 bytes a token, 700 KB
measured for 180K tokens); escaping, tool schemas and a few images fit under 8 MiB."""
DEFAULT_MAX_INFLIGHT_BODY_BYTES: Final = 192 << 20
"""192 MiB: 24 maximum-size bodies at once, within the router chart's 512 MiB memory limit."""
NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def default_namespace() -> str:
    """Return the pod's namespace in a cluster, else ``default``."""
    try:
        return NAMESPACE_FILE.read_text().strip() or "default"
    except OSError:
        return "default"


def add_fleet_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the flags the router and the Endpoint Picker share.

    Where the bindings live, who this replica is, and which headers carry a session.
    """
    parser.add_argument(
        "--namespace",
        default=None,
        help="namespace of the InferenceWorkers and AgentSessions (default: the pod's, or default)",
    )
    parser.add_argument(
        "--kubeconfig",
        default=None,
        help="kubeconfig file (default: in-cluster config in a pod, else $KUBECONFIG)",
    )
    parser.add_argument(
        "--replica",
        default=None,
        help="this replica's name, recorded on sessions it creates (default: $POD_NAME or host)",
    )
    parser.add_argument(
        "--lease-prefix",
        default=None,
        help="the replicas hold the Leases <prefix>-0 … <prefix>-<slots-1>, one each, so "
        "that their Role can name them (default: router, or epp)",
    )
    parser.add_argument(
        "--lease-slots",
        type=positive_int,
        default=DEFAULT_SLOTS,
        help=f"how many such Leases; more than the replicas ever running at once "
        f"(default: {DEFAULT_SLOTS})",
    )
    headers = parser.add_argument_group("session headers")
    headers.add_argument(
        "--session-header",
        default="X-Session-Id",
        help="header with the session id (default: X-Session-Id); the "
        "Claude Code, Codex and OpenCode headers are recognised as well",
    )
    headers.add_argument(
        "--parent-header",
        default="X-Parent-Session-Id",
        help="header with the parent session id (default: X-Parent-Session-Id)",
    )
    headers.add_argument(
        "--final-header",
        default="X-Session-Final",
        help="header marking a session's last turn (default: X-Session-Final)",
    )


def lease_slots_from_args(args: argparse.Namespace, default_prefix: str) -> LeaseSlots:
    """Return the slot Leases the replica picks its own from."""
    return LeaseSlots(args.lease_prefix or default_prefix, args.lease_slots)


def add_body_limit_arguments(group: Any) -> None:
    """Add ``--max-body-bytes`` and ``--max-inflight-body-bytes`` to a parser or group.

    One limit per front, the same flags and defaults in both: a body over the first is
    answered 413, and bodies held at once over the second 503 with Retry-After.
    """
    group.add_argument(
        "--max-body-bytes",
        type=positive_int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest request body accepted, 413 beyond it (default: 8 MiB, a 200K-token "
        "context with room to spare)",
    )
    group.add_argument(
        "--max-inflight-body-bytes",
        type=positive_int,
        default=DEFAULT_MAX_INFLIGHT_BODY_BYTES,
        help="bytes of request bodies held at once, 503 beyond it (default: 192 MiB)",
    )
