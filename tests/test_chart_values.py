"""The chart's values, schema, README and generated CRD templates agree (no helm needed).

Rendering the chart with the real ``helm`` binary is tested in ``e2e/test_chart*.py``,
which runs after ``make e2e-tools`` has built helm.
"""

from __future__ import annotations

import re
from copy import deepcopy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from chart_values import (
    CHART,
    README,
    VALUES,
    all_paths,
    documented_values,
    readme_table,
    readme_with_table,
    value_at,
)

from sessionfleet._version import __version__
from sessionfleet.api import (
    KINDS_BY_NAME,
    DeadlineAction,
    DrainMode,
    DrainPolicySpec,
    HoldMechanism,
    MigrationScope,
)
from sessionfleet.api.crd import structural_schema
from sessionfleet.api.crd_templates import chart_crd_template, render_chart_crds

VALUES_TEXT = VALUES.read_text()
DEFAULTS = yaml.safe_load(VALUES_TEXT)
SCHEMA = yaml.safe_load((CHART / "values.schema.json").read_text())
DOCS = {doc.path: doc for doc in documented_values(VALUES_TEXT)}
PASS_THROUGH = ("#/definitions/kubernetesObject", "#/definitions/kubernetesList")


def validate(values: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(SCHEMA)
    return [
        f"/{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator.iter_errors(values)
    ]


# --- values.yaml documentation --------------------------------------------------------


def test_every_value_is_documented_with_prose_and_an_example() -> None:
    undocumented = [
        path
        for path in all_paths(DEFAULTS)
        if path not in DOCS
        # A section (image, operator, ...) is documented through its values; an
        # object-valued value (resources, podSecurityContext) covers its own keys.
        and not any(doc.startswith(f"{path}.") for doc in DOCS)
        and not any(path.startswith(f"{doc}.") for doc in DOCS)
    ]
    assert undocumented == []
    for doc in DOCS.values():
        assert len(doc.description.split()) >= 3, f"{doc.path}: say what it does in prose"
        assert doc.description[0].isupper() and doc.description.endswith("."), doc.path
        assert doc.example, f"{doc.path}: add an `# Example:` line"


def test_documented_paths_exist() -> None:
    for path in DOCS:
        value_at(DEFAULTS, path)  # KeyError names a comment with no value under it


def test_examples_are_yaml_that_the_schema_accepts() -> None:
    for doc in DOCS.values():
        example = yaml.safe_load(doc.example)
        values = deepcopy(DEFAULTS)
        *parents, leaf = doc.path.split(".")
        node = values
        for key in parents:
            node = node[key]
        node[leaf] = example
        assert validate(values) == [], f"{doc.path}: example {doc.example!r}"


def test_readme_table_is_generated_from_values() -> None:
    readme = README.read_text()
    assert readme == readme_with_table(readme, readme_table(VALUES_TEXT)), (
        "the values table of charts/sessionfleet/README.md is stale: run `make chart-docs`"
    )
    for path in DOCS:
        assert f"| `{path}` |" in readme


def test_documentation_parser_reads_nested_blocks() -> None:
    text = (
        "# header, not a value\n\n"
        "a:\n"
        "  # -- The first value.\n"
        "  # Example: 2\n"
        "  b: 1\n"
        "  c:\n"
        "    # -- A list value,\n"
        "    # on two lines.\n"
        "    # Example: [x]\n"
        "    d:\n"
        "      - y\n"
        "# -- Top level.\n"
        "# Example: true\n"
        "e: false\n"
    )
    docs = documented_values(text)
    assert [(d.path, d.description, d.example) for d in docs] == [
        ("a.b", "The first value.", "2"),
        ("a.c.d", "A list value, on two lines.", "[x]"),
        ("e", "Top level.", "true"),
    ]
    assert '| `a.c.d` | `["y"]` |' in readme_table(text)


# --- values.schema.json -----------------------------------------------------------------


def test_defaults_meet_the_schema() -> None:
    assert validate(DEFAULTS) == []


def _object_nodes(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        if node.get("type") == "object":
            found.append((path or "<root>", node))
        for key, child in node.items():
            found += _object_nodes(child, f"{path}/{key}")
    elif isinstance(node, list):
        for index, child in enumerate(node):
            found += _object_nodes(child, f"{path}/{index}")
    return found


def test_every_object_level_closes_additional_properties() -> None:
    open_objects = [
        path
        for path, node in _object_nodes(SCHEMA)
        if node.get("additionalProperties", True) is True
        and not path.endswith(("/kubernetesObject",))
    ]
    assert open_objects == [], "set additionalProperties: false (or a value schema)"
    # Kubernetes structures the API server validates are the only pass-through, and
    # are named as such.
    refs = re.findall(r'"\$ref": "([^"]+)"', (CHART / "values.schema.json").read_text())
    assert {r for r in refs if "kubernetes" in r} <= set(PASS_THROUGH)


def test_schema_describes_exactly_the_values() -> None:
    def schema_paths(node: dict[str, Any], prefix: str = "") -> set[str]:
        out: set[str] = set()
        for key, child in node.get("properties", {}).items():
            path = f"{prefix}.{key}" if prefix else key
            out.add(path)
            target = child
            if "$ref" in child:
                target = SCHEMA["definitions"][child["$ref"].rsplit("/", 1)[-1]]
            if target.get("additionalProperties") is False:
                out |= schema_paths(target, path)
        return out

    value_paths = {
        p
        for p in all_paths(DEFAULTS)
        if not any(p.startswith(f"{d}.") for d in DOCS)  # inside an object-valued value
    }
    # Map-valued values (labels, nodeSelector, resources.requests) have free keys.
    described = schema_paths(SCHEMA)
    assert value_paths - described == set()
    assert described - set(all_paths(DEFAULTS)) == set(), "schema names a value that is not there"


@pytest.mark.parametrize(
    ("change", "where"),
    [
        ({"operator": {"replicaz": 2}}, "/operator"),
        ({"crds": {"enabeld": False}}, "/crds"),
        ({"router": {"service": {"type": "Ingress"}}}, "/router/service/type"),
        ({"operator": {"idleTimeout": "30 minutes"}}, "/operator/idleTimeout"),
        ({"image": {"digest": "latest"}}, "/image/digest"),
        ({"operator": {"watchNamespaces": ["Not_A_Namespace"]}}, "/operator/watchNamespaces/0"),
        ({"defaultDrainPolicy": {"spec": {"mode": "Sometimes"}}}, "/defaultDrainPolicy/spec/mode"),
        ({"defaultDrainPolicy": {"spec": {"holdz": []}}}, "/defaultDrainPolicy/spec"),
        ({"agent": {"privileged": True}}, "/agent"),
    ],
)
def test_schema_rejects_typos_and_bad_values(change: dict[str, Any], where: str) -> None:
    def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
        out = deepcopy(base)
        for key, value in extra.items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = merge(out[key], value)
            else:
                out[key] = value
        return out

    errors = validate(merge(DEFAULTS, change))
    assert any(e.startswith(f"{where}:") for e in errors), errors


# --- the default DrainPolicy follows the API ----------------------------------------------


def test_default_drain_policy_values_are_the_models_defaults() -> None:
    assert DEFAULTS["defaultDrainPolicy"]["spec"] == DrainPolicySpec().wire()


def test_default_drain_policy_schema_matches_the_crd() -> None:
    crd_spec = structural_schema(KINDS_BY_NAME["DrainPolicy"])["properties"]["spec"]
    values_spec = SCHEMA["properties"]["defaultDrainPolicy"]["properties"]["spec"]
    assert set(values_spec["properties"]) == set(crd_spec["properties"])
    assert set(values_spec["properties"]["triggers"]["properties"]) == set(
        crd_spec["properties"]["triggers"]["properties"]
    )
    enums = {
        "mode": DrainMode,
        "onDeadline": DeadlineAction,
        "migrationScope": MigrationScope,
    }
    for field, enum in enums.items():
        assert values_spec["properties"][field]["enum"] == [m.value for m in enum]
    assert values_spec["properties"]["holds"]["items"]["enum"] == [m.value for m in HoldMechanism]


# --- Chart.yaml and the generated CRD templates -------------------------------------------


def test_chart_app_version_is_the_package_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == __version__
    assert chart["name"] == "sessionfleet"


def test_committed_chart_crd_templates_match_the_models() -> None:
    folder = CHART / "templates" / "crds"
    assert {p.name for p in folder.glob("*.yaml")} == set(render_chart_crds())
    for name, text in render_chart_crds().items():
        assert (folder / name).read_text() == text, f"{name} drifts: run `make crds`"


def test_chart_crd_template_keeps_the_spec_and_escapes_braces() -> None:
    crd = (
        "# generated\n"
        "apiVersion: apiextensions.k8s.io/v1\n"
        "kind: CustomResourceDefinition\n"
        "metadata:\n"
        "  name: things.example.dev\n"
        "  labels:\n"
        "    app.kubernetes.io/part-of: sessionfleet\n"
        "spec:\n"
        "  group: example.dev\n"
        "  description: use {{ braces }} literally\n"
    )
    template = chart_crd_template(crd)
    assert template.startswith("{{- /*")
    assert "{{- if .Values.crds.enabled }}" in template
    assert template.rstrip().endswith("{{- end }}")
    assert '  description: use {{ "{{" }} braces }} literally\n' in template
    assert "    app.kubernetes.io/part-of: sessionfleet\n" in template
    assert 'include "sessionfleet.crdAnnotations"' in template
    with pytest.raises(ValueError, match="not a generated CRD"):
        chart_crd_template("apiVersion: v1\nkind: ConfigMap\ndata: {}\n")


# --- RBAC templates explain themselves ------------------------------------------------------


@pytest.mark.parametrize("template", ["operator/rbac.yaml", "router/rbac.yaml"])
def test_every_rbac_rule_has_a_reason_and_no_wildcard(template: str) -> None:
    lines = (CHART / "templates" / template).read_text().splitlines()
    rules = [i for i, line in enumerate(lines) if line.lstrip().startswith("- apiGroups:")]
    assert rules, template
    for index in rules:
        assert lines[index - 1].lstrip().startswith("#"), f"{template}:{index + 1}: say why"
    granted = set()
    for line in lines:
        key, _, value = line.strip().partition(":")
        if key in ("resources", "verbs", "- apiGroups"):
            granted |= {item.strip(" \"'") for item in value.strip(" []").split(",")}
    assert "*" not in granted
    # Secrets only for the operator's checkpoint key (docs/checkpoints.md, Provenance): a
    # create, which cannot be scoped by name, and a get of that one Secret by name.
    secret_rules = [i for i, line in enumerate(lines) if line.strip() == "resources: [secrets]"]
    if template == "operator/rbac.yaml":
        assert len(secret_rules) == 2, template
        for index in secret_rules:
            following = [line.strip() for line in lines[index + 1 : index + 3]]
            assert following[0] == "verbs: [create]" or (
                following[0].startswith("resourceNames: [") and following[1] == "verbs: [get]"
            ), f"{template}:{index + 1}: {following}"
        granted.discard("secrets")
    forbidden = {"secrets", "configmaps", "pods/exec", "nodes/proxy", "escalate", "bind"}
    assert granted & forbidden == set()
    assert {"list", "watch", "patch"} <= granted


def test_values_mention_the_agent_is_a_preview() -> None:
    assert DEFAULTS["agent"]["enabled"] is False
    assert "PREVIEW" in DOCS["agent.enabled"].description


def test_schema_file_is_json_with_a_draft() -> None:
    assert SCHEMA["$schema"].startswith("http://json-schema.org/draft-07")
    assert Path(CHART / "values.schema.json").read_text().endswith("\n")
