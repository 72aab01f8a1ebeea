"""The generated CRDs: structural, complete, and faithful to the models."""

from __future__ import annotations

import types
import typing
from copy import deepcopy
from typing import Any, Union

import pytest
from conftest import VALID
from pydantic import BaseModel

from sessionfleet.api import KINDS, KINDS_BY_NAME
from sessionfleet.api._common import ApiModel
from sessionfleet.api.crd import (
    crd_manifest,
    render_crds,
    schema_paths,
    structural_schema,
    structural_violations,
)

KIND_IDS = [m.info.kind for m in KINDS]


@pytest.mark.parametrize("model", KINDS, ids=KIND_IDS)
def test_schema_is_structural(model: type[Any]) -> None:
    assert structural_violations(structural_schema(model)) == []


@pytest.mark.parametrize(
    ("schema", "problem"),
    [
        ({"type": "object", "properties": {"a": {"description": "x"}}}, ".a: node has no type"),
        ({"type": "object", "properties": {"a": {"$ref": "#/x"}}}, "'$ref' is not allowed"),
        (
            {"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}]}}},
            "'anyOf' is not allowed",
        ),
        ({"type": "object", "properties": {"a": {"type": "array"}}}, "array without items"),
        (
            {"type": "object", "properties": {"a": {"type": "string", "nullable": True}}},
            "nullable",
        ),
        (
            {"type": "object", "additionalProperties": False, "properties": {}},
            "additionalProperties must be a schema",
        ),
    ],
)
def test_checker_finds_non_structural_schemas(schema: dict[str, Any], problem: str) -> None:
    problems = structural_violations(schema, ".x")
    assert any(problem in p for p in problems), problems


def test_checker_requires_plain_metadata_at_the_root() -> None:
    schema = {"type": "object", "properties": {"metadata": {"type": "object", "properties": {}}}}
    assert "<root>.metadata: must be only {type: object}" in structural_violations(schema)


def test_int_or_string_and_open_objects_need_no_type() -> None:
    schema = {
        "type": "object",
        "properties": {
            "metadata": {"type": "object"},
            "q": {"x-kubernetes-int-or-string": True},
            "v": {"x-kubernetes-preserve-unknown-fields": True},
        },
    }
    assert structural_violations(schema) == []


@pytest.mark.parametrize("model", KINDS, ids=KIND_IDS)
def test_crd_names_categories_and_status_subresource(model: type[Any]) -> None:
    crd = crd_manifest(model)
    names = crd["spec"]["names"]
    assert crd["metadata"]["name"] == f"{names['plural']}.sessionfleet.dev"
    assert "sessionfleet" in names["categories"]
    assert names["shortNames"]
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}


@pytest.mark.parametrize("model", KINDS, ids=KIND_IDS)
def test_printer_columns_point_at_schema_fields(model: type[Any]) -> None:
    crd = crd_manifest(model)
    (version,) = crd["spec"]["versions"]
    known = set(schema_paths(version["schema"]["openAPIV3Schema"])) | {
        ".metadata.creationTimestamp"
    }
    for column in version["additionalPrinterColumns"]:
        assert column["jsonPath"] in known, column


@pytest.mark.parametrize(
    ("kind", "headers"),
    [
        ("AgentSession", ["Model", "Worker", "Phase", "Turns", "Hit%", "Age"]),
        ("InferenceWorker", ["Model", "Phase", "Node", "Sessions", "KV%", "Epoch", "Age"]),
    ],
)
def test_printer_columns_the_issue_names(kind: str, headers: list[str]) -> None:
    (version,) = crd_manifest(KINDS_BY_NAME[kind])["spec"]["versions"]
    assert [c["name"] for c in version["additionalPrinterColumns"]] == headers


# --- CEL rules: every rule a model declares is on the matching schema node ----------


def _model_types(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models inside an annotation such as ``list[X] | None``."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType, list, dict, typing.Annotated):
        return [m for arg in typing.get_args(annotation) for m in _model_types(arg)]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return []


def _declared_rules(
    model: type[BaseModel], node: dict[str, Any], path: str
) -> list[tuple[str, list[dict[str, str]], list[dict[str, str]]]]:
    """(path, declared rules, rules on the node) for the model and each of its fields."""
    found = []
    if issubclass(model, ApiModel) and model.cel_rules:
        declared = [r.to_schema() for r in model.cel_rules]
        found.append((path, declared, node.get("x-kubernetes-validations", [])))
    for name, field in model.model_fields.items():
        alias = field.alias or name
        child = node.get("properties", {}).get(alias)
        if child is None:
            continue
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if "x-kubernetes-validations" in extra:
            found.append(
                (
                    f"{path}.{alias}",
                    list(extra["x-kubernetes-validations"]),  # type: ignore[arg-type]
                    child.get("x-kubernetes-validations", []),
                )
            )
        for sub in _model_types(field.annotation):
            target = child.get("items", child)
            found += _declared_rules(sub, target, f"{path}.{alias}")
    return found


@pytest.mark.parametrize("model", KINDS, ids=KIND_IDS)
def test_cel_rules_are_present_where_the_models_declare_them(model: type[Any]) -> None:
    schema = structural_schema(model)
    declared = _declared_rules(model, schema, "")
    for path, rules, on_node in declared:
        for rule in rules:
            assert rule in on_node, f"{path}: {rule} missing"


def test_every_kind_declares_some_cel_rule() -> None:
    for model in KINDS:
        assert _declared_rules(model, structural_schema(model), ""), model.info.kind


def test_immutability_rules_are_transition_rules() -> None:
    session = structural_schema(KINDS_BY_NAME["AgentSession"])
    spec = session["properties"]["spec"]["properties"]
    for field in ("sessionId", "model"):
        assert {"rule": "self == oldSelf", "message": f"{field} is immutable"} in spec[field][
            "x-kubernetes-validations"
        ]


# --- defaults: the API server and the models fill in the same values ----------------


def _apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Apply CRD defaults the way the API server does (absent fields only)."""
    if isinstance(value, dict) and "properties" in schema:
        out = dict(value)
        for name, child in schema["properties"].items():
            if name not in out and "default" in child:
                out[name] = deepcopy(child["default"])
            if name in out:
                out[name] = _apply_defaults(child, out[name])
        return out
    if isinstance(value, list) and "items" in schema:
        return [_apply_defaults(schema["items"], item) for item in value]
    return value


@pytest.mark.parametrize("name_doc", VALID, ids=[n for n, _ in VALID])
def test_crd_defaults_match_model_defaults(name_doc: tuple[str, dict[str, Any]]) -> None:
    _, doc = name_doc
    model = KINDS_BY_NAME[doc["kind"]]
    spec_schema = structural_schema(model)["properties"]["spec"]
    defaulted_by_server = _apply_defaults(spec_schema, doc.get("spec", {}))
    defaulted_by_model = model.model_validate(doc).spec.wire()  # type: ignore[attr-defined]
    assert defaulted_by_server == _drop_empty(defaulted_by_model)


def _drop_empty(value: Any) -> Any:
    """The model writes empty lists and maps; the server leaves them absent."""
    if isinstance(value, dict):
        return {k: _drop_empty(v) for k, v in value.items() if v not in ([], {})}
    return value


def test_rendered_files_carry_the_generated_header() -> None:
    for name, text in render_crds().items():
        assert name.endswith(".sessionfleet.dev.yaml")
        assert text.startswith("# Generated by `sessionfleet crds`")
