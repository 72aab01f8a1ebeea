"""Each part of the operator's shared state is written only by the module that owns it.

The docstrings of :mod:`sessionfleet.controllers.fleet`'s parts name the writer of
each field; this reads the controllers' source and holds them to it, so that a new
write from another module is a decision made on purpose (here) rather than by drift.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import sessionfleet.controllers as controllers

CONTROLLERS = Path(controllers.__file__).parent

OWNERS: dict[tuple[str, str], set[str]] = {
    ("indexes", "*"): {"handlers"},
    ("sessions", "cache"): {"sessionwatch"},
    ("sessions", "sources"): set(),  # set once, at construction (operator/main.py)
    ("sessions", "ledger"): {"sessions", "sessionwatch"},
    ("sessions", "worker_loads"): {"sessionwatch", "loop"},
    ("sessions", "placement"): {"handlers", "loop"},
    ("sessions", "busy"): {"sessions"},
    ("sessions", "deleted"): {"sessions"},
    ("sessions", "writes"): {"sessions"},
    ("engines", "stats"): {"loop"},
    ("engines", "kv_store_health"): {"kvstores"},
    ("checkpointing", "drivers"): set(),  # set once, at construction (operator/main.py)
    ("checkpointing", "running"): {"checkpoints"},
    ("checkpointing", "created"): {"checkpoints"},
    ("checkpointing", "key"): {"provenance"},
    ("worker_writes", "holds"): {"workers"},
    ("worker_writes", "status_written_at"): {"workers"},
    ("worker_writes", "node_moves"): {"workers", "loop"},
    ("worker_writes", "node_gate"): {"workers", "loop"},
    ("loop_marks", "*"): {"loop"},
}
"""(part, field) to the modules that may change it; ``*``: every field of the part."""

MUTATORS = {
    "add",
    "clear",
    "difference_update",
    "discard",
    "drop",
    "observe",
    "pop",
    "promote",
    "put",
    "remove",
    "settle",
    "take",
    "turn",
    "update",
    "worker_seen",
    "check",
}
"""Method names that change the object they are called on (of the parts' field types)."""


def _part_field(node: ast.AST) -> tuple[str, str] | None:
    """Return (part, field) when ``node`` is, or starts from, ``fleet.<part>.<field>``."""
    while isinstance(node, ast.Subscript | ast.Attribute):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "fleet"
        ):
            return node.value.attr, node.attr
        node = node.value
    return None


def writes(tree: ast.AST) -> Iterator[tuple[tuple[str, str], int]]:
    """Yield each write to a part's field in ``tree``, with its line."""
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in MUTATORS
        ):
            targets = [node.func.value]
        for target in targets:
            if (found := _part_field(target)) is not None:
                yield found, node.lineno


def test_every_write_to_a_part_comes_from_its_owner() -> None:
    strays = []
    for path in sorted(CONTROLLERS.glob("*.py")):
        for (part, name), line in writes(ast.parse(path.read_text())):
            owners = OWNERS.get((part, name), OWNERS.get((part, "*")))
            if owners is None:
                continue  # not a part (config, kube, work, ...): shared by design
            if path.stem not in owners:
                strays.append(f"{path.name}:{line} writes fleet.{part}.{name}")
    assert strays == []


def test_the_check_sees_a_write_from_another_module() -> None:
    tree = ast.parse("fleet.engines.stats[key] = x\nfleet.sessions.busy.add(key)\n")
    assert [found for found, _ in writes(tree)] == [("engines", "stats"), ("sessions", "busy")]
