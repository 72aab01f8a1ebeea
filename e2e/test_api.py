"""The sessionfleet API as the real API server serves it.

CRDs from ``crds/`` must establish; every manifest in ``examples/`` must be accepted
and every one in ``examples/invalid/`` rejected by the API server (schema and CEL
rules) with the message named by its ``sessionfleet.dev/expect-error`` annotation;
``kubectl get sessionfleet`` shows the printer columns; status is written only
through the status subresource. The files are globbed, so new ones are tested as
they are added.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from e2e.helpers import CRDS_DIR, EXAMPLES_DIR, Kubectl, load_documents, wait_until

pytestmark = pytest.mark.timeout(120)

EXPECT_ERROR_ANNOTATION = "sessionfleet.dev/expect-error"
CATEGORY = "sessionfleet"
FIELD_MANAGER = "sessionfleet-e2e"

CRD_FILES = sorted(CRDS_DIR.glob("*.yaml"))
EXAMPLE_FILES = sorted(EXAMPLES_DIR.glob("*.yaml"))
INVALID_FILES = sorted((EXAMPLES_DIR / "invalid").glob("*.yaml"))


def _first_example_of_each_kind() -> dict[str, dict[str, Any]]:
    examples: dict[str, dict[str, Any]] = {}
    for path in EXAMPLE_FILES:
        for doc in load_documents(path):
            examples.setdefault(doc["kind"], doc)
    return examples


EXAMPLE_BY_KIND = _first_example_of_each_kind()


def _in_namespace(docs: list[dict[str, Any]]) -> str:
    """YAML of ``docs`` without their own namespace, so ``-n`` decides where they go."""
    for doc in docs:
        doc.get("metadata", {}).pop("namespace", None)
    return yaml.safe_dump_all(docs)


def _served_version(crd: dict[str, Any]) -> dict[str, Any]:
    versions = crd["spec"]["versions"]
    return next((v for v in versions if v.get("storage")), versions[0])


@dataclass
class AppliedCrds:
    """The CRDs of crds/ as applied: those Established, and why the others are not."""

    established: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    def require(self, kind: str) -> dict[str, Any]:
        """The CRD of ``kind``; fails the calling test when it did not establish."""
        if kind not in self.established:
            reason = self.errors.get(kind, f"no CRD in {CRDS_DIR} defines kind {kind}")
            pytest.fail(f"{kind}: {reason}", pytrace=False)
        return self.established[kind]


def _crd_documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in load_documents(path) if doc.get("kind") == "CustomResourceDefinition"]


ALL_KINDS = sorted(
    crd["spec"]["names"]["kind"] for path in CRD_FILES for crd in _crd_documents(path)
)


@pytest.fixture(scope="session")
def crds(api: Any, kubectl: Kubectl) -> AppliedCrds:
    """Apply each CRD file of crds/ and wait until its CRDs are Established.

    Files are applied one by one so that one the API server rejects fails only the
    tests of its kinds. Server-side apply is idempotent, so xdist workers sharing a
    cluster may all run this.
    """
    if not CRD_FILES:
        pytest.fail(f"no CRD manifests in {CRDS_DIR}", pytrace=False)
    extensions: Any = client.ApiextensionsV1Api(api)
    applied = AppliedCrds()
    for path in CRD_FILES:
        result = kubectl(
            "apply",
            "--server-side",
            "--force-conflicts",
            f"--field-manager={FIELD_MANAGER}",
            f"--filename={path}",
            check=False,
        )
        for crd in _crd_documents(path):
            kind = crd["spec"]["names"]["kind"]
            if result.returncode != 0:
                applied.errors[kind] = f"the API server rejected {path.name}: {result.stderr}"
                continue
            name = crd["metadata"]["name"]

            def established(crd_name: str = name) -> bool:
                conditions = extensions.read_custom_resource_definition(crd_name).status.conditions
                return any(c.type == "Established" and c.status == "True" for c in conditions or [])

            wait_until(established, timeout=30, what=f"CRD {name} Established")
            applied.established[kind] = crd
    return applied


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_crd_is_established_in_the_sessionfleet_category(kind: str, crds: AppliedCrds) -> None:
    crd = crds.require(kind)
    assert CATEGORY in crd["spec"]["names"].get("categories", [])
    assert "status" in _served_version(crd).get("subresources", {})


def test_every_kind_has_an_example() -> None:
    assert ALL_KINDS, f"no CustomResourceDefinition in {CRDS_DIR}"
    missing = sorted(set(ALL_KINDS) - set(EXAMPLE_BY_KIND))
    assert not missing, f"no manifest in {EXAMPLES_DIR} for: {', '.join(missing)}"


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda path: path.name)
def test_example_is_accepted(
    path: Path, crds: AppliedCrds, namespace: str, kubectl: Kubectl
) -> None:
    docs = load_documents(path)
    for doc in docs:
        crds.require(doc["kind"])
    result = kubectl(
        "apply",
        "--server-side",
        f"--field-manager={FIELD_MANAGER}",
        "--namespace",
        namespace,
        "--filename=-",
        input=_in_namespace(docs),
        check=False,
    )
    assert result.returncode == 0, f"{path.name} rejected: {result.stderr}"


@pytest.mark.parametrize("path", INVALID_FILES, ids=lambda path: path.name)
def test_invalid_example_is_rejected_by_the_api_server(
    path: Path, crds: AppliedCrds, namespace: str, kubectl: Kubectl
) -> None:
    for doc in load_documents(path):
        expected = doc.get("metadata", {}).get("annotations", {}).get(EXPECT_ERROR_ANNOTATION)
        assert expected, f"{path.name}: no {EXPECT_ERROR_ANNOTATION} annotation"
        # Without its CRD the object would be refused for the wrong reason.
        crds.require(doc["kind"])
        result = kubectl(
            "create",
            "--namespace",
            namespace,
            "--filename=-",
            input=_in_namespace([doc]),
            check=False,
        )
        assert result.returncode != 0, f"{path.name} was accepted"
        assert expected in result.stderr, (
            f"{path.name}: rejected, but the message lacks {expected!r}: {result.stderr}"
        )


def test_kubectl_get_sessionfleet_prints_the_printer_columns(
    crds: AppliedCrds, namespace: str, kubectl: Kubectl
) -> None:
    # Kinds whose CRD failed are reported by their own tests.
    docs = [
        doc
        for path in EXAMPLE_FILES
        for doc in load_documents(path)
        if doc["kind"] in crds.established
    ]
    assert docs, "no example of an established kind"
    kubectl(
        "apply",
        "--server-side",
        f"--field-manager={FIELD_MANAGER}",
        "--namespace",
        namespace,
        "--filename=-",
        input=_in_namespace(docs),
    )
    output = kubectl("get", CATEGORY, "--namespace", namespace).stdout
    headers = "\n".join(line for line in output.splitlines() if line.startswith("NAME "))
    for kind in sorted({doc["kind"] for doc in docs}):
        for column in _served_version(crds.established[kind]).get("additionalPrinterColumns", []):
            assert column["name"].upper() in headers, f"{kind}: column {column['name']}\n{output}"
    for column in ("NAME", "MODEL", "PHASE", "AGE"):
        assert column in headers, f"column {column} missing:\n{output}"


@pytest.mark.parametrize("kind", sorted(EXAMPLE_BY_KIND))
def test_status_is_written_only_through_the_status_subresource(
    kind: str, crds: AppliedCrds, custom: Any, namespace: str
) -> None:
    crd = crds.require(kind)
    group, plural = crd["spec"]["group"], crd["spec"]["names"]["plural"]
    version = _served_version(crd)["name"]
    body = _in_namespace([dict(EXAMPLE_BY_KIND[kind])])
    created = custom.create_namespaced_custom_object(
        group, version, namespace, plural, yaml.safe_load(body)
    )
    name = created["metadata"]["name"]
    marker = 4242

    # A status change in an ordinary update is dropped by the API server.
    current = custom.get_namespaced_custom_object(group, version, namespace, plural, name)
    current["status"] = {**(current.get("status") or {}), "observedGeneration": marker}
    updated = custom.replace_namespaced_custom_object(
        group, version, namespace, plural, name, current
    )
    assert (updated.get("status") or {}).get("observedGeneration") != marker

    # The same change through /status is stored.
    patched = custom.patch_namespaced_custom_object_status(
        group,
        version,
        namespace,
        plural,
        name,
        {"status": {"observedGeneration": marker}},
        _content_type="application/merge-patch+json",
    )
    assert patched["status"]["observedGeneration"] == marker
    stored = custom.get_namespaced_custom_object(group, version, namespace, plural, name)
    assert stored["status"]["observedGeneration"] == marker
