"""The NetworkPolicy that fences a worker's engine port: a pure builder.

A worker's engine serves what no client of the fleet should reach: vLLM in development
mode (criu workers) serves ``/pause``, ``/sleep`` and ``/collective_rpc``, and the
simulated engine's ``/sim/cache/export`` writes where it is told. One NetworkPolicy per
worker, in the worker's namespace and owned by it, admits to the engine port only the
peers the operator is configured with (``--engine-peer``: the routers, the gateway's
proxies, the operator itself, the node agent); every other port of the pod is closed.
A policy per worker rather than one per namespace from the chart: workers live in any
namespace, which the chart cannot know in advance.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

from sessionfleet.api import InferenceWorker
from sessionfleet.api.labels import SPEC_HASH_ANNOTATION, WORKER_LABEL
from sessionfleet.resources.pods import owner_reference, worker_labels

NETWORK_POLICY_API_VERSION: Final = "networking.k8s.io/v1"
NAME_SUFFIX: Final = "-engine"


def engine_policy_name(worker: str) -> str:
    """Return the name of a worker's engine NetworkPolicy."""
    return f"{worker}{NAME_SUFFIX}"


def spec_hash(spec: Mapping[str, Any]) -> str:
    """Return a short digest of a spec: equal specs, equal digests, whatever the key order."""
    canonical = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def build_engine_policy(
    worker: InferenceWorker, peers: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """Return the NetworkPolicy admitting only ``peers`` to the worker's engine port.

    ``peers`` are NetworkPolicyPeer objects (podSelector, namespaceSelector, ipBlock).
    The policy selects the worker's pods of every epoch by the worker label; with
    ``policyTypes: [Ingress]`` and one rule, any other source or port is refused.
    Egress is left alone: an engine may need to fetch its model.
    """
    name = worker.metadata.name
    spec: dict[str, Any] = {
        "podSelector": {"matchLabels": {WORKER_LABEL: name}},
        "policyTypes": ["Ingress"],
        "ingress": [
            {
                "from": [dict(peer) for peer in peers],
                "ports": [{"protocol": "TCP", "port": worker.spec.engine.port}],
            }
        ],
    }
    return {
        "apiVersion": NETWORK_POLICY_API_VERSION,
        "kind": "NetworkPolicy",
        "metadata": {
            "name": engine_policy_name(name),
            "namespace": worker.metadata.namespace,
            "labels": worker_labels(worker),
            "annotations": {SPEC_HASH_ANNOTATION: spec_hash(spec)},
            "ownerReferences": [owner_reference(worker)],
        },
        "spec": spec,
    }


def parse_peers(text: str) -> tuple[dict[str, Any], ...]:
    """Parse ``--engine-peers``: a JSON list of NetworkPolicyPeer objects.

    Raises :class:`ValueError` with what is wrong, for the command line to report.
    """
    try:
        peers = json.loads(text)
    except ValueError as error:
        raise ValueError(f"not JSON: {error}") from None
    if not isinstance(peers, list) or not peers:
        raise ValueError("a non-empty JSON list of NetworkPolicyPeer objects is needed")
    known = {"podSelector", "namespaceSelector", "ipBlock"}
    for peer in peers:
        if not isinstance(peer, dict) or not peer or not set(peer) <= known:
            raise ValueError(
                f"{json.dumps(peer)} is not a NetworkPolicyPeer (podSelector, "
                "namespaceSelector, ipBlock)"
            )
    return tuple(peers)
