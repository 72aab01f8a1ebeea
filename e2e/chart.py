"""Run the pinned helm on the sessionfleet chart, for e2e/test_chart*.py."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.localcluster import K8S_VERSION, ToolsMissingError, find_tools

REPO_ROOT = Path(__file__).resolve().parents[1]
CHART = REPO_ROOT / "charts" / "sessionfleet"


def helm_binary() -> Path:
    """The helm built by ``make e2e-tools``; fails the test (never skips) without it."""
    try:
        return find_tools().helm
    except ToolsMissingError as error:
        pytest.fail(f"{error}\nThe chart tests need the pinned helm: run `make e2e-tools`.")


def helm(
    *args: str, kubeconfig: Path | None = None, check: bool = True, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run helm; with ``check``, fail with its stderr when it exits non-zero."""
    argv = [str(helm_binary()), *args]
    if kubeconfig is not None:
        argv.append(f"--kubeconfig={kubeconfig}")
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if check and result.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} exited {result.returncode}:\n{result.stderr}")
    return result


def set_args(values: dict[str, Any] | None, sets: Sequence[str]) -> list[str]:
    """``--set`` flags, and the values as one ``--set-json`` per top-level key."""
    import json

    out: list[str] = []
    for key, value in (values or {}).items():
        out += ["--set-json", f"{key}={json.dumps(value)}"]
    for item in sets:
        out += ["--set", item]
    return out


def template_text(
    *sets: str,
    values: dict[str, Any] | None = None,
    namespace: str = "sf",
    release: str = "rel",
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """``helm template`` of the chart (kube version pinned to the e2e cluster's)."""
    return helm(
        "template",
        release,
        str(CHART),
        f"--namespace={namespace}",
        f"--kube-version={K8S_VERSION}",
        *set_args(values, sets),
        check=check,
    )


def render(*sets: str, **options: Any) -> list[dict[str, Any]]:
    """The rendered objects of ``helm template``."""
    text = template_text(*sets, **options).stdout
    return [doc for doc in yaml.safe_load_all(text) if doc]


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    """Objects of one kind, by name."""
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def rules(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    """A Role's rules as (apiGroup, resource, verb) triples."""
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
