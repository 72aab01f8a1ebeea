"""Small helpers shared by the e2e tests: bounded waits and manifests."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from e2e.localcluster import BACKED_LABEL, GPU_RESOURCE, gpu_pod_tolerations

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parents[1]
#: Where the CRDs and example manifests are read from. Setting it tests another
#: directory holding crds/ and examples/ (a scratch API while developing the suite).
API_ROOT = Path(os.environ.get("SESSIONFLEET_E2E_API_ROOT", REPO_ROOT))
CRDS_DIR = API_ROOT / "crds"
EXAMPLES_DIR = API_ROOT / "examples"

#: ``LocalCluster.kubectl``: ``kubectl("get", "pods", check=False, input=None)``.
Kubectl = Callable[..., subprocess.CompletedProcess[str]]


def wait_until(
    check: Callable[[], T | None], *, timeout: float, what: str, interval: float = 0.1
) -> T:
    """Poll ``check`` until it returns something truthy, and return that.

    Raises:
        AssertionError: after ``timeout`` seconds, naming ``what`` and the last value
            or exception seen, so a failing test says what it waited for.
    """
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            result = check()
        except Exception as error:  # reported if the wait times out
            last = error
        else:
            if result:
                return result
            last = result
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"timed out after {timeout:.0f} s waiting for {what}; last: {last!r}"
            )
        time.sleep(interval)


def load_documents(path: Path) -> list[dict[str, Any]]:
    """All non-empty YAML documents of a file."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def gpu_pod(
    name: str,
    *,
    gpus: int = 1,
    command: list[str] | None = None,
    args: list[str] | None = None,
    backed: bool = False,
    labels: dict[str, str] | None = None,
    extra_container: dict[str, Any] | None = None,
    extra_spec: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A pod for a fake GPU node; ``backed`` adds the pod backer's opt-in label.

    ``POD_IP`` is always in the environment (downward API), the way the worker pod
    builder passes ``--host=$(POD_IP)`` to the engine.
    """
    container: dict[str, Any] = {
        "name": "main",
        "image": "registry.invalid/e2e:never-pulled",
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "resources": {"limits": {GPU_RESOURCE: str(gpus)}} if gpus else {},
    }
    if command:
        container["command"] = command
    if args:
        container["args"] = args
    container.update(extra_container or {})
    all_labels = {"app": name, **(labels or {})}
    if backed:
        all_labels[BACKED_LABEL] = "true"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": all_labels},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 5,
            "tolerations": gpu_pod_tolerations(),
            "containers": [container],
            **(extra_spec or {}),
        },
    }


CUT_CONNECTIONS_LEAK = pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <ssl.SSLSocket:pytest.PytestUnraisableExceptionWarning"
)
"""For the tests that break the API server's connections under their own clients on
purpose (killed, paused, cut): the Kubernetes client can then leave a broken TLS socket
to the garbage collector, which e2e/conftest.py makes a failure everywhere else. Only
that warning, and only in those modules (e2e/README.md, "Leaks")."""


def wait_established(kubectl: Kubectl, *crds: str, timeout: float = 60) -> None:
    """Wait until the CRDs that ``crds`` selects (names, or ``-l`` and a label) are Established.

    Not ``kubectl wait --for=condition=Established``: a CRD created a moment ago has no
    ``status.conditions`` yet, and kubectl then fails at once instead of waiting
    ("accessor error: <nil> is of the type <nil>"), as it did once in CI.
    """

    def established() -> bool:
        listing = kubectl("get", "crd", *crds, "-o", "json", check=False)
        if listing.returncode != 0:
            return False
        found = json.loads(listing.stdout)
        items = found.get("items", [found]) if found.get("kind") == "List" else [found]
        return bool(items) and all(
            any(
                c.get("type") == "Established" and c.get("status") == "True"
                for c in (item.get("status") or {}).get("conditions") or ()
            )
            for item in items
        )

    wait_until(established, timeout=timeout, what=f"CRDs {' '.join(crds)} Established")


@contextmanager
def exclusive(lock_file: Path, *, timeout: float) -> Iterator[float]:
    """Hold an exclusive lock on ``lock_file`` (across processes); yield the seconds waited.

    Raises:
        AssertionError: when another process holds it for longer than ``timeout``.
    """
    started = time.monotonic()
    with lock_file.open("a") as handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - started > timeout:
                    raise AssertionError(
                        f"{lock_file} held by another process for over {timeout:.0f} s"
                    ) from None
                time.sleep(0.5)
        try:
            yield time.monotonic() - started
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


VLLM_LANE_WAIT = 400.0
"""The longest a test waits for another's real vLLM engines (one such test lasts ~150 s)."""


@contextmanager
def one_vllm_lane_at_a_time() -> Iterator[float]:
    """Hold the machine's one real-vLLM lane (across xdist workers and runs); yield the wait.

    A vLLM engine's start keeps a core busy for about 20 s. Two tests starting three
    engines at once on 2 cores starved an operator of CPU past its Lease's 10 s renew
    deadline: a leader that cannot renew exits, and the test failed (a `make test` run
    of 2026-12-01). One test at a time starts at most two.
    """
    from e2e.localcluster._vllm import vllm_root

    root = vllm_root()
    root.mkdir(parents=True, exist_ok=True)
    with exclusive(root / "e2e-lane.lock", timeout=VLLM_LANE_WAIT) as waited:
        yield waited


def namespace_admission_policy(
    name: str, namespace: str, rule: dict[str, Any], validations: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """A ValidatingAdmissionPolicy and its Deny binding, for requests in one namespace only.

    ``rule`` is one of its ``matchConstraints.resourceRules``; apply both with
    ``kubectl apply`` (they are cluster-scoped: delete them when done).
    """
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [rule]},
            "validations": validations,
        },
    }
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {
            "policyName": name,
            "validationActions": ["Deny"],
            "matchResources": {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
            },
        },
    }
    return [policy, binding]
