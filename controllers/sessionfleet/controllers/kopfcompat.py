"""The one door to kopf's private modules, for the kopf versions it was tested with.

Kopf's public API (``kopf.on``, ``kopf.index``, ``kopf.operator``) does not cover three
things the operator needs: the scan results of a running operator (``Insights``, to
check it watches every kind: :mod:`.served`), the namespace patterns of its
``--namespace`` option (for our own AgentSession watch: :mod:`.sessionwatch`) and its
toggle sets (made change-only at start: :mod:`.kopfstart`). Private names move between
kopf releases without notice, so they are imported here and nowhere else (an
import-linter contract says so), and ``tests/test_kopfcompat.py`` checks that the
installed kopf is inside :data:`TESTED_RANGE` and that every name below still does what
this module expects: an upgrade that moves them fails that test, not the operator.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from importlib.metadata import version
from typing import Any

from kopf import OperatorRegistry
from kopf._cogs.aiokits import aiotoggles
from kopf._cogs.structs.references import (
    Insights,
    NamespaceName,
    Resource,
    match_namespace,
    select_specific_namespaces,
)

TESTED_RANGE = ((1, 45, 2), (1, 46))
"""The kopf versions these names were tested with: from the first (inclusive) to the
second (exclusive); pyproject.toml bounds the dependency the same way."""


def kopf_version() -> tuple[int, ...]:
    """Return the installed kopf's version as numbers (``1.45.2`` → ``(1, 45, 2)``)."""
    return release_numbers(version("kopf"))


def release_numbers(text: str) -> tuple[int, ...]:
    """Return the leading numbers of a version (``1.46.0rc1`` → ``(1, 46, 0)``)."""
    numbers = []
    for part in text.split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        numbers.append(int(digits.group()))
        if digits.end() < len(part):  # a pre-release or local tail ends the release
            break
    return tuple(numbers)


def is_tested(found: tuple[int, ...]) -> bool:
    """Whether a kopf version lies inside :data:`TESTED_RANGE`."""
    lowest, above = TESTED_RANGE
    return lowest <= found < above


def registered_handlers(registry: OperatorRegistry) -> list[Any]:
    """Return the indexing, watching and changing handlers of ``registry``.

    Kopf keeps them in per-kind sub-registries with no public accessor.
    """
    return [
        *registry._indexing.get_all_handlers(),
        *registry._watching.get_all_handlers(),
        *registry._changing.get_all_handlers(),
    ]


def matches_namespace(namespace: str, patterns: Iterable[Any]) -> bool:
    """Whether ``namespace`` matches any of kopf's ``--namespace`` patterns."""
    return any(match_namespace(NamespaceName(namespace), p) for p in patterns)


__all__ = [
    "TESTED_RANGE",
    "Insights",
    "OperatorRegistry",
    "Resource",
    "aiotoggles",
    "is_tested",
    "kopf_version",
    "matches_namespace",
    "registered_handlers",
    "release_numbers",
    "select_specific_namespaces",
]
