"""The dashboard and the alert rules against what the running components serve on /metrics.

``tests/test_monitoring.py`` checks every metric name of the chart's Grafana dashboard and
alert rules against what the code declares. Here the real components run against the
e2e cluster: a ``sessionfleet operator``, a ``sessionfleet router``, a ``sessionfleet
agent`` and two simulated-engine workers (vLLM's ``vllm:`` metrics at their endpoint's
``/metrics``). A little traffic gives every labelled family a child: sessions bound;
turns through the router (one of a new session, a stream its client leaves before the
usage chunk, a turn held while its session migrates); a Manual checkpoint, and one the
operator refuses whose Event an admission policy refuses; a drain that waits, then
migrates; a worker pod deleted. Each component's live ``/metrics`` is scraped along the
way, and every name the dashboard or a rule selects must be in the union of what was
served (the names taken apart by the helpers of ``tests/test_monitoring.py``).

The exemptions are the node agent's samples that need what this machine lacks (NVML
and a GPU process; a node that can checkpoint GPU processes), each with its reason,
applied (but the one for GPU processes) only while the live agent says it lacks it, and
declared in the code.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from e2e.helpers import Kubectl, namespace_admission_policy, wait_until
from e2e.localcluster import LocalCluster
from e2e.operator import (
    SESSIONFLEET,
    Custom,
    OperatorProcess,
    Process,
    bound_to,
    drain_policy,
    free_port,
    ready_workers,
    session,
    sim_worker,
    start_router,
    via_router,
    wait_for,
)
from sessionfleet.policy.handshake import ACK_PREFIX, ROUTER_COMPONENT, ROUTER_COMPONENT_LABEL
from sessionfleet.resources.names import session_object_name
from tests.test_monitoring import PROMETHEUS_SERIES, dashboard_queries, exported, rule_queries

pytestmark = pytest.mark.timeout(240)

GHOST = "ghost"
"""A router replica with a Lease and no process: it acknowledges only when the test does."""
SYSTEM = "You are a coding agent working in a large repository. " * 50

NO_NVML = "a sample per GPU NVML reports; this machine has no NVIDIA driver (nvml_available 0)"
#: Names served only with what this machine lacks: the reason, and the agent's gauge
#: that says it lacks it (the exemption holds only while that gauge is 0; None: always).
EXEMPT: dict[str, tuple[str, str | None]] = {
    "sessionfleet_agent_gpu_memory_used_bytes": (NO_NVML, "sessionfleet_agent_nvml_available"),
    "sessionfleet_agent_gpu_memory_total_bytes": (NO_NVML, "sessionfleet_agent_nvml_available"),
    "sessionfleet_agent_gpu_utilization_ratio": (NO_NVML, "sessionfleet_agent_nvml_available"),
    "sessionfleet_agent_process_gpu_memory_bytes": (
        "a sample per process holding GPU memory; the simulated engines hold none",
        None,
    ),
    "sessionfleet_agent_checkpoint_operations_total": (
        "a sample per CRIU checkpoint or restore the agent ran, and it runs one only on a "
        "node that can checkpoint GPU processes (NVIDIA driver >= 570, CRIU >= 4.0, root)",
        "sessionfleet_agent_checkpoint_capable",
    ),
}


class Scrapes:
    """Every sample name each component served, over all the scrapes of the test."""

    def __init__(self) -> None:
        self.names: dict[str, set[str]] = {}
        self.last: dict[str, str] = {}

    def add(self, component: str, text: str) -> set[str]:
        names = {
            sample.name
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }
        self.names.setdefault(component, set()).update(names)
        self.last[component] = text
        return names

    def get(self, component: str, url: str) -> set[str]:
        response = httpx.get(url, timeout=10)
        response.raise_for_status()
        return self.add(component, response.text)

    def union(self) -> set[str]:
        return set().union(*self.names.values())

    def value(self, component: str, name: str) -> float | None:
        """The value of the one sample ``name`` in the component's last scrape."""
        for family in text_string_to_metric_families(self.last.get(component, "")):
            for sample in family.samples:
                if sample.name == name:
                    return float(sample.value)
        return None


@pytest.fixture
def refuse_events_about(kubectl: Kubectl, namespace: str) -> Iterator[Callable[[str], None]]:
    """Make the API server refuse events.k8s.io Events about objects of one name here.

    A ValidatingAdmissionPolicy bound to the test's namespace only; returns once a probe
    Event is refused, so the operator's next Event about that name is dropped.
    """
    name = f"e2e-refuse-events-{namespace}"[:63]
    applied = False

    def refuse(regarding: str) -> None:
        nonlocal applied
        documents = namespace_admission_policy(
            name,
            namespace,
            {
                "apiGroups": ["events.k8s.io"],
                "apiVersions": ["*"],
                "operations": ["CREATE"],
                "resources": ["events"],
            },
            [
                {
                    "expression": (
                        f"!has(object.regarding) || object.regarding.name != '{regarding}'"
                    ),
                    "message": f"events about {regarding} are refused here",
                }
            ],
        )
        applied = True
        kubectl(
            "apply",
            "-f",
            "-",
            input=json.dumps({"kind": "List", "apiVersion": "v1", "items": documents}),
        )

        def refused() -> bool:
            probe = {
                "apiVersion": "events.k8s.io/v1",
                "kind": "Event",
                "metadata": {"generateName": "probe-"},
                "eventTime": time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime()),
                "reportingController": "e2e.sessionfleet.dev/probe",
                "reportingInstance": "probe",
                "action": "Probe",
                "reason": "Probe",
                "type": "Normal",
                "note": "is the admission policy in force?",
                "regarding": {"kind": "Probe", "name": regarding, "namespace": namespace},
            }
            result = kubectl(
                "create",
                f"--namespace={namespace}",
                "-f",
                "-",
                input=json.dumps(probe),
                check=False,
            )
            if result.returncode == 0:
                return False
            assert "refused here" in result.stderr, result.stderr
            return True

        wait_until(refused, timeout=30, what="the admission policy in force")

    yield refuse
    if applied:
        kubectl(
            "delete",
            f"validatingadmissionpolicybinding/{name}",
            f"validatingadmissionpolicy/{name}",
            "--ignore-not-found",
        )


def start_agent(cluster: LocalCluster, tmp_path: Path) -> tuple[str, Process]:
    """``sessionfleet agent`` on loopback for the node the workers run on."""
    port = free_port()
    storage = tmp_path / "agent-checkpoints"
    storage.mkdir()
    agent = Process(
        [
            str(SESSIONFLEET),
            "agent",
            "--host=127.0.0.1",
            f"--port={port}",
            "--node-name=gpu-node-0",
            f"--kubeconfig={cluster.kubeconfig}",
            "--interval=1",
            f"--storage-root={storage}",
            # Telemetry alone on loopback: nobody to authenticate, nothing to encrypt.
            "--plain-http",
        ],
        tmp_path / "agent.log",
    )
    url = f"http://127.0.0.1:{port}"
    agent.wait_http(f"{url}/readyz")
    return url, agent


def router_lease(namespace: str, replica: str) -> dict[str, Any]:
    """The Lease of a live router replica (renewed now, for 10 minutes)."""
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": f"router-{replica}",
            "namespace": namespace,
            "labels": {ROUTER_COMPONENT_LABEL: ROUTER_COMPONENT},
        },
        "spec": {
            "holderIdentity": replica,
            "leaseDurationSeconds": 600,
            "renewTime": time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime()),
        },
    }


def worker_checkpoint(name: str, worker: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "sessionfleet.dev/v1alpha1",
        "kind": "WorkerCheckpoint",
        "metadata": {"name": name},
        "spec": {"worker": worker, "reason": "Manual", **spec},
    }


def abandoned_stream(url: str) -> None:
    """A streamed turn whose client leaves after the first chunk: the usage chunk that
    would have ended it never reaches the router, which counts a turn without usage."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "write a long story"}],
        "max_tokens": 500,
        "stream": True,
    }
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{url}/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200, response.read()
        next(response.iter_raw())


def test_every_dashboard_and_rule_metric_is_served_live(
    operator: OperatorProcess,
    crs: Custom,
    core: Any,
    cluster: LocalCluster,
    kubectl: Kubectl,
    namespace: str,
    tmp_path: Path,
    refuse_events_about: Callable[[str], None],
) -> None:
    scrapes = Scrapes()

    def scrape_operator() -> set[str]:
        return scrapes.add("operator", operator.metrics())

    def scrape_engine(worker: str) -> None:
        endpoint = crs.status("inferenceworkers", worker)["endpoint"]
        scrapes.get("vLLM (sim engine)", f"{endpoint}/metrics")

    def until_served(component: str, scrape: Callable[[], set[str]], name: str) -> None:
        wait_for(
            operator,
            lambda: name in scrape(),
            timeout=30,
            what=f"{name} on the {component}'s /metrics",
        )

    # Every generated token takes 20 ms: a 500-token stream is still running when its
    # client leaves.
    engine = {"type": "sim", "args": ["--decode-ms-per-token=20"]}
    checkpoints = {"driver": "engine", "storage": {"path": str(tmp_path / "checkpoints")}}
    crs.create(drain_policy("grace", mode="WaitThenMigrate", gracePeriod="5s", deadline="5m"))
    for name in ("src", "dst"):
        crs.create(sim_worker(name, engine=engine, checkpoint=checkpoints))
    ready_workers(crs, 2, operator)
    agent_url, agent = start_agent(cluster, tmp_path)
    router_url, router = start_router(cluster.kubeconfig, namespace, "r1", tmp_path)
    try:
        # A session bound to src, under the name the router gives its id; three turns.
        live = session_object_name("id-live")
        crs.create(session("live", workerPin="src") | {"metadata": {"name": live}})
        wait_for(operator, lambda: bound_to(crs).get(live) == "src", timeout=30, what="bound")
        history = [{"role": "system", "content": SYSTEM}]
        for step in range(3):
            via_router(router_url, "id-live", history, f"step {step}: run the tests")
        # A session the router creates.
        via_router(router_url, "id-fresh", [], "hello")
        abandoned_stream(router_url)

        # A Manual checkpoint of src, and one the operator refuses (its destination is
        # outside the worker's storage), whose CheckpointFailed Event the API server refuses.
        refuse_events_about("unwritable")
        crs.create(worker_checkpoint("by-hand", "src"))
        crs.create(worker_checkpoint("unwritable", "src", destination="/elsewhere/c"))
        wait_for(
            operator,
            lambda: crs.status("workercheckpoints", "by-hand").get("phase") == "Succeeded",
            timeout=30,
            what="the Manual checkpoint Succeeded",
        )
        wait_for(
            operator,
            lambda: crs.status("workercheckpoints", "unwritable").get("phase") == "Failed",
            timeout=30,
            what="the refused checkpoint Failed",
        )
        until_served("operator", scrape_operator, "sessionfleet_events_dropped_total")
        router_metrics = f"{router_url}/metrics"
        until_served(
            "router",
            lambda: scrapes.get("router", router_metrics),
            "sessionfleet_router_turns_without_usage_total",
        )
        until_served(
            "node agent",
            lambda: scrapes.get("node agent", f"{agent_url}/metrics"),
            "sessionfleet_agent_checkpoint_capable",
        )
        for worker in ("src", "dst"):
            scrape_engine(worker)

        # A drain of src: held for the grace period (the drain's gauges are served while
        # it lasts), then its sessions migrate to dst. A router replica that never
        # acknowledges (a Lease without a process) keeps them Migrating until this test
        # acknowledges for it: meanwhile a turn through the real router is held.
        kubectl("apply", "-f", "-", input=json.dumps(router_lease(namespace, GHOST)))
        crs.patch("inferenceworkers", "src", {"spec": {"drain": True}})
        until_served("operator", scrape_operator, "sessionfleet_drain_held_seconds")
        wait_for(
            operator,
            lambda: (
                bool(scrape_operator())
                and crs.status("agentsessions", live).get("phase") == "Migrating"
            ),
            timeout=30,
            what="the session Migrating",
        )
        with ThreadPoolExecutor(max_workers=1) as pool:
            held = pool.submit(via_router, router_url, "id-live", history, "while it migrates")
            wait_for(
                operator,
                lambda: (
                    bool(scrapes.get("router", router_metrics))
                    and scrapes.value("router", "sessionfleet_router_held_turns") == 1
                ),
                timeout=30,
                what="the turn held by the router",
            )

            def moved() -> bool:
                scrape_operator()  # on every poll, while the drain's gauges last
                for item in crs.list("agentsessions"):
                    since = (item.get("status") or {}).get("migratingSince")
                    annotations = item["metadata"].get("annotations") or {}
                    if since and annotations.get(f"{ACK_PREFIX}{GHOST}") != since:
                        ack = {"metadata": {"annotations": {f"{ACK_PREFIX}{GHOST}": since}}}
                        crs.patch("agentsessions", item["metadata"]["name"], ack)
                return (
                    set(bound_to(crs).values()) == {"dst"}
                    and crs.status("inferenceworkers", "src").get("phase") == "Drained"
                )

            wait_for(operator, moved, timeout=60, what="the sessions on dst and src Drained")
            assert held.result(timeout=60).headers["x-sessionfleet-worker"] == "dst"

        # dst's pod deleted: a new epoch.
        core.delete_namespaced_pod("dst-1", namespace, grace_period_seconds=0)
        wait_for(
            operator,
            lambda: (
                (status := crs.status("inferenceworkers", "dst")).get("epoch") == 2
                and status.get("phase") == "Ready"
            ),
            timeout=60,
            what="dst's epoch 2 Ready",
        )
        via_router(router_url, "id-live", history, "after the new epoch")
        until_served("operator", scrape_operator, "sessionfleet_recoveries_total")
        scrapes.get("router", router_metrics)
        scrapes.get("node agent", f"{agent_url}/metrics")
        scrape_engine("dst")
    finally:
        router.stop()
        agent.stop()

    used: dict[str, list[str]] = {}
    for where, names in dashboard_queries() + rule_queries():
        for name in names:
            used.setdefault(name, []).append(where)
    served = scrapes.union()
    declared = exported()

    exempt: dict[str, str] = {}
    for name, (reason, gauge) in EXEMPT.items():
        assert declared.get(name, "").startswith("node agent"), (
            f"exempt {name} is not a metric the node agent declares"
        )
        assert name in used, f"exempt {name} is used by no panel or rule: drop the exemption"
        if gauge is None or scrapes.value("node agent", gauge) == 0:
            exempt[name] = reason
    missing = sorted(set(used) - served - PROMETHEUS_SERIES - set(exempt))
    assert not missing, "\n".join(
        f"{name} ({declared.get(name, 'declared by no component')}) was not served live;"
        f"\n    used in {used[name][0]}"
        for name in missing
    )
    # Every component answered with its own names.
    for component, name in (
        ("operator", "sessionfleet_operator_leader"),
        ("router", "sessionfleet_router_requests_total"),
        ("node agent", "sessionfleet_agent_nvml_available"),
        ("vLLM (sim engine)", "vllm:prefix_cache_hits_total"),
    ):
        assert name in scrapes.names[component], component
    print("\nexempt here:\n" + "\n".join(f"  {n}: {r}" for n, r in sorted(exempt.items())))
