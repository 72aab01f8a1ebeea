"""Every GitOps manifest shipped in examples/ and deploy/ is valid.

tests/test_examples.py covers the top level of examples/; this covers the folders
below it (the platform DrainPolicies; the gateway examples, against the operator's
worker pods) and the kustomize and Argo CD files, whose
rendering with helm and kubectl is checked in e2e/test_chart.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from sessionfleet.api import KINDS_BY_NAME, DrainPolicy, parse, parse_duration

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
DEPLOY = REPO / "deploy"


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


# examples/gateway/ holds Gateway API and GAIE kinds, not sessionfleet's: checked below.
GATEWAY = EXAMPLES / "gateway"
NESTED_EXAMPLES = sorted(
    path
    for path in EXAMPLES.rglob("*.yaml")
    if path.parent != EXAMPLES
    and not {"invalid", "gateway"} & set(path.relative_to(EXAMPLES).parts)
)


def test_platform_drain_policies_are_there() -> None:
    names = {path.stem for path in (EXAMPLES / "drainpolicies").glob("*.yaml")}
    assert {"eks", "aks", "gke", "karpenter", "spot"} <= names


@pytest.mark.parametrize("path", NESTED_EXAMPLES, ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_nested_example_is_valid_against_the_models(path: Path) -> None:
    docs = documents(path)
    assert docs, path
    for doc in docs:
        result = parse(KINDS_BY_NAME[doc["kind"]], doc)
        assert result.ok, f"{path}: {result.message}"


def policy(name: str) -> DrainPolicy:
    (doc,) = documents(EXAMPLES / "drainpolicies" / f"{name}.yaml")
    result = parse(DrainPolicy, doc)
    assert result.ok and isinstance(result.obj, DrainPolicy), result.message
    return result.obj


@pytest.mark.parametrize(
    ("name", "platform_limit_minutes"),
    [("eks", 15), ("aks", 30), ("gke", 60), ("karpenter", 60)],
)
def test_deadline_fits_inside_the_platforms_window(name: str, platform_limit_minutes: int) -> None:
    spec = policy(name).spec
    deadline = parse_duration(spec.deadline).total_seconds()
    assert deadline < platform_limit_minutes * 60
    assert spec.on_deadline.value == "Release", "release before the platform forces the drain"


def test_karpenter_policy_reacts_to_its_taint_and_holds_with_its_annotation() -> None:
    spec = policy("karpenter").spec
    assert "karpenter.sh/disrupted" in spec.triggers.taints
    assert "KarpenterDoNotDisrupt" in {h.value for h in spec.holds}


def test_spot_policy_migrates_at_once_inside_two_minutes() -> None:
    spec = policy("spot").spec
    assert spec.mode.value == "Migrate"
    assert parse_duration(spec.deadline).total_seconds() < 120
    assert spec.checkpoint


def gateway_example(name: str, kind: str) -> dict[str, Any]:
    (doc,) = [doc for doc in documents(GATEWAY / name) if doc["kind"] == kind]
    return doc


def test_inference_pool_selects_the_pods_the_operator_makes_on_the_engine_port() -> None:
    from sessionfleet.api import InferenceWorker
    from sessionfleet.resources.pods import build_pod

    pool = gateway_example("inferencepool.yaml", "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    (worker_doc,) = documents(EXAMPLES / "inferenceworker.yaml")
    result = parse(InferenceWorker, worker_doc)
    assert result.ok and isinstance(result.obj, InferenceWorker), result.message
    pod = build_pod(result.obj, epoch=3)
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    (engine,) = pod["spec"]["containers"]
    assert pool["spec"]["targetPorts"] == [{"number": engine["ports"][0]["containerPort"]}]
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["failureMode"] == "FailClose"
    assert ref.get("kind", "Service") == "Service" and "namespace" not in ref


def test_http_route_sends_to_the_inference_pool() -> None:
    pool = gateway_example("inferencepool.yaml", "InferencePool")
    route = gateway_example("httproute.yaml", "HTTPRoute")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    backends = [ref for rule in route["spec"]["rules"] for ref in rule["backendRefs"]]
    assert backends == [
        {
            "group": "inference.networking.k8s.io",
            "kind": "InferencePool",
            "name": pool["metadata"]["name"],
        }
    ]


def test_kustomize_files_are_kubernetes_objects() -> None:
    for path in sorted((DEPLOY / "kustomize").rglob("*.yaml")):
        for doc in documents(path):
            assert doc.get("apiVersion") and doc.get("kind"), path


def test_kustomize_base_carries_the_generated_crds() -> None:
    rendered = {
        doc["metadata"]["name"]: doc
        for doc in documents(DEPLOY / "kustomize" / "base" / "sessionfleet.yaml")
        if doc["kind"] == "CustomResourceDefinition"
    }
    committed = {
        doc["metadata"]["name"]: doc
        for path in sorted((REPO / "crds").glob("*.yaml"))
        for doc in documents(path)
    }
    assert set(rendered) == set(committed)
    for name, crd in committed.items():
        assert rendered[name]["spec"] == crd["spec"], (
            f"{name}: run `make crds` with helm built (`make e2e-tools`)"
        )


def test_kustomize_base_runs_the_operator_but_not_the_router() -> None:
    kinds = {
        (doc["kind"], doc["metadata"]["name"])
        for doc in documents(DEPLOY / "kustomize" / "base" / "sessionfleet.yaml")
    }
    assert ("Deployment", "sessionfleet-operator") in kinds
    assert not any(name.endswith("-router") for _, name in kinds)
    component = DEPLOY / "kustomize" / "components" / "router" / "router.yaml"
    router = {doc["kind"] for doc in documents(component)}
    # With the admission policy that limits the router's Lease creates to its slots.
    assert router == {
        "ServiceAccount",
        "Deployment",
        "Service",
        "Role",
        "RoleBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }
