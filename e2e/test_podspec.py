"""The pod backer's kubelet rules, as pure functions (no cluster needed)."""

from __future__ import annotations

from typing import Any

import pytest

from e2e.localcluster._podspec import (
    PodSpecError,
    container_argv,
    container_env,
    expand,
    readiness_probe,
)

pytestmark = pytest.mark.timeout(10)

POD: dict[str, Any] = {
    "metadata": {"name": "w-0", "namespace": "ns", "uid": "u-1", "labels": {"app": "w"}},
    "spec": {"nodeName": "gpu-node-0", "serviceAccountName": "default"},
    "status": {"podIP": "127.1.0.7", "hostIP": "127.0.0.1"},
}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("--host=$(POD_IP)", "--host=127.1.0.7"),
        ("$(POD_IP):$(PORT)", "127.1.0.7:8000"),
        ("$$(POD_IP)", "$(POD_IP)"),
        ("$(MISSING)", "$(MISSING)"),
        ("cost $5", "cost $5"),
        ("$(unclosed", "$(unclosed"),
        ("$$$(PORT)", "$8000"),
        ("trailing $", "trailing $"),
    ],
)
def test_expand_follows_kubernetes_rules(text: str, expected: str) -> None:
    assert expand(text, {"POD_IP": "127.1.0.7", "PORT": "8000"}) == expected


def test_env_resolves_in_order_with_field_refs_and_config_maps() -> None:
    container = {
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "URL", "value": "http://$(POD_IP):$(PORT)"},  # PORT not defined yet
            {"name": "PORT", "value": "8000"},
            {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
            {"name": "MODEL", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "model"}}},
            {
                "name": "OPT",
                "valueFrom": {"secretKeyRef": {"name": "s", "key": "k", "optional": True}},
            },
        ]
    }
    refs = {("ConfigMap", "ns", "cfg", "model"): "llama"}
    env = container_env(POD, container, lambda kind, ns, name, key: refs.get((kind, ns, name, key)))
    assert env == {
        "POD_IP": "127.1.0.7",
        "URL": "http://127.1.0.7:$(PORT)",
        "PORT": "8000",
        "APP": "w",
        "MODEL": "llama",
    }


def test_missing_required_config_map_key_is_an_error() -> None:
    container = {
        "env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}]
    }
    with pytest.raises(PodSpecError, match="no key"):
        container_env(POD, container, lambda *_: None)


def test_argv_expands_command_and_args_and_needs_a_command() -> None:
    container = {"command": ["engine", "--host=$(POD_IP)"], "args": ["--port", "$(PORT)"]}
    assert container_argv(container, {"POD_IP": "127.1.0.7", "PORT": "9"}) == [
        "engine",
        "--host=127.1.0.7",
        "--port",
        "9",
    ]
    with pytest.raises(PodSpecError, match="command"):
        container_argv({"args": ["x"]}, {})


def test_readiness_probe_resolves_named_ports_against_the_pod_ip() -> None:
    container = {
        "ports": [{"name": "http", "containerPort": 8000}],
        "readinessProbe": {"httpGet": {"path": "health", "port": "http"}},
    }
    probe = readiness_probe(POD, container)
    assert probe is not None and probe.url == "http://127.1.0.7:8000/health"
    assert readiness_probe(POD, {"readinessProbe": {"exec": {"command": ["true"]}}}) is None
