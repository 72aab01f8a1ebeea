"""The InferencePool the EPP serves: which workers it may name, and at which port.

A gateway routes a pool's traffic only to the pods the pool selects, at the pool's
target port: kgateway's subset hint lists ``podIP:targetPort`` of the selected pods,
an ORIGINAL_DST cluster dials whatever address the EPP names, and Istio keeps
affinity only for the pool's own endpoints. So with ``--pool-name`` the EPP reads its
InferencePool (``inference.networking.k8s.io/v1``; GAIE's ``api/v1/inferencepool_types.go``:
``spec.selector.matchLabels`` and ``spec.targetPorts[].number``) and

* picks only among the InferenceWorkers whose current pod the pool selects;
* names them as ``podIP:<the first target port>``, as upstream's EPP does for a pool
  with one port. A pool with several target ports (a pod serving several engine
  ranks) is named at its first port only: an InferenceWorker runs one engine on one
  port, so the other ports have no session to route to;
* reports each worker it cannot use (:class:`Mismatch`): a clear log line when a
  worker's state changes, and ``sessionfleet_epp_pool_mismatched_workers{reason}``.

A worker is matched to its pod by the pod's IP, which is the host of the worker's
``status.endpoint``; the pods are those the operator made (``app.kubernetes.io/managed-by:
sessionfleet``), watched with that label.

Without ``--pool-name`` every InferenceWorker of the namespace is eligible at its own
endpoint, as before.

:class:`PoolView` and :func:`membership` are pure; :func:`watch_pool` and
:func:`watch_pods` are the watch loops that feed a view.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sessionfleet.api.labels import MANAGED_BY
from sessionfleet.fronts.bindings import BindingTable, WorkerView
from sessionfleet.kube import PODS, Kube, reflect
from sessionfleet.kube.resources import Resource

logger = logging.getLogger("sessionfleet.epp")

POOLS: Final = Resource("inference.networking.k8s.io", "v1", "inferencepools")
"""GAIE's InferencePool, v1 (the group and version of its CRD since GAIE v1.0.0)."""
WORKER_PODS_SELECTOR: Final = ",".join(f"{k}={v}" for k, v in MANAGED_BY.items())
REPORT_SECONDS: Final = 5.0
"""Seconds between two looks for mismatches when nothing changes (a pod's labels)."""


class Mismatch(enum.StrEnum):
    """Why the pool's gateway cannot reach a worker the way the EPP would name it."""

    NOT_SELECTED = "NotSelected"
    """The pool's selector does not select the worker's pod: the EPP never names it."""
    PORT_DIFFERS = "PortDiffers"
    """The engine listens on another port than the pool's target port. The EPP names
    the pod at the target port (what the gateway can route to), where the engine may
    not answer: fix the pool or the worker."""
    NO_POD = "PodUnknown"
    """No pod of the operator's has the worker's endpoint address (yet)."""


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """What the EPP reads of an InferencePool."""

    name: str
    match_labels: Mapping[str, str]
    target_ports: tuple[int, ...]

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> PoolSpec:
        """Read an InferencePool as the API server returns it."""
        spec = obj.get("spec") or {}
        selector = spec.get("selector") or {}
        ports = tuple(
            int(p["number"]) for p in spec.get("targetPorts") or () if isinstance(p, dict)
        )
        return cls(
            name=str(obj["metadata"]["name"]),
            match_labels={str(k): str(v) for k, v in (selector.get("matchLabels") or {}).items()},
            target_ports=ports,
        )

    @property
    def port(self) -> int | None:
        """The port the EPP names endpoints at: the first target port."""
        return self.target_ports[0] if self.target_ports else None

    def selects(self, labels: Mapping[str, str]) -> bool:
        """Whether the pool's selector selects a pod with these labels."""
        return all(labels.get(k) == v for k, v in self.match_labels.items())


def _host_port(endpoint: str | None) -> tuple[str, int | None]:
    parts = urlsplit(endpoint if endpoint and "//" in endpoint else f"//{endpoint or ''}")
    try:
        return parts.hostname or "", parts.port
    except ValueError:
        return parts.hostname or "", None


@dataclass(frozen=True, slots=True)
class Member:
    """How the EPP may name one worker under the pool: an address, or a mismatch."""

    address: str | None
    mismatch: Mismatch | None = None
    message: str = ""


def membership(pool: PoolSpec, pods: Mapping[str, Mapping[str, str]], worker: WorkerView) -> Member:
    """Decide whether ``pool`` reaches ``worker`` and at which ``ip:port``.

    ``pods`` maps a pod IP to the pod's labels.
    """
    host, engine_port = _host_port(worker.endpoint)
    labels = pods.get(host)
    if labels is None:
        return Member(
            None, Mismatch.NO_POD, f"worker {worker.name}: no pod has its endpoint's IP {host!r}"
        )
    if not pool.selects(labels):
        return Member(
            None,
            Mismatch.NOT_SELECTED,
            f"worker {worker.name}: InferencePool {pool.name} does not select its pod "
            f"(selector {dict(pool.match_labels)})",
        )
    port = pool.port
    if port is None:
        return Member(None, Mismatch.PORT_DIFFERS, f"InferencePool {pool.name} has no targetPorts")
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if engine_port is not None and engine_port != port:
        return Member(
            address,
            Mismatch.PORT_DIFFERS,
            f"worker {worker.name}: its engine listens on port {engine_port}, InferencePool "
            f"{pool.name} targets port {port}",
        )
    return Member(address)


@dataclass
class PoolView:
    """The pool (once read) and the operator's pods by IP, kept current by watches."""

    name: str
    spec: PoolSpec | None = None
    pods: dict[str, dict[str, str]] = field(default_factory=dict)
    """Pod IP to labels, for the operator's pods that have an IP."""
    _pod_ips: dict[str, str] = field(default_factory=dict)
    """Pod name to its IP, to forget a deleted pod's entry."""
    pool_synced: bool = False
    pods_synced: bool = False
    reported: dict[str, tuple[Mismatch | None, str]] = field(default_factory=dict)
    """The last mismatch logged for each worker, so each change is logged once."""

    @property
    def synced(self) -> bool:
        """Whether the pool and the pods have been listed."""
        return self.pool_synced and self.pods_synced

    def member(self, worker: WorkerView) -> Member:
        """Return how the EPP may name ``worker``: only inside a pool it has read."""
        if self.spec is None:
            return Member(None, Mismatch.NOT_SELECTED, f"InferencePool {self.name} is not found")
        return membership(self.spec, self.pods, worker)

    def address(self, worker: WorkerView) -> str | None:
        """Return ``ip:port`` under the pool, None when the pool does not reach it."""
        return self.member(worker).address

    def apply_pool(self, obj: Mapping[str, Any] | None) -> None:
        """Take the pool's new state (None: deleted)."""
        self.spec = PoolSpec.from_object(obj) if obj is not None else None

    def apply_pod(self, obj: Mapping[str, Any], deleted: bool = False) -> None:
        """Take one pod's new state."""
        name = str(obj["metadata"]["name"])
        previous = self._pod_ips.pop(name, None)
        if previous is not None:
            self.pods.pop(previous, None)
        ip = (obj.get("status") or {}).get("podIP")
        if deleted or not ip:
            return
        self._pod_ips[name] = ip
        self.pods[ip] = dict((obj.get("metadata") or {}).get("labels") or {})

    def replace_pods(self, objects: Iterable[Mapping[str, Any]]) -> None:
        """Replace every pod with a fresh list."""
        self.pods.clear()
        self._pod_ips.clear()
        for obj in objects:
            self.apply_pod(obj)
        self.pods_synced = True

    def mismatches(self, workers: Iterable[WorkerView]) -> dict[str, Member]:
        """Return the workers the pool does not reach as the EPP would name them."""
        members = {w.name: self.member(w) for w in workers if w.endpoint}
        return {name: m for name, m in members.items() if m.mismatch is not None}

    def report(self, workers: Iterable[WorkerView]) -> list[str]:
        """Return a log line for each worker whose mismatch changed since the last report."""
        if not self.synced:
            return []
        workers = list(workers)
        found = self.mismatches(workers)
        lines: list[str] = []
        current: dict[str, tuple[Mismatch | None, str]] = {}
        for worker in workers:
            member = found.get(worker.name)
            state = (member.mismatch, member.message) if member else (None, "")
            current[worker.name] = state
            before = self.reported.get(worker.name, (None, ""))
            if state[0] != before[0]:
                if member is not None:
                    lines.append(f"pool mismatch {member.mismatch}: {member.message}")
                elif before[0] is not None:
                    lines.append(f"pool mismatch resolved: worker {worker.name} is in the pool")
        self.reported = current
        return lines


async def watch_pool(kube: Kube, namespace: str, view: PoolView) -> None:
    """Mirror the one InferencePool named ``view.name`` into ``view``, forever."""
    async for event in reflect(kube, POOLS, namespace):
        if event.type == "SYNC":
            named = [o for o in event.items if o["metadata"]["name"] == view.name]
            view.apply_pool(named[0] if named else None)
            view.pool_synced = True
            if not named:
                logger.warning("InferencePool %s/%s not found", namespace, view.name)
        elif event.obj is not None and event.obj["metadata"]["name"] == view.name:
            view.apply_pool(None if event.type == "DELETED" else event.obj)


async def watch_pods(kube: Kube, namespace: str, view: PoolView) -> None:
    """Mirror the operator's pods of the namespace (IP and labels) into ``view``, forever."""
    async for event in reflect(kube, PODS, namespace, label_selector=WORKER_PODS_SELECTOR):
        if event.type == "SYNC":
            view.replace_pods(event.items)
        elif event.obj is not None:
            view.apply_pod(event.obj, deleted=event.type == "DELETED")


class MismatchCollector(Collector):
    """``sessionfleet_epp_pool_mismatched_workers{reason}``, read at scrape time."""

    def __init__(self, view: PoolView, workers: Callable[[], Iterable[WorkerView]]) -> None:
        self._view = view
        self._workers = workers

    def collect(self) -> Iterator[Metric]:
        """Yield the gauge, one sample per reason."""
        family = GaugeMetricFamily(
            "sessionfleet_epp_pool_mismatched_workers",
            "InferenceWorkers the EPP's InferencePool does not reach as the EPP names them, "
            "by reason (NotSelected, PortDiffers, PodUnknown).",
            labels=["reason"],
        )
        found = Counter(m.mismatch for m in self._view.mismatches(self._workers()).values())
        for reason in Mismatch:
            family.add_metric([reason.value], found.get(reason, 0))
        yield family


async def report_mismatches(view: PoolView, table: BindingTable) -> None:
    """Log each change of a worker's pool mismatch, forever (one line per change)."""
    while True:
        changed = table.changed()
        for line in view.report(table.workers.values()):
            logger.warning("%s", line)
        try:
            async with asyncio.timeout(REPORT_SECONDS):
                await changed.wait()
        except TimeoutError:
            pass
