"""Scale benchmark: 100,000 live sessions on 500 workers, then churn, drains and failures.

Run from the repository root (after ``make venv`` and ``make e2e-tools``)::

    .venv/bin/python bench/scale/run.py [--out FILE]      # make bench-scale

It starts a real control plane (the e2e harness) with ``--nodes`` KWOK nodes of
``--gpus-per-node`` GPUs, and in one namespace:

- ``--workers`` InferenceWorkers of one GPU each, running the simulated engine. Their
  pods are KWOK's alone (Running and Ready, an IP from its loopback range), and one
  process (``bench/scale/engines.py``) serves every pod's engine at its IP: 500 engine
  processes would not fit in the machine's memory beside the control plane;
- the operator (``sessionfleet operator``, defaults but ``--scrape-interval`` and
  ``--session-writes``) and
  ``--routers`` routers, as real processes;
- a DrainPolicy that migrates a drained worker's sessions at once.

Then, in order (client-side bind latency: create sent -> this process's watch sees
Bound, as in bench/operator/run.py, whose helpers it uses):

1. **small**: ``--small`` sessions at ``--small-rate``/s (1,000 at 50/s): bind latency
   and operator CPU per bind with few sessions live;
2. **fill**: sessions created open loop at ``--fill-rate``/s until ``--live`` are live
   (100,000); the operator's resident memory when 10,000 and when all are bound, the
   routers' once all are bound;
3. **churn** for ``--churn-seconds``: live sessions finished (and deleted by the
   operator, ``ttlSecondsAfterFinished: 0``) and new ones created, each at
   ``--churn-rate``/s; turns through the routers at ``--turn-rate``/s; ``--drain``
   workers drained (``spec.drain``) and the pods of ``--fail`` others deleted. Bind
   latency of the new sessions, operator CPU per bind, API requests per second (the
   API server's own counters, and the operator's and routers' own write counters),
   each drained worker's drain time and each failed worker's time to Ready again;
4. **restarts**: the operator, then one router, restarted with every session live:
   the time each takes to list them and be ready again.

Also reported: the fleet loop's pass durations (full and marked, from the operator's
``sessionfleet_operator_pass_seconds``), etcd's database size, and the machine's load
in each phase. Everything is on loopback; nothing here is pass/fail.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.append(str(REPO))  # after the standard library: see e2e/localcluster/__main__.py

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from bench.operator.run import (  # noqa: E402
    PhaseClock,
    Tracker,
    cpu_seconds,
    create_sessions,
    finish_sessions,
    latency_summary,
    log,
    mib,
    operator_counter,
    parse_request_totals,
    percentile,
    proc_status,
    publish,
    sample_load,
    session_body,
    wait_for,
    watch_sessions,
    write_rows,
)
from bench.profiler import Recording  # noqa: E402
from e2e.helpers import wait_established  # noqa: E402
from e2e.localcluster import LocalCluster, gpu_pod_tolerations  # noqa: E402
from e2e.operator import (  # noqa: E402
    CHART_ELECTION_ARGS,
    OperatorProcess,
    Process,
    start_router,
)
from sessionfleet.kube import PODS, WORKERS, Kube, KubeConfig, KubeError  # noqa: E402
from sessionfleet.resources.names import session_object_name  # noqa: E402

GROUP, VERSION = "sessionfleet.dev", "v1alpha1"
MODEL = "m"
NAMESPACE = "bench-scale"
CRDS_DIR = REPO / "crds"
POLICY = "bench-migrate"


def worker_body(name: str, max_sessions: int) -> dict[str, Any]:
    """A simulated-engine worker whose pod KWOK runs alone (no backer label)."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceWorker",
        "metadata": {"name": name, "labels": {"bench": "scale"}},
        "spec": {
            "model": MODEL,
            "engine": {"type": "sim"},
            "gpus": 1,
            "capacity": {"maxSessions": max_sessions},
            "drainPolicyRef": POLICY,
            "template": {"tolerations": gpu_pod_tolerations()},
        },
    }


def drain_policy() -> dict[str, Any]:
    """Migrate a drained worker's sessions at once, holding it until they have moved."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "DrainPolicy",
        "metadata": {"name": POLICY},
        "spec": {
            "mode": "Migrate",
            "deadline": "10m",
            "onDeadline": "Release",
            "triggers": {"workerDrain": True},
            "holds": ["PodDisruptionBudget"],
        },
    }


SESSION_IDS: dict[str, str] = {}
"""Each benchmark session's object name to its session id (what a client sends)."""


def new_sessions(prefix: str, count: int) -> list[str]:
    """Names of new sessions, named as a router names them, so their turns find them."""
    names = []
    for index in range(count):
        session_id = f"{prefix}{index:06d}"
        name = session_object_name(session_id)
        SESSION_IDS[name] = session_id
        names.append(name)
    return names


def body_of(name: str) -> dict[str, Any]:
    """The AgentSession of a benchmark session, as a router would create it."""
    body = session_body(name)
    body["spec"]["sessionId"] = SESSION_IDS[name]
    return body


# ---------------------------------------------------------------- metrics text


def samples(text: str, family: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of one metric family: (sample name, labels, value)."""
    return [
        (s.name, s.labels, s.value)
        for f in text_string_to_metric_families(text)
        if f.name == family
        for s in f.samples
    ]


def histogram_summary(text: str, family: str, **match: str) -> dict[str, float]:
    """Count, mean and the bucket bound of the 99th percentile of one histogram's series."""
    count = total = 0.0
    buckets: list[tuple[float, float]] = []
    for name, labels, value in samples(text, family):
        if any(labels.get(k) != v for k, v in match.items()):
            continue
        if name.endswith("_count"):
            count += value
        elif name.endswith("_sum"):
            total += value
        elif name.endswith("_bucket"):
            buckets.append((float(labels["le"]), value))
    p99 = next((le for le, seen in sorted(buckets) if count and seen >= 0.99 * count), None)
    return {
        "count": int(count),
        "mean": round(total / count, 4) if count else float("nan"),
        "p99_at_most": p99 if p99 is not None else float("nan"),
    }


async def write_queue_peaks(fleet: Fleet, stop: asyncio.Event) -> dict[str, int]:
    """The most session writes seen waiting for a turn, by urgency, sampled every 2 s."""
    peaks: Counter[str] = Counter()
    while not stop.is_set():
        try:
            text = await asyncio.to_thread(fleet.operator.metrics)
        except httpx.HTTPError:
            text = ""  # the operator busy past the timeout: the next sample
        for _, labels, value in samples(text, "sessionfleet_operator_session_writes_waiting"):
            peaks[labels["urgency"]] = max(peaks[labels["urgency"]], int(value))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 2.0)
    return dict(peaks)


def counter_total(text: str, family: str) -> float:
    """The sum of a counter family's ``_total`` samples."""
    return sum(v for name, _, v in samples(text, family) if name.endswith("_total"))


# ------------------------------------------------------------------- the fleet


@dataclass
class WorkerWatch:
    """Each worker's phase and epoch over time, from a list every ``every`` seconds.

    A list of 500 workers is 1.5 MB of JSON: read every second, it took a good part of
    this process's CPU, which the bind latency seen by its session watch then paid.
    """

    every: float = 2.0
    status: dict[str, dict[str, Any]] = field(default_factory=dict)
    ready_at: dict[tuple[str, int], float] = field(default_factory=dict)
    """When each (worker, epoch) was first seen Ready (monotonic)."""
    drained_at: dict[str, float] = field(default_factory=dict)

    def ready(self) -> int:
        """Workers Ready now."""
        return sum(1 for s in self.status.values() if s.get("phase") == "Ready")

    async def follow(self, kube: Kube) -> None:
        """List the workers until cancelled."""
        while True:
            try:
                items, _ = await kube.list(WORKERS, NAMESPACE)
            except KubeError as error:
                log(f"worker list failed: {error}")
                items = []
            now = time.monotonic()
            for item in items:
                name, status = item["metadata"]["name"], item.get("status") or {}
                self.status[name] = status
                if status.get("phase") == "Ready":
                    self.ready_at.setdefault((name, int(status.get("epoch") or 0)), now)
                elif status.get("phase") == "Drained":
                    self.drained_at.setdefault(name, now)
            await asyncio.sleep(self.every)


@dataclass
class Fleet:
    """The processes and clients of one run."""

    cluster: LocalCluster
    log_dir: Path
    kube: Kube
    clients: list[Kube]
    operator: OperatorProcess
    engines: Process | None = None
    routers: list[tuple[str, Process]] = field(default_factory=list)
    tracker: Tracker = field(default_factory=Tracker)
    workers: WorkerWatch = field(default_factory=lambda: WorkerWatch())

    @property
    def operator_pid(self) -> int:
        """The operator's process id."""
        assert self.operator.process is not None
        return self.operator.process.pid

    def kubectl(self, *args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run kubectl against the cluster (raises on failure)."""
        return self.cluster.kubectl(*args, input=input, timeout=300)

    def rss_mib(self, pid: int) -> float:
        """A process's resident memory, MiB."""
        return round(mib(proc_status(pid)["VmRSS"]), 1)

    def router_rss(self) -> list[float]:
        """Each router's resident memory, MiB."""
        return [self.rss_mib(router.popen.pid) for _, router in self.routers]

    def api_server_metrics(self) -> str:
        """The API server's /metrics text."""
        return self.kubectl("get", "--raw", "/metrics").stdout

    def etcd_db_mib(self) -> dict[str, float]:
        """etcd's database size (allocated, and in use), MiB."""
        assert self.cluster.state is not None
        port = self.cluster.state.ports["etcd_client"]
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        sizes = {
            name: value for name, _, value in samples(text, "etcd_mvcc_db_total_size_in_bytes")
        }
        in_use = {
            name: value
            for name, _, value in samples(text, "etcd_mvcc_db_total_size_in_use_in_bytes")
        }
        return {
            "db_mib": round(sum(sizes.values()) / 2**20, 1),
            "in_use_mib": round(sum(in_use.values()) / 2**20, 1),
        }

    def router_writes(self) -> dict[str, float]:
        """The routers' own counts of their API writes: session creates and usage writes."""
        created = flushed = 0.0
        for url, _ in self.routers:
            text = httpx.get(f"{url}/metrics", timeout=10).text
            created += counter_total(text, "sessionfleet_router_sessions_created")
            flushed += counter_total(text, "sessionfleet_router_status_flushes")
        return {"creates": created, "status_writes": flushed}

    def phase(self) -> PhaseClock:
        """Start timing a phase: the operator's CPU and the machine's load over it."""
        return PhaseClock(self.operator_pid, time.monotonic(), cpu_seconds(self.operator_pid))


def prepare(fleet: Fleet) -> None:
    """CRDs, the namespace with its default ServiceAccount, and the DrainPolicy."""
    fleet.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRDS_DIR))
    wait_established(fleet.cluster.kubectl, "-l", "app.kubernetes.io/part-of=sessionfleet")
    fleet.kubectl("create", "namespace", NAMESPACE)
    deadline = time.monotonic() + 60
    while fleet.cluster.kubectl("-n", NAMESPACE, "get", "sa", "default", check=False).returncode:
        if time.monotonic() > deadline:
            raise RuntimeError("the namespace's default ServiceAccount never appeared")
        time.sleep(0.5)
    fleet.kubectl("-n", NAMESPACE, "apply", "-f", "-", input=json.dumps(drain_policy()))


async def start_fleet(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    """Workers created, engines served, operator and routers started; all workers Ready."""
    started = time.monotonic()
    fleet.engines = Process(
        [
            sys.executable,
            str(REPO / "bench" / "scale" / "engines.py"),
            f"--kubeconfig={fleet.cluster.kubeconfig}",
            f"--namespace={NAMESPACE}",
            f"--model={MODEL}",
        ],
        fleet.log_dir / "engines.log",
    )
    fleet.operator.start()
    semaphore = asyncio.Semaphore(16)

    async def create(index: int) -> None:
        async with semaphore:
            body = worker_body(f"w{index:03d}", args.max_sessions)
            await fleet.kube.create(WORKERS, body, NAMESPACE)

    await asyncio.gather(*(create(index) for index in range(args.workers)))
    ready, _ = await wait_for("workers Ready", fleet.workers.ready, args.workers, 900)
    if ready < args.workers:
        raise RuntimeError(f"{ready}/{args.workers} workers Ready\n{fleet.operator.log_tail()}")
    for index in range(args.routers):
        kubeconfig = fleet.cluster.kubeconfig
        fleet.routers.append(start_router(kubeconfig, NAMESPACE, f"r{index}", fleet.log_dir))
    return {"workers": args.workers, "seconds": round(time.monotonic() - started, 1)}


def bind_figures(fleet: Fleet, names: list[str], clock: PhaseClock, rate: float) -> dict[str, Any]:
    """Bind latency of ``names`` and the operator's CPU per bind over ``clock``'s phase."""
    summary = latency_summary(fleet.tracker, names)
    summary.pop("per_worker")
    phase = clock.summary()
    bound = summary["bound"]
    return {
        **summary,
        "rate_target": rate,
        **phase,
        "operator_cpu_ms_per_bind": (
            round(1000 * phase["operator_cpu_seconds"] / bound, 2) if bound else float("nan")
        ),
    }


async def turns(
    fleet: Fleet, live: Callable[[], list[str]], rate: float, stop: asyncio.Event
) -> Counter[str]:
    """Send one-turn requests for random live sessions through the routers, until stopped."""
    outcomes: Counter[str] = Counter()
    rng = random.Random(7)
    async with httpx.AsyncClient(timeout=60) as http:
        tasks: set[asyncio.Task[None]] = set()

        async def one(url: str, name: str) -> None:
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"turn of {name}"}]}
            try:
                answer = await http.post(
                    f"{url}/v1/chat/completions",
                    json=body,
                    headers={"X-Session-Id": SESSION_IDS[name]},
                )
                outcomes[str(answer.status_code)] += 1
            except httpx.HTTPError as error:
                outcomes[type(error).__name__] += 1

        while not stop.is_set():
            names = live()
            if names:
                url = fleet.routers[rng.randrange(len(fleet.routers))][0]
                task = asyncio.create_task(one(url, rng.choice(names)))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.sleep(1.0 / rate)
        await asyncio.gather(*tasks)
    return outcomes


async def drain_and_fail(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    """Drain ``--drain`` workers and delete the pods of ``--fail`` others; time both."""
    names = sorted(fleet.workers.status)
    drained, failed = names[: args.drain], names[args.drain : args.drain + args.fail]
    await asyncio.sleep(args.churn_seconds / 6)
    # Counted from this benchmark's own watch of the sessions: a worker's status counts
    # are written at most every workers / --counter-writes seconds (25 s at 500).
    tracker = fleet.tracker
    on = Counter(
        worker
        for name, worker in tracker.worker.items()
        if name not in tracker.finished and name not in tracker.deleted
    )
    pinned = {n: on[n] for n in drained}
    drain_start = time.monotonic()
    for name in drained:
        await fleet.kube.patch(WORKERS, name, {"spec": {"drain": True}}, NAMESPACE)
    await asyncio.sleep(args.churn_seconds / 6)
    epochs = {n: int(fleet.workers.status[n].get("epoch") or 0) for n in failed}
    fail_start = time.monotonic()
    for name in failed:
        pod = fleet.workers.status[name].get("pod")
        if pod:
            await fleet.kube.delete(PODS, pod, NAMESPACE)
    deadline = time.monotonic() + args.churn_seconds
    while time.monotonic() < deadline:
        done_draining = all(n in fleet.workers.drained_at for n in drained)
        recovered = all((n, epochs[n] + 1) in fleet.workers.ready_at for n in failed)
        if done_draining and recovered:
            break
        await asyncio.sleep(1.0)
    drain_seconds = [
        fleet.workers.drained_at[n] - drain_start for n in drained if n in fleet.workers.drained_at
    ]
    recovery_seconds = [
        fleet.workers.ready_at[(n, epochs[n] + 1)] - fail_start
        for n in failed
        if (n, epochs[n] + 1) in fleet.workers.ready_at
    ]
    return {
        "drained_workers": len(drained),
        "drained": len(drain_seconds),
        "sessions_on_drained_workers": sum(pinned.values()),
        "drain_seconds": {
            "p50": round(percentile(drain_seconds, 50), 1),
            "max": round(max(drain_seconds, default=float("nan")), 1),
        },
        "failed_workers": len(failed),
        "recovered": len(recovery_seconds),
        "recovery_seconds": {
            "p50": round(percentile(recovery_seconds, 50), 1),
            "max": round(max(recovery_seconds, default=float("nan")), 1),
        },
    }


def api_rates(before: str, after: str, seconds: float) -> dict[str, Any]:
    """API requests per second between two /metrics snapshots: writes by who, reads by verb."""
    start, end = parse_request_totals(before), parse_request_totals(after)
    writes: Counter[str] = Counter()
    for row in write_rows(start, end):
        writes[f"{row.who}: {row.verb} {row.resource}"] += row.count
    reads: Counter[str] = Counter()
    for key, value in end.items():
        verb = key[3]
        if verb in ("GET", "LIST", "WATCH"):
            reads[verb] += value - start.get(key, 0)
    total = sum(end.values()) - sum(start.values())
    return {
        "all_per_second": round(total / seconds, 1),
        "writes_per_second": {k: round(v / seconds, 1) for k, v in sorted(writes.items()) if v},
        "reads_per_second": {k: round(v / seconds, 1) for k, v in sorted(reads.items()) if v},
    }


async def wait_ready(url: str, timeout: float) -> float:
    """Seconds until ``url`` answers 200 (``nan`` if it never does)."""
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=5) as http:
        while time.monotonic() - started < timeout:
            try:
                if (await http.get(url)).status_code == 200:
                    return round(time.monotonic() - started, 1)
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    return float("nan")


async def restarts(fleet: Fleet) -> dict[str, Any]:
    """Restart the operator, then router r0, with every session live: time to ready."""
    fleet.operator.stop()
    fleet.operator.start()
    operator_ready = await wait_ready(f"http://127.0.0.1:{fleet.operator.health_port}/readyz", 600)
    url, router = fleet.routers[0]
    router.stop()
    started = time.monotonic()
    # A router lists every session before it is ready: over 30 s at 100,000 under load.
    fleet.routers[0] = await asyncio.to_thread(
        start_router, fleet.cluster.kubeconfig, NAMESPACE, "r0", fleet.log_dir, ready_within=600
    )
    return {
        "operator_restart_to_ready_seconds": operator_ready,
        "operator_rss_mib_after_restart": fleet.rss_mib(fleet.operator_pid),
        "router_restart_to_ready_seconds": round(time.monotonic() - started, 1),
        "router_rss_mib_after_restart": fleet.rss_mib(fleet.routers[0][1].popen.pid),
        "previous_router_url": url,
    }


async def measure(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    """Run every phase; return the figures."""
    results: dict[str, Any] = {}
    tracker = fleet.tracker
    clocks: list[PhaseClock] = []
    background = [
        asyncio.create_task(watch_sessions(fleet.kube, NAMESPACE, tracker)),
        asyncio.create_task(sample_load(clocks)),
    ]
    try:
        results["setup"] = {**results.get("setup", {}), "etcd": fleet.etcd_db_mib()}
        # Let the start settle (every worker's first status writes and scrapes) so the
        # first phase measures binds, not the fleet's start.
        clocks.append(fleet.phase())
        await asyncio.sleep(args.settle)
        results["idle"] = {
            "operator_rss_mib": fleet.rss_mib(fleet.operator_pid),
            **clocks[-1].summary(),
        }
        log(f"idle with {args.workers} workers: {results['idle']}")

        # 1. Few sessions live.
        small = new_sessions("a", args.small)
        clocks.append(fleet.phase())
        log(f"small: {len(small)} sessions at {args.small_rate}/s")
        with profiled(fleet, args, "small") as profile:
            await create_sessions(
                fleet.clients, NAMESPACE, small, args.small_rate, 64, tracker, body_of
            )
            await wait_for("bound", lambda: tracker.count(small, tracker.bound), len(small), 300)
        results["small"] = bind_figures(fleet, small, clocks[-1], args.small_rate)
        results["small"].update(profile_of(profile))
        log(f"  {results['small']['bind_ms']}")
        save_partial(args, results)

        # 2. Fill up to --live.
        fill = new_sessions("b", args.live - len(small))
        clocks.append(fleet.phase())
        log(f"fill: {len(fill)} sessions at {args.fill_rate}/s")
        memory: dict[str, Any] = {}

        async def at_ten_thousand() -> None:
            while len(tracker.bound) < 10_000:
                await asyncio.sleep(0.5)
            memory["operator_rss_mib_at_10k"] = fleet.rss_mib(fleet.operator_pid)

        probe = asyncio.create_task(at_ten_thousand())
        with profiled(fleet, args, "fill") as profile:
            pace = await create_sessions(
                fleet.clients, NAMESPACE, fill, args.fill_rate, args.max_in_flight, tracker, body_of
            )
            await wait_for(
                "bound", lambda: tracker.count(fill, tracker.bound), len(fill), 1800, every=30
            )
        probe.cancel()  # a run of fewer than 10,000 sessions has no such figure
        results["fill"] = {
            **bind_figures(fleet, fill, clocks[-1], args.fill_rate),
            "rate_achieved": round(pace.rate, 1),
            "start_lag_p99_s": round(pace.p99_lag, 3),
            **profile_of(profile),
        }
        await asyncio.sleep(10)
        results["at_live"] = {
            "live": args.live,
            **memory,
            "operator_rss_mib": fleet.rss_mib(fleet.operator_pid),
            "operator_peak_rss_mib": round(mib(proc_status(fleet.operator_pid)["VmHWM"]), 1),
            "router_rss_mib": fleet.router_rss(),
            "etcd": fleet.etcd_db_mib(),
        }
        log(f"  at {args.live} live: {results['at_live']}")
        save_partial(args, results)

        # 3. Churn with drains and failures.
        live = [*small, *fill]
        count = int(args.churn_rate * args.churn_seconds)
        finishing, arriving = live[:count], new_sessions("c", count)
        api_before = await asyncio.to_thread(fleet.api_server_metrics)
        op_before = operator_counter(await asyncio.to_thread(fleet.operator.metrics))
        routers_before = fleet.router_writes()
        clocks.append(fleet.phase())
        started = time.monotonic()
        stop = asyncio.Event()
        bound_live = [n for n in live[count:] if n in tracker.bound]
        turn_task = asyncio.create_task(turns(fleet, lambda: bound_live, args.turn_rate, stop))
        faults = asyncio.create_task(drain_and_fail(fleet, args))
        queue = asyncio.create_task(write_queue_peaks(fleet, stop))
        log(f"churn: {count} finished and {count} new at {args.churn_rate}/s, turns, faults")
        with profiled(fleet, args, "churn") as profile:
            create_pace, _ = await asyncio.gather(
                create_sessions(
                    fleet.clients,
                    NAMESPACE,
                    arriving,
                    args.churn_rate,
                    args.max_in_flight,
                    tracker,
                    body_of,
                ),
                finish_sessions(fleet.clients[-1], NAMESPACE, finishing, args.churn_rate, tracker),
            )
        seconds = time.monotonic() - started
        await wait_for("bound", lambda: tracker.count(arriving, tracker.bound), count, 600)
        stop.set()
        turn_outcomes = await turn_task
        fault_figures = await faults
        queue_peaks = await queue
        api_after = await asyncio.to_thread(fleet.api_server_metrics)
        op_text = await asyncio.to_thread(fleet.operator.metrics)
        op_after = operator_counter(op_text)
        routers_after = fleet.router_writes()
        results["churn"] = {
            **bind_figures(fleet, arriving, clocks[-1], args.churn_rate),
            "seconds": round(seconds, 1),
            "create_rate_achieved": round(create_pace.rate, 1),
            "finished_then_deleted": tracker.count(finishing, tracker.deleted),
            "turns": dict(turn_outcomes),
            "api": api_rates(api_before, api_after, seconds),
            "operator_writes_per_second": round(
                (sum(op_after.values()) - sum(op_before.values())) / seconds, 1
            ),
            "router_writes_per_second": {
                k: round((routers_after[k] - routers_before[k]) / seconds, 1) for k in routers_after
            },
            **fault_figures,
            "session_writes_waiting_peak": queue_peaks,
            # The operator's own clocks: from the drain's start to Drained, and from a
            # new epoch's start to Ready (this benchmark lists workers every 2 s only).
            "operator_drain_seconds": histogram_summary(
                op_text, "sessionfleet_drain_duration_seconds"
            ),
            "operator_recovery_seconds": histogram_summary(
                op_text, "sessionfleet_recovery_duration_seconds"
            ),
            "router_rss_mib": fleet.router_rss(),
            "operator_rss_mib": fleet.rss_mib(fleet.operator_pid),
            **profile_of(profile),
        }
        log(f"  churn: {results['churn']['bind_ms']}")
        save_partial(args, results)

        # The fleet loop's passes, over the whole run so far.
        text = await asyncio.to_thread(fleet.operator.metrics)
        results["passes"] = {
            kind: histogram_summary(text, "sessionfleet_operator_pass_seconds", kind=kind)
            for kind in ("full", "marked")
        }
        results["etcd"] = fleet.etcd_db_mib()

        # 4. Restarts with everything live.
        results["restarts"] = await restarts(fleet)
        log(f"  restarts: {results['restarts']}")
    finally:
        for task in background:
            task.cancel()
    return {**results, **tracker.errors()}


def profiled(
    fleet: Fleet, args: argparse.Namespace, phase: str
) -> contextlib.AbstractContextManager[Recording | None]:
    """With ``--profile``, py-spy on the operator for the phase (bench/profiler.py)."""
    if not args.profile:
        return contextlib.nullcontext()
    where = args.out.parent if args.out is not None else Path("build")
    return Recording(fleet.operator_pid, where / f"bench-scale-profile-{phase}.txt")


def profile_of(recording: Recording | None, top: int = 15) -> dict[str, Any]:
    """The phase's profile summary for the figures (nothing without ``--profile``)."""
    if recording is None:
        return {}
    summary = recording.summary
    shown = {k: v[:top] if isinstance(v, list) else v for k, v in summary.items()}
    return {"operator_profile": shown}


def save_partial(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """Write the figures so far next to ``--out``: a long run stopped midway keeps them."""
    if args.out is not None:
        args.out.with_suffix(".partial.json").write_text(json.dumps(results, indent=2) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-dir", type=Path, help="state dir of the cluster started here")
    parser.add_argument("--nodes", type=int, default=125, help="KWOK GPU nodes")
    parser.add_argument("--gpus-per-node", type=int, default=4)
    parser.add_argument("--workers", type=int, default=500, help="InferenceWorkers, 1 GPU each")
    parser.add_argument("--max-sessions", type=int, default=300, help="capacity per worker")
    parser.add_argument("--routers", type=int, default=2)
    parser.add_argument("--small", type=int, default=1000, help="sessions of the small phase")
    parser.add_argument("--small-rate", type=float, default=50.0)
    parser.add_argument("--live", type=int, default=100_000, help="sessions live after the fill")
    parser.add_argument("--fill-rate", type=float, default=250.0)
    parser.add_argument("--churn-rate", type=float, default=200.0, help="finishes and creates /s")
    parser.add_argument("--churn-seconds", type=float, default=120.0)
    parser.add_argument("--turn-rate", type=float, default=20.0, help="turns per second in churn")
    parser.add_argument("--drain", type=int, default=10, help="workers drained in churn")
    parser.add_argument("--fail", type=int, default=5, help="workers whose pod is deleted")
    parser.add_argument("--clients", type=int, default=4, help="API clients creating sessions")
    parser.add_argument("--max-in-flight", type=int, default=128, help="open creates at most")
    parser.add_argument("--scrape-interval", type=float, default=15.0)
    parser.add_argument("--session-writes", type=int, default=16, help="the operator's flag")
    parser.add_argument("--settle", type=float, default=30.0, help="idle seconds before phase 1")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="py-spy the operator in each phase (make profile-tools); raw stacks beside --out",
    )
    args = parser.parse_args(argv)
    if args.workers > args.nodes * args.gpus_per_node:
        parser.error("--workers must fit on --nodes x --gpus-per-node GPUs")
    spare = (args.workers - args.drain - args.fail) * args.max_sessions
    if spare < args.live + args.churn_rate * args.churn_seconds:
        parser.error("the workers left after drains and failures cannot hold every session")
    return args


async def run(args: argparse.Namespace, cluster: LocalCluster, log_dir: Path) -> dict[str, Any]:
    """Set the fleet up, measure, stop the processes."""
    config = KubeConfig.load(str(cluster.kubeconfig))
    fleet = Fleet(
        cluster=cluster,
        log_dir=log_dir,
        kube=Kube(config, user_agent="bench-scale"),
        clients=[Kube(config, user_agent=f"bench-scale/{i}") for i in range(args.clients)],
        operator=OperatorProcess(
            cluster.kubeconfig,
            NAMESPACE,
            log_dir,
            "--resync=2",
            f"--scrape-interval={args.scrape_interval}",
            f"--session-writes={args.session_writes}",
            "--node-not-ready-toleration=30s",
            # The chart's Lease timings: the e2e suite's 4 s renew deadline is for
            # failover tests, and a leader that cannot renew in time exits.
            *CHART_ELECTION_ARGS,
        ),
    )
    follow = asyncio.create_task(fleet.workers.follow(fleet.kube))
    try:
        prepare(fleet)
        setup = await start_fleet(fleet, args)
        log(f"fleet Ready: {setup}; operator pid {fleet.operator_pid}")
        results = await measure(fleet, args)
        results["setup"] = {**setup, **results.get("setup", {})}
        return results
    finally:
        follow.cancel()
        for _, router in fleet.routers:
            router.stop()
        fleet.operator.stop()
        if fleet.engines is not None:
            fleet.engines.stop()
        for client in (fleet.kube, *fleet.clients):
            await client.aclose()


def report(results: dict[str, Any]) -> str:
    """The figures as Markdown tables."""
    lines = ["| phase | sessions | bind p50 ms | bind p99 ms | operator ms CPU/bind | load |"]
    lines.append("| --- | ---: | ---: | ---: | ---: | ---: |")
    for phase in ("small", "fill", "churn"):
        figures = results.get(phase)
        if figures:
            lines.append(
                f"| {phase} at {figures['rate_target']:g}/s | {figures['sessions']} | "
                f"{figures['bind_ms']['p50']} | {figures['bind_ms']['p99']} | "
                f"{figures['operator_cpu_ms_per_bind']} | {figures['load_1m_mean']} |"
            )
    lines.append("")
    lines.append(
        json.dumps({k: v for k, v in results.items() if k not in ("small", "fill")}, indent=2)
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Start a cluster, run the benchmark, print and save the figures."""
    args = parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    cluster = LocalCluster.start(
        args.state_dir, gpu_nodes=args.nodes, gpus_per_node=args.gpus_per_node
    )
    try:
        results = asyncio.run(run(args, cluster, log_dir))
    finally:
        cluster.stop()
    publish(results, report(results), f"logs: {log_dir}", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
