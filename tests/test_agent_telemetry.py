"""GPU telemetry: metric families from a snapshot, and the NVML-absent path of this machine."""

from __future__ import annotations

import logging
import sys

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sessionfleet.agent.cgroups import PodRef
from sessionfleet.agent.telemetry import (
    AgentCollector,
    AgentState,
    GpuSample,
    NvmlSampler,
    PodName,
    ProcessSample,
    Snapshot,
    gpus_of,
)

UUID0 = "GPU-5ab8c1d2-0b6f-2a3e-9f11-0123456789ab"
UUID1 = "GPU-00000000-1111-2222-3333-444444444444"
POD_UID = "0b0c1c8e-3b1a-4c7e-9d1e-7f1e2d3c4b5a"

SNAPSHOT = Snapshot(
    available=True,
    driver_version="580.65.06",
    gpus=(
        GpuSample(0, UUID0, "NVIDIA H200", 70 << 30, 141 << 30, 0.93),
        GpuSample(1, UUID1, "NVIDIA H200", 1 << 30, 141 << 30, 0.0),
    ),
    processes=(
        ProcessSample(0, UUID0, 4242, 69 << 30),
        ProcessSample(1, UUID1, 4242, 512 << 20),
        ProcessSample(0, UUID0, 5151, None),  # the driver could not tell
        ProcessSample(1, UUID1, 6000, 100 << 20),  # not in a pod
    ),
)


def scrape(state: AgentState) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Serve, render and parse back: sample name and labels → value."""
    registry = CollectorRegistry()
    registry.register(AgentCollector(state))
    text = generate_latest(registry).decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def key(name: str, **labels: str) -> tuple[str, frozenset[tuple[str, str]]]:
    return name, frozenset(labels.items())


def test_gpu_and_process_metrics_with_pods() -> None:
    state = AgentState(
        node="gpu-1",
        snapshot=SNAPSHOT,
        pods={4242: PodRef(POD_UID, "4f8d2b1c9e7a" + "0" * 52)},
        names={POD_UID: PodName("agents", "coder-3")},
        capable=False,
        operations={("checkpoint", "Resumed"): 2},
    )
    got = scrape(state)
    gpu0 = {"node": "gpu-1", "gpu": "0", "uuid": UUID0, "model": "NVIDIA H200"}
    assert got[key("sessionfleet_agent_nvml_available", node="gpu-1")] == 1
    assert got[key("sessionfleet_agent_gpu_memory_used_bytes", **gpu0)] == 70 << 30
    assert got[key("sessionfleet_agent_gpu_memory_total_bytes", **gpu0)] == 141 << 30
    assert got[key("sessionfleet_agent_gpu_utilization_ratio", **gpu0)] == 0.93
    engine = {
        "node": "gpu-1",
        "gpu": "0",
        "uuid": UUID0,
        "pid": "4242",
        "pod_uid": POD_UID,
        "namespace": "agents",
        "pod": "coder-3",
        "container_id": "4f8d2b1c9e7a",
    }
    assert got[key("sessionfleet_agent_process_gpu_memory_bytes", **engine)] == 69 << 30
    per_process = [k for k in got if k[0] == "sessionfleet_agent_process_gpu_memory_bytes"]
    pids = sorted(dict(labels)["pid"] for _, labels in per_process)
    assert pids == ["4242", "4242", "6000"]  # 5151 has no figure, so no series
    outside = {
        "node": "gpu-1",
        "gpu": "1",
        "uuid": UUID1,
        "pid": "6000",
        "pod_uid": "",
        "namespace": "",
        "pod": "",
        "container_id": "",
    }
    assert got[key("sessionfleet_agent_process_gpu_memory_bytes", **outside)] == 100 << 20
    assert got[key("sessionfleet_agent_checkpoint_capable", node="gpu-1")] == 0
    operations = key(
        "sessionfleet_agent_checkpoint_operations_total",
        node="gpu-1",
        operation="checkpoint",
        phase="Resumed",
    )
    assert got[operations] == 2


def test_without_nvml_only_the_availability_says_anything() -> None:
    got = scrape(AgentState(node="cpu-1"))
    assert got == {key("sessionfleet_agent_nvml_available", node="cpu-1"): 0}


def test_a_process_gpus_in_gpu_order() -> None:
    assert gpus_of(SNAPSHOT, 4242) == [UUID0, UUID1]
    assert gpus_of(SNAPSHOT, 1) == []


class AbsentNvml:
    """Stands in for ``pynvml`` on a node without the NVIDIA driver."""

    @staticmethod
    def nvmlInit() -> None:
        raise RuntimeError("NVML Shared Library Not Found")


def test_a_node_without_nvml_says_so_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Whether this machine has a GPU must not decide the result.
    monkeypatch.setitem(sys.modules, "pynvml", AbsentNvml)
    now = [0.0]
    sampler = NvmlSampler(retry_seconds=60, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="sessionfleet.agent.telemetry"):
        first = sampler.sample()
        now[0] = 30.0
        second = sampler.sample()  # within the retry period: not even tried
        now[0] = 120.0
        third = sampler.sample()  # tried again, still absent: not said again
    assert not first.available and "NVML unavailable" in first.reason
    assert not second.available and not third.available
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert "serving without GPU telemetry" in lines[0]
    assert sampler.gpus_of(4242) == []
