"""Generate CustomResourceDefinitions from the pydantic models.

The models are the single source of truth. Pydantic writes JSON Schema (2020-12,
with ``$ref``, ``anyOf`` for optional fields and ``exclusiveMinimum`` as a number);
Kubernetes wants a *structural* OpenAPI v3 schema: every node typed, no references,
no nullable unions. :func:`structural_schema` translates one into the other and
:func:`structural_violations` checks the result independently of the translation.
"""

from __future__ import annotations

from collections.abc import Iterator
from copy import deepcopy
from typing import Any

import yaml

from sessionfleet.api._common import GROUP, MEMBER_DESCRIPTIONS_KEY, VERSION
from sessionfleet.api._resource import CustomResource, KindInfo
from sessionfleet.api.kinds import KINDS

# Keys a node of apiextensions.k8s.io/v1 JSONSchemaProps may carry, of those this
# project uses. Anything else in pydantic's output is either translated or dropped.
_ALLOWED_KEYS = frozenset(
    {
        "type",
        "format",
        "description",
        "default",
        "enum",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "minLength",
        "maxLength",
        "pattern",
        "minItems",
        "maxItems",
        "items",
        "properties",
        "required",
        "additionalProperties",
        "nullable",
        "x-kubernetes-validations",
        "x-kubernetes-int-or-string",
        "x-kubernetes-preserve-unknown-fields",
        "x-kubernetes-list-type",
        "x-kubernetes-list-map-keys",
        "x-kubernetes-map-type",
    }
)
_DROPPED_KEYS = frozenset({"title", "examples", "$defs", MEMBER_DESCRIPTIONS_KEY})


def structural_schema(model: type[CustomResource]) -> dict[str, Any]:
    """Return the structural OpenAPI v3 schema of a kind's root object."""
    source = model.model_json_schema(by_alias=True, mode="validation")
    defs = source.get("$defs", {})
    schema = _translate(source, defs)
    # The API server owns metadata's schema; apiVersion and kind are plain strings so
    # that a later version can share the CRD.
    props = schema["properties"]
    props["metadata"] = {"type": "object"}
    for key in ("apiVersion", "kind"):
        props[key] = {"type": "string", "description": props[key].get("description", "")}
    schema["required"] = [r for r in schema.get("required", []) if r in ("spec",)]
    schema["description"] = (model.__doc__ or "").strip()
    return schema


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Inline ``$ref`` and drop ``null`` from unions; the field's own keys win."""
    node = dict(node)
    if "$ref" in node:
        target = deepcopy(defs[node.pop("$ref").rsplit("/", 1)[-1]])
        node = {**target, **node}
    if "anyOf" in node:
        options = [opt for opt in node.pop("anyOf") if opt.get("type") != "null"]
        if node.get("default", ...) is None:
            del node["default"]
        kinds = sorted(_resolve(opt, defs).get("type", "") for opt in options)
        if kinds == ["integer", "string"]:
            node["x-kubernetes-int-or-string"] = True
        elif len(options) == 1:
            node = {**_resolve(options[0], defs), **node}
        else:
            raise ValueError(f"cannot express a union of {kinds} in a structural schema")
    return node


def _translate(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    node = _resolve(node, defs)
    out: dict[str, Any] = {}
    members = node.get(MEMBER_DESCRIPTIONS_KEY)
    for key, value in node.items():
        if key in _DROPPED_KEYS:
            continue
        if key == "const":
            out["enum"] = [value]
        elif key == "properties":
            out["properties"] = {k: _translate(v, defs) for k, v in value.items()}
        elif key == "items":
            out["items"] = _translate(value, defs)
        elif key == "additionalProperties":
            if value is True:
                # An open map of arbitrary values (a core/v1 object we copy unchanged).
                out["x-kubernetes-preserve-unknown-fields"] = True
            elif isinstance(value, dict):
                out["additionalProperties"] = _translate(value, defs)
            # ``False`` (pydantic's extra="forbid") is not allowed in a CRD: the API
            # server prunes unknown fields instead.
        elif key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
            # JSON Schema 2020-12 gives the bound; OpenAPI v3.0 wants a flag beside it.
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        elif key in _ALLOWED_KEYS:
            out[key] = value
        else:
            raise ValueError(f"schema keyword {key!r} has no structural translation")
    if members:
        out["description"] = f"{out.get('description', '')}\nValues:\n{members}".strip()
    if out.get("default") is None:
        out.pop("default", None)
    if out.get("required") == []:
        del out["required"]
    return out


def structural_violations(schema: dict[str, Any], path: str = "") -> list[str]:
    """Return every way ``schema`` breaks the structural-schema rules (empty: none).

    Rules from the Kubernetes docs: every node has a type unless it is
    int-or-string or preserves unknown fields; no ``$ref``, ``nullable`` or
    ``anyOf``/``oneOf``/``allOf``/``not``; ``properties`` and
    ``additionalProperties`` are exclusive; arrays have ``items``; ``metadata`` at
    the root is only typed.
    """
    problems: list[str] = []
    here = path or "<root>"
    for key in schema:
        if key not in _ALLOWED_KEYS:
            problems.append(f"{here}: keyword {key!r} is not allowed")
    if schema.get("nullable"):
        problems.append(f"{here}: nullable is not used")
    if not schema.get("type") and not (
        schema.get("x-kubernetes-int-or-string")
        or schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        problems.append(f"{here}: node has no type")
    if "properties" in schema and "additionalProperties" in schema:
        problems.append(f"{here}: properties and additionalProperties together")
    if isinstance(schema.get("additionalProperties"), bool):
        problems.append(f"{here}: additionalProperties must be a schema")
    if schema.get("type") == "array" and "items" not in schema:
        problems.append(f"{here}: array without items")
    for name, child in schema.get("properties", {}).items():
        problems += structural_violations(child, f"{path}.{name}")
    if "items" in schema:
        problems += structural_violations(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        problems += structural_violations(schema["additionalProperties"], f"{path}{{}}")
    if not path and schema.get("properties", {}).get("metadata") != {"type": "object"}:
        problems.append("<root>.metadata: must be only {type: object}")
    return problems


def schema_paths(schema: dict[str, Any], prefix: str = "") -> Iterator[str]:
    """Yield every property path of ``schema`` as ``.spec.model``-style JSONPaths."""
    for name, child in schema.get("properties", {}).items():
        path = f"{prefix}.{name}"
        yield path
        yield from schema_paths(child, path)


def crd_manifest(model: type[CustomResource]) -> dict[str, Any]:
    """Return the CustomResourceDefinition of one kind as a plain dict."""
    info: KindInfo = model.info
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": info.crd_name,
            "labels": {"app.kubernetes.io/part-of": "sessionfleet"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": info.kind,
                "listKind": f"{info.kind}List",
                "plural": info.plural,
                "singular": info.singular,
                "shortNames": list(info.short_names),
                "categories": list(info.categories),
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [
                        {
                            "name": col.name,
                            "type": col.type,
                            "jsonPath": col.json_path,
                            "description": col.description,
                            **({"priority": col.priority} if col.priority else {}),
                        }
                        for col in info.printer_columns
                    ],
                    "schema": {"openAPIV3Schema": structural_schema(model)},
                }
            ],
        },
    }


GENERATED_HEADER = (
    "# Generated by `sessionfleet crds` from the pydantic models in operator/sessionfleet/api/.\n"
    "# Do not edit by hand: change the models and run `make crds`.\n"
)


class _CrdDumper(yaml.SafeDumper):
    """Writes multi-line descriptions as literal blocks, so the YAML reads like text."""


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_CrdDumper.add_representer(str, _represent_str)


def render_crds() -> dict[str, str]:
    """Return ``{file name: YAML text}`` for every kind's CRD."""
    return {
        f"{model.info.crd_name}.yaml": GENERATED_HEADER
        + yaml.dump(
            crd_manifest(model), Dumper=_CrdDumper, sort_keys=False, width=100, allow_unicode=True
        )
        for model in KINDS
    }
