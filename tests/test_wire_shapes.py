"""Hand-written Kubernetes objects are typed: each builder writes its declared shape, and a
misspelt key is a type error instead of a field the API server drops without a word."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints, is_typeddict

import pytest
from mypy import api as mypy_api

from sessionfleet.api import InferenceWorker
from sessionfleet.policy.events import EventType, Notice
from sessionfleet.policy.leadership import LeaseRecord
from sessionfleet.resources import events, leases, pods

ROOT = Path(__file__).resolve().parents[1]

WORKER = InferenceWorker.model_validate(
    {"metadata": {"name": "w", "namespace": "ns", "uid": "u-1"}, "spec": {"model": "m"}}
)
RECORD = LeaseRecord("other", 15, 2, "2026-12-01T00:00:00.000000Z", "7")
REF = events.ObjectRef("sessionfleet.dev/v1alpha1", "InferenceWorker", "ns", "w", "u-1")
NOTICE = Notice(EventType.NORMAL, "DrainStarted", "Drain", "asked")


def _typed_dict(hint: Any) -> Any:
    """Return the TypedDict inside ``hint`` (``X | None``, ``list[X]``), if any."""
    if is_typeddict(hint):
        return hint
    for arg in get_args(hint):
        if (found := _typed_dict(arg)) is not None:
            return found
    return None


def undeclared(value: Mapping[str, Any], shape: Any, path: str = "") -> list[str]:
    """Return the keys of ``value`` that its TypedDict ``shape`` does not declare, nested."""
    hints = get_type_hints(shape)
    found = []
    for key, item in value.items():
        if key not in hints:
            found.append(path + key)
            continue
        inner = _typed_dict(hints[key])
        items = item if isinstance(item, list) else [item]
        if inner is not None and get_origin(hints[key]) is not dict:
            for entry in items:
                if isinstance(entry, Mapping):
                    found += undeclared(entry, inner, f"{path}{key}.")
    missing = [path + k for k in shape.__required_keys__ if k not in value]
    return found + missing


BUILT = [
    ("router_lease", leases.router_lease("s-0", "r", duration_seconds=15, now=0), leases.LeaseBody),
    ("lease_renewal", leases.lease_renewal("r", now=0), leases.LeaseBody),
    ("lease_release", leases.lease_release(), leases.LeaseBody),
    ("leader_lease", leases.leader_lease("l", "me", duration_seconds=15, now=0), leases.LeaseBody),
    (
        "leader_lease_claim",
        leases.leader_lease_claim(RECORD, "me", duration_seconds=15, now=0),
        leases.LeaseBody,
    ),
    ("leader_lease_release", leases.leader_lease_release(RECORD, now=0), leases.LeaseBody),
    (
        "event_body",
        events.event_body(REF, NOTICE, name="e", instance="i", now=0),
        events.RelatedEventBody,
    ),
    (
        "event_body, related",
        events.event_body(REF, NOTICE, name="e", instance="i", now=0, related=REF),
        events.RelatedEventBody,
    ),
    ("series_patch", events.series_patch(2, 0), events.SeriesPatch),
    ("owner_reference", pods.owner_reference(WORKER), pods.OwnerReference),
    ("build_pdb", pods.build_pdb(WORKER), pods.PodDisruptionBudget),
]


@pytest.mark.parametrize(("name", "built", "shape"), BUILT, ids=[b[0] for b in BUILT])
def test_each_builder_writes_exactly_its_declared_shape(
    name: str, built: Mapping[str, Any], shape: Any
) -> None:
    assert undeclared(built, shape) == [], f"{name} writes keys its shape does not declare"


@pytest.mark.parametrize(
    ("shape", "typo"),
    [
        ("sessionfleet.resources.leases.LeaseSpec", "renewTme"),
        ("sessionfleet.resources.events.EventSeries", "lastObservedTim"),
        ("sessionfleet.resources.pods.PdbSpec", "unhealthyPodEvictionPolicies"),
        ("sessionfleet.resources.pods.OwnerReference", "blockOwnerDeletions"),
    ],
)
def test_a_misspelt_key_is_a_type_error(shape: str, typo: str) -> None:
    module, name = shape.rsplit(".", 1)
    snippet = f"from {module} import {name}\nbody: {name} = {{{typo!r}: 1}}\n"
    config = str(ROOT / "pyproject.toml")
    stdout, _, _ = mypy_api.run(["--no-error-summary", "--config-file", config, "-c", snippet])
    assert f'Extra key "{typo}" for TypedDict "{name}"' in stdout, stdout
