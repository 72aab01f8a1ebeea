"""GPU telemetry through NVML (``pynvml``), as Prometheus metrics.

:class:`NvmlSampler` reads, per GPU, memory used and total and utilisation, and per
process its GPU memory (blocking calls: the agent samples in a thread on a timer).
:func:`families` turns a :class:`Snapshot` into metric families, with each process
mapped to its pod through ``/proc/<pid>/cgroup`` (:mod:`.cgroups`); it is pure, and
:class:`AgentCollector` serves the latest snapshot on every scrape, so series of
processes that ended disappear with them.

Where NVML is absent (no driver, or a node without GPUs) the sampler says so once and
the agent keeps serving, with ``sessionfleet_agent_nvml_available 0``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sessionfleet.agent.cgroups import PodRef

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One GPU at one moment."""

    index: int
    uuid: str
    model: str
    memory_used: int
    memory_total: int
    utilisation: float
    """Fraction of the last sample period a kernel ran, 0–1."""


@dataclass(frozen=True, slots=True)
class ProcessSample:
    """One process's memory on one GPU."""

    gpu: int
    uuid: str
    pid: int
    memory: int | None
    """Bytes; ``None`` where the driver cannot tell (some virtualised GPUs)."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What one sampling pass saw."""

    available: bool
    reason: str = ""
    """Why NVML is unavailable."""
    driver_version: str = ""
    gpus: tuple[GpuSample, ...] = ()
    processes: tuple[ProcessSample, ...] = ()


@dataclass(frozen=True, slots=True)
class PodName:
    """A pod's namespace and name, for readable labels."""

    namespace: str
    name: str


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlSampler:
    """Reads GPUs through NVML; blocking, for a thread.

    It initialises NVML lazily and retries at most every ``retry_seconds`` when NVML is
    absent, logging the absence once and its arrival once (a driver installed by the
    GPU operator after the agent started).
    """

    def __init__(
        self, retry_seconds: float = 300.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._lock = threading.Lock()
        self.retry_seconds = retry_seconds
        self.clock = clock
        self._ready = False
        self._said_absent = False
        self._last_try = float("-inf")
        self._reason = "not sampled yet"

    def _init(self) -> bool:
        if self._ready:
            return True
        now = self.clock()
        if now - self._last_try < self.retry_seconds:
            return False
        self._last_try = now
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as error:  # pynvml raises one class per NVML return code
            self._reason = f"NVML unavailable: {error}"
            if not self._said_absent:
                log.warning(
                    "%s; serving without GPU telemetry (sessionfleet_agent_nvml_available 0)",
                    self._reason,
                )
                self._said_absent = True
            return False
        if self._said_absent:
            log.info("NVML is available now; GPU telemetry resumes")
        self._ready = True
        return True

    def sample(self) -> Snapshot:
        """Return what NVML shows now."""
        # The sampling loop and a checkpoint's GPU lookup may sample at once.
        with self._lock:
            return self._sample()

    def _sample(self) -> Snapshot:
        if not self._init():
            return Snapshot(available=False, reason=self._reason)
        import pynvml

        try:
            driver = _text(pynvml.nvmlSystemGetDriverVersion())
            gpus: list[GpuSample] = []
            processes: list[ProcessSample] = []
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
                memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
                utilisation = pynvml.nvmlDeviceGetUtilizationRates(handle)
                gpus.append(
                    GpuSample(
                        index=index,
                        uuid=uuid,
                        model=_text(pynvml.nvmlDeviceGetName(handle)),
                        memory_used=int(memory.used),
                        memory_total=int(memory.total),
                        utilisation=float(utilisation.gpu) / 100.0,
                    )
                )
                for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    used = getattr(process, "usedGpuMemory", None)
                    processes.append(
                        ProcessSample(
                            index, uuid, int(process.pid), None if used is None else int(used)
                        )
                    )
        except Exception as error:  # a GPU fell off the bus, or the driver was unloaded
            self._ready = False
            self._last_try = float("-inf")
            log.warning("NVML sampling failed: %s", error)
            return Snapshot(available=False, reason=f"NVML sampling failed: {error}")
        return Snapshot(True, "", driver, tuple(gpus), tuple(processes))

    def gpus_of(self, pid: int) -> list[str]:
        """Return the UUIDs of the GPUs where ``pid`` holds memory, in GPU order."""
        return gpus_of(self.sample(), pid)


def gpus_of(snapshot: Snapshot, pid: int) -> list[str]:
    """Return the UUIDs of the GPUs where ``pid`` holds memory, in GPU order; pure."""
    held = {p.gpu: p.uuid for p in snapshot.processes if p.pid == pid}
    return [held[index] for index in sorted(held)]


@dataclass
class AgentState:
    """What the collector reports; the agent's loops keep it current."""

    node: str
    snapshot: Snapshot = field(default_factory=lambda: Snapshot(False, "not sampled yet"))
    pods: Mapping[int, PodRef] = field(default_factory=dict)
    """PID → pod, for the processes in the snapshot."""
    names: Mapping[str, PodName] = field(default_factory=dict)
    """Pod UID → namespace and name, where the agent can read pods."""
    capable: bool | None = None
    """Whether the node can checkpoint GPU processes; ``None`` until probed."""
    operations: dict[tuple[str, str], int] = field(default_factory=dict)
    """(operation, final phase) → count of checkpoints and restores run by this agent."""


def families(state: AgentState) -> list[Metric]:
    """Return the agent's metric families for ``state``; pure."""
    node = state.node
    available = GaugeMetricFamily(
        "sessionfleet_agent_nvml_available",
        "1 when NVML answers on this node, 0 when it is absent (no driver or no GPU).",
        labels=["node"],
    )
    available.add_metric([node], 1.0 if state.snapshot.available else 0.0)
    gpu_labels = ["node", "gpu", "uuid", "model"]
    used = GaugeMetricFamily(
        "sessionfleet_agent_gpu_memory_used_bytes", "GPU memory in use.", labels=gpu_labels
    )
    total = GaugeMetricFamily(
        "sessionfleet_agent_gpu_memory_total_bytes", "GPU memory installed.", labels=gpu_labels
    )
    busy = GaugeMetricFamily(
        "sessionfleet_agent_gpu_utilization_ratio",
        "Fraction of the last sample period during which a kernel ran (0-1).",
        labels=gpu_labels,
    )
    for gpu in state.snapshot.gpus:
        labels = [node, str(gpu.index), gpu.uuid, gpu.model]
        used.add_metric(labels, gpu.memory_used)
        total.add_metric(labels, gpu.memory_total)
        busy.add_metric(labels, gpu.utilisation)
    per_process = GaugeMetricFamily(
        "sessionfleet_agent_process_gpu_memory_bytes",
        "GPU memory held by a process, with the pod it belongs to (from its cgroup).",
        labels=["node", "gpu", "uuid", "pid", "pod_uid", "namespace", "pod", "container_id"],
    )
    for process in state.snapshot.processes:
        if process.memory is None:
            continue
        pod = state.pods.get(process.pid)
        name = state.names.get(pod.uid) if pod else None
        per_process.add_metric(
            [
                node,
                str(process.gpu),
                process.uuid,
                str(process.pid),
                pod.uid if pod else "",
                name.namespace if name else "",
                name.name if name else "",
                pod.container_id[:12] if pod else "",
            ],
            process.memory,
        )
    capable = GaugeMetricFamily(
        "sessionfleet_agent_checkpoint_capable",
        "1 when this node can checkpoint GPU processes with CRIU (GET /capability says why not).",
        labels=["node"],
    )
    if state.capable is not None:
        capable.add_metric([node], 1.0 if state.capable else 0.0)
    operations = CounterMetricFamily(
        "sessionfleet_agent_checkpoint_operations",
        "Process checkpoints and restores run by this agent, by final phase.",
        labels=["node", "operation", "phase"],
    )
    for (operation, phase), count in sorted(state.operations.items()):
        operations.add_metric([node, operation, phase], count)
    return [available, used, total, busy, per_process, capable, operations]


class AgentCollector(Collector):
    """Serves :func:`families` of the agent's current state on every scrape."""

    def __init__(self, state: AgentState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        """Yield the current families."""
        yield from families(self.state)


__all__ = [
    "AgentCollector",
    "AgentState",
    "GpuSample",
    "NvmlSampler",
    "PodName",
    "ProcessSample",
    "Snapshot",
    "families",
    "gpus_of",
]
