"""The example ValidatingAdmissionPolicy on InferenceWorkers, in the real API server.

deploy/admission/inferenceworker-pods.yaml is what docs/install.md tells a cluster admin
to apply so that "may create an InferenceWorker" no longer means "may create any pod".
Applied as shipped (its names suffixed, its binding narrowed to this test's namespace so
that concurrent tests are untouched), each rule refuses a worker that breaks it with the
policy's message, and an ordinary worker is admitted.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import pytest

from e2e.chart import REPO_ROOT
from e2e.helpers import Kubectl, load_documents, wait_until
from e2e.operator import sim_worker

pytestmark = pytest.mark.timeout(180)

POLICY = REPO_ROOT / "deploy" / "admission" / "inferenceworker-pods.yaml"


def policy_for(namespace: str) -> tuple[list[dict[str, Any]], str]:
    """The shipped documents, scoped to ``namespace``; and the policy's name."""
    suffix = secrets.token_hex(3)
    documents = load_documents(POLICY)
    by_kind = {d["kind"]: d for d in documents}
    policy = by_kind["ValidatingAdmissionPolicy"]
    binding = by_kind["ValidatingAdmissionPolicyBinding"]
    name = f"{policy['metadata']['name']}-{suffix}"
    policy["metadata"]["name"] = name
    binding["metadata"]["name"] = name
    binding["spec"]["policyName"] = name
    binding["spec"]["matchResources"] = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
    }
    return documents, name


def create(kubectl: Kubectl, namespace: str, body: dict[str, Any]) -> Any:
    return kubectl(
        "create", f"--namespace={namespace}", "-f", "-", input=json.dumps(body), check=False
    )


def test_the_example_policy_refuses_each_rule_and_admits_an_ordinary_worker(
    kubectl: Kubectl, namespace: str, crds_installed: None
) -> None:
    documents, name = policy_for(namespace)
    kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": documents}),
    )
    try:
        hostpath = {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}
        # The API server loads a new policy within a moment: until it refuses, it is not
        # in force yet.
        denied = f"ValidatingAdmissionPolicy '{name}' with binding '{name}' denied request"
        probes = iter(range(1000))
        wait_until(
            lambda: (
                denied
                in create(
                    kubectl, namespace, sim_worker(f"probe-{next(probes)}", template=hostpath)
                ).stderr
            ),
            timeout=30,
            what="the policy in force",
        )
        broken = {
            "host-path": (
                {"template": hostpath},
                "spec.template.volumes may hold only emptyDir, persistentVolumeClaim and "
                "configMap volumes",
            ),
            "a-secret": (
                {"template": {"volumes": [{"name": "s", "secret": {"secretName": "tls"}}]}},
                "spec.template.volumes may hold only",
            ),
            "any-image": (
                {"engine": {"type": "sim", "image": "docker.io/someone/engine:1"}},
                "spec.engine.image docker.io/someone/engine:1 is not under an allowed registry: "
                "ghcr.io/sessionfleet/, registry.example.com/inference/",
            ),
            "look-alike": (
                {"engine": {"type": "sim", "image": "registry.example.com.evil.io/inference/x"}},
                "is not under an allowed registry",
            ),
            "admin-account": (
                {"template": {"serviceAccountName": "admin"}},
                "spec.template.serviceAccountName admin is not allowed; allowed: inference-worker",
            ),
            "critical": (
                {"template": {"priorityClassName": "system-node-critical"}},
                "spec.template.priorityClassName must not be a system-* PriorityClass",
            ),
        }
        for worker_name, (spec, message) in broken.items():
            result = create(kubectl, namespace, sim_worker(worker_name, **spec))
            assert result.returncode != 0, f"{worker_name} was admitted"
            assert denied in result.stderr and message in result.stderr, result.stderr
            assert "Forbidden" in result.stderr

        # An ordinary worker, and one using what the rules allow, are admitted.
        ordinary = create(kubectl, namespace, sim_worker("ordinary"))
        assert ordinary.returncode == 0, ordinary.stderr
        allowed = sim_worker(
            "allowed",
            engine={"type": "sim", "image": "registry.example.com/inference/sim:1"},
            template={
                "serviceAccountName": "inference-worker",
                "volumes": [
                    {"name": "scratch", "emptyDir": {}},
                    {"name": "models", "persistentVolumeClaim": {"claimName": "models"}},
                ],
            },
        )
        admitted = create(kubectl, namespace, allowed)
        assert admitted.returncode == 0, admitted.stderr
        # An update is held to the same rules.
        patched = kubectl(
            "patch",
            "inferenceworker",
            "ordinary",
            f"--namespace={namespace}",
            "--type=merge",
            "-p",
            json.dumps({"spec": {"template": hostpath}}),
            check=False,
        )
        assert patched.returncode != 0 and "spec.template.volumes may hold only" in patched.stderr
        # Fields the InferenceWorker schema lacks never reach the pod: refused outright.
        host_network = sim_worker("host-network", template={"hostNetwork": True})
        unknown = create(kubectl, namespace, host_network)
        assert unknown.returncode != 0 and 'unknown field "spec.template.hostNetwork"' in (
            unknown.stderr
        )
    finally:
        for kind in ("validatingadmissionpolicybinding", "validatingadmissionpolicy"):
            kubectl("delete", kind, name, "--ignore-not-found", check=False)
