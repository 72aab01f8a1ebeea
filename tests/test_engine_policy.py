"""The engine fence: one NetworkPolicy per worker, admitting only the configured peers."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sessionfleet.api import InferenceWorker
from sessionfleet.api.labels import SPEC_HASH_ANNOTATION, WORKER_LABEL
from sessionfleet.resources.networkpolicies import build_engine_policy, parse_peers, spec_hash

ROUTERS = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "sessionfleet"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/component": "router"}},
}
GATEWAY = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kgateway"}}}


def worker(**spec: Any) -> InferenceWorker:
    return InferenceWorker.model_validate(
        {
            "metadata": {"name": "qwen-a", "namespace": "team-a", "uid": "u-1"},
            "spec": {"model": "Qwen/Qwen3-32B", **spec},
        }
    )


def test_the_policy_selects_the_workers_pods_and_admits_only_the_peers_to_the_engine() -> None:
    policy = build_engine_policy(worker(engine={"port": 8011}), [ROUTERS, GATEWAY])
    assert policy["apiVersion"] == "networking.k8s.io/v1" and policy["kind"] == "NetworkPolicy"
    meta = policy["metadata"]
    assert (meta["name"], meta["namespace"]) == ("qwen-a-engine", "team-a")
    assert meta["labels"][WORKER_LABEL] == "qwen-a"  # what the operator's index selects
    (owner,) = meta["ownerReferences"]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("InferenceWorker", "u-1", True)
    assert policy["spec"] == {
        "podSelector": {"matchLabels": {WORKER_LABEL: "qwen-a"}},
        "policyTypes": ["Ingress"],
        "ingress": [{"from": [ROUTERS, GATEWAY], "ports": [{"protocol": "TCP", "port": 8011}]}],
    }
    assert meta["annotations"][SPEC_HASH_ANNOTATION] == spec_hash(policy["spec"])


def test_the_hash_follows_the_spec_not_the_key_order() -> None:
    one = build_engine_policy(worker(), [ROUTERS])
    reordered = build_engine_policy(worker(), [dict(reversed(list(ROUTERS.items())))])
    assert one["metadata"]["annotations"] == reordered["metadata"]["annotations"]
    moved = build_engine_policy(worker(engine={"port": 9000}), [ROUTERS])
    more = build_engine_policy(worker(), [ROUTERS, GATEWAY])
    hashes = {p["metadata"]["annotations"][SPEC_HASH_ANNOTATION] for p in (one, moved, more)}
    assert len(hashes) == 3  # a new port or a new peer is a write


def test_peers_parse_from_the_flag() -> None:
    assert parse_peers(json.dumps([ROUTERS, GATEWAY])) == (ROUTERS, GATEWAY)
    assert parse_peers('[{"ipBlock": {"cidr": "10.0.0.0/8"}}]') == (
        {"ipBlock": {"cidr": "10.0.0.0/8"}},
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not json", "not JSON"),
        ("[]", "non-empty JSON list"),
        ('{"podSelector": {}}', "non-empty JSON list"),
        ('[{"podSelectr": {}}]', "is not a NetworkPolicyPeer"),
        ("[{}]", "is not a NetworkPolicyPeer"),
        ('["router"]', "is not a NetworkPolicyPeer"),
    ],
)
def test_bad_peers_are_refused_with_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_peers(text)


def test_the_operator_refuses_bad_peers_as_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from sessionfleet.cli import build_parser

    parsed = build_parser().parse_args(["operator", f"--engine-peers={json.dumps([ROUTERS])}"])
    assert parsed.engine_peers == (ROUTERS,)
    assert build_parser().parse_args(["operator"]).engine_peers == ()  # off by default
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["operator", '--engine-peers=[{"podSelectr": {}}]'])
    assert exit_info.value.code == 2
    assert "is not a NetworkPolicyPeer" in capsys.readouterr().err
