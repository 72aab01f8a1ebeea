"""What kopf's watches observed, and the reads the controllers make of it.

Kopf fills one index per kind counted in hundreds (workers, their pods, PDBs and engine
NetworkPolicies, nodes, DrainPolicies, WorkerCheckpoints, the routers' Leases) and hands
them to the operator at start; :mod:`.handlers` stores them here, and every controller
reads them through the methods below rather than through kopf's stores.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from sessionfleet.api import DrainPolicySpec
from sessionfleet.controllers.records import Key, PolicyRecord, WorkerRecord
from sessionfleet.policy.checkpoint import CheckpointState
from sessionfleet.policy.handshake import RouterLease
from sessionfleet.policy.observed import NodeState, PodState

UNPARSED = "the spec could not be parsed"
"""The problem reported for a DrainPolicy whose parse gave no message."""


class Store(Protocol):
    """The read-only view kopf gives of one index: key to the values stored under it."""

    def get(self, key: Any, default: Any = None) -> Any:
        """Return the values under ``key``, or ``default``."""

    def __iter__(self) -> Iterator[Any]: ...
    def __len__(self) -> int: ...
    def __getitem__(self, key: Any) -> Iterable[Any]: ...


@dataclass
class Indexes:
    """Kopf's indexes: every field is written by :mod:`.handlers` only, once they exist."""

    workers: Store | None = None
    worker_pods: Store | None = None
    pdbs: Store | None = None
    engine_policies: Store | None = None
    checkpoints: Store | None = None
    router_leases: Store | None = None
    nodes: Store | None = None
    policies: Store | None = None
    kopf_indexed: bool = False
    """Whether kopf has filled its indexes (it calls event handlers only then)."""

    def worker(self, namespace: str, name: str) -> WorkerRecord | None:
        """Return the worker's record, if the index has it."""
        record: WorkerRecord | None = _one(self.workers, (namespace, name))
        return record

    def worker_count(self) -> int:
        """Return how many workers the index holds (0 before kopf handed it over)."""
        return len(self.workers) if self.workers is not None else 0

    def all_workers(self) -> list[WorkerRecord]:
        """Return every worker record."""
        records: list[WorkerRecord] = _every(self.workers)
        return records

    def has_pdb(self, key: Key) -> bool:
        """Whether the worker's hold PodDisruptionBudget exists (as the index shows it)."""
        return bool(self.pdbs.get(key)) if self.pdbs is not None else False

    def pdb_uid(self, key: Key) -> str | None:
        """Return the uid of the worker's hold PodDisruptionBudget, as the index shows it."""
        found = self.pdbs.get(key) if self.pdbs is not None else None
        for _, uid in found or ():
            return str(uid) or None
        return None

    def engine_policy_hash(self, key: Key) -> str | None:
        """Return the spec hash of the worker's engine NetworkPolicy, as the index shows it."""
        if self.engine_policies is None:
            return None
        hashes = list(self.engine_policies.get(key, ()))
        return hashes[0] if hashes else None

    def pods_of(self, key: Key) -> list[PodState]:
        """Return the worker's pods, every epoch."""
        return list(self.worker_pods.get(key, ())) if self.worker_pods is not None else []

    def node(self, name: str | None) -> NodeState | None:
        """Return the node's state, if known."""
        state: NodeState | None = _one(self.nodes, name) if name else None
        return state

    def all_nodes(self) -> list[NodeState]:
        """Return every node the index holds."""
        states: list[NodeState] = _every(self.nodes)
        return states

    def policies_in(self, namespace: str) -> list[PolicyRecord]:
        """Return the DrainPolicies of a namespace."""
        return list(self.policies.get(namespace, ())) if self.policies is not None else []

    def policy_specs(self, namespace: str) -> tuple[dict[str, DrainPolicySpec], dict[str, str]]:
        """Return a namespace's DrainPolicies as ``resolve_policy`` reads them.

        The specs that parsed, by name, and the others' parse problems, by name: a
        worker that references an invalid policy is told so, not that it does not exist.
        """
        records = self.policies_in(namespace)
        parsed = {p.name: p.spec for p in records if p.spec is not None}
        invalid = {p.name: p.invalid or UNPARSED for p in records if p.spec is None}
        return parsed, invalid

    def all_policies(self) -> list[PolicyRecord]:
        """Return every DrainPolicy record, of every namespace."""
        records: list[PolicyRecord] = _every(self.policies)
        return records

    def checkpoints_of(self, key: Key) -> list[CheckpointState]:
        """Return the worker's WorkerCheckpoints."""
        return list(self.checkpoints.get(key, ())) if self.checkpoints is not None else []

    def routers(self) -> list[RouterLease]:
        """Return the router replicas' Leases, live or not."""
        return list(self.router_leases.get("routers", ())) if self.router_leases else []


def _every(store: Store | None) -> list[Any]:
    if store is None:
        return []
    return [value for key in list(store) for value in store[key]]


def _one(store: Store | None, key: Any) -> Any:
    if store is None:
        return None
    values = store.get(key)
    if not values:
        return None
    return next(iter(values), None)
