"""Operator benchmark: bind latency, API writes per session, resident memory.

Run from the repository root (after ``make venv`` and ``make e2e-tools``)::

    .venv/bin/python bench/operator/run.py [--out FILE]   # make bench-operator

It starts a real control plane (the e2e harness: etcd, kube-apiserver, controller
manager, scheduler, KWOK fake GPU nodes, the pod backer; or uses ``--kubeconfig``),
applies the CRDs, creates a few InferenceWorkers running the simulated engine behind
backed KWOK pods, and runs ``sessionfleet operator`` as a real process serving one
namespace with its default resync and scrape intervals. Then, in order:

1. **Bind latency.** ``--sessions`` AgentSessions are created open loop at ``--rate``
   per second (a paced creator: each create is sent at its scheduled time whatever
   the earlier ones are doing, bounded only by ``--max-in-flight``). Latency is
   client-side: the monotonic time the create request was sent, to the time this
   process's own watch of AgentSessions first sees ``status.phase == Bound``
   (creationTimestamp has 1 s resolution, so it is not used). The watch's delivery
   delay is part of the figure, as it is for any client of the binding. The operator
   stamps ``status.boundAt`` when it decides a binding; against the wall-clock send
   time it splits the latency into "until the operator acted" and "until seen".
2. **Operator resident memory** (``VmRSS`` of its process) with those sessions bound,
   and its CPU use over an idle window (``--idle-window``).
3. **API server writes per session over its life.** The API server's own
   ``apiserver_request_total`` is read (``kubectl get --raw /metrics``) before step 1
   and after every session was marked ``spec.finished: true``, set Finished by the
   operator and deleted by it (``ttlSecondsAfterFinished: 0``). Write verbs on
   ``agentsessions`` are split by who sends them: this client only creates sessions
   and patches their spec; the operator only patches their status and deletes them.
   Writes the operator makes on other objects meanwhile (worker status with its
   pinned-session count, holds) are fleet-level and shown apart.
4. **Memory at scale.** ``--big`` sessions created at ``--big-rate`` per second by
   ``--clients`` concurrent API clients, the operator's ``VmRSS`` once all are bound
   (and its idle CPU with them). A burst leaves a higher resident size than the same
   sessions created slowly (``--big-rate 50``): CPython keeps the arenas it used.

The machine's load average is sampled during each phase and reported with it: on a
shared machine the latencies follow the load, the write counts and memory do not.

Everything is on loopback. Nothing here is pass/fail; the figures are printed as a
table and, with ``--out``, written as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
# Appended, not prepended: the repository root holds a folder named operator/, which
# must not hide the standard library's operator module.
sys.path.append(str(REPO))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from e2e.helpers import wait_established  # noqa: E402
from e2e.localcluster import LocalCluster, find_tools  # noqa: E402
from e2e.operator import OperatorProcess, session, sim_worker  # noqa: E402
from sessionfleet.kube import SESSIONS, WORKERS, Gone, Kube, KubeConfig, KubeError  # noqa: E402

GROUP = "sessionfleet.dev"
MODEL = "m"
WRITE_VERBS = ("POST", "PUT", "PATCH", "APPLY", "DELETE", "DELETECOLLECTION")
CRDS_DIR = REPO / "crds"

# ---------------------------------------------------------------- small utilities


def log(message: str) -> None:
    """One progress line on stderr, with the wall-clock time."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


def proc_status(pid: int) -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` (peak) of a process, in KiB."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0])
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    # After the command name: state is field 3, utime 14 and stime 15 (1-based).
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def mib(kib: int) -> float:
    """KiB to MiB."""
    return kib / 1024


# ------------------------------------------------------- the API server's counters

RequestKey = tuple[str, str, str, str, str]  # group, resource, subresource, verb, code


def parse_request_totals(text: str) -> Counter[RequestKey]:
    """``apiserver_request_total`` by (group, resource, subresource, verb, code)."""
    totals: Counter[RequestKey] = Counter()
    for family in text_string_to_metric_families(text):
        if family.name != "apiserver_request":
            continue
        for sample in family.samples:
            if sample.name != "apiserver_request_total":
                continue
            labels = sample.labels
            key = (
                labels.get("group", ""),
                labels.get("resource", ""),
                labels.get("subresource", ""),
                labels.get("verb", ""),
                labels.get("code", ""),
            )
            totals[key] += int(sample.value)
    return totals


def who_writes(group: str, resource: str, subresource: str, verb: str) -> str:
    """Attribute a write to the benchmark client, the operator, or the cluster itself.

    The client only creates AgentSessions and patches their spec; the operator only
    patches their status and deletes them. Worker status, worker pods and
    PodDisruptionBudgets are the operator's fleet-level writes (the pod backer and
    KWOK write pods' status subresource, not the pods themselves).
    """
    if group == GROUP and resource == "agentsessions":
        if subresource == "" and verb in ("POST", "PATCH", "APPLY", "PUT"):
            return "client"
        return "operator"
    if group == GROUP:
        return "operator (fleet)"
    if (group, resource, subresource) in (("", "pods", ""), ("policy", "poddisruptionbudgets", "")):
        return "operator (fleet)"
    return "cluster"


@dataclass(frozen=True)
class WriteRow:
    """Write requests of one kind between two snapshots."""

    who: str
    group: str
    resource: str
    verb: str
    count: int
    failed: int

    @property
    def resource_path(self) -> str:
        """``resource[/subresource]`` with its API group."""
        return f"{self.resource} ({self.group or 'core'})"


def write_rows(before: Counter[RequestKey], after: Counter[RequestKey]) -> list[WriteRow]:
    """The write requests made between two snapshots, by who, resource and verb."""
    counts: Counter[tuple[str, str, str, str]] = Counter()
    failures: Counter[tuple[str, str, str, str]] = Counter()
    for key, value in after.items():
        group, resource, subresource, verb, code = key
        delta = value - before.get(key, 0)
        if verb not in WRITE_VERBS or delta <= 0:
            continue
        path = f"{resource}/{subresource}" if subresource else resource
        row = (who_writes(group, resource, subresource, verb), group, path, verb)
        counts[row] += delta
        if not code.startswith("2"):
            failures[row] += delta
    order = {"client": 0, "operator": 1, "operator (fleet)": 2, "cluster": 3}
    rows = [WriteRow(*row, count, failures[row]) for row, count in counts.items()]
    return sorted(rows, key=lambda r: (order[r.who], r.group, r.resource, r.verb))


def operator_counter(text: str) -> Counter[tuple[str, str]]:
    """The operator's own ``sessionfleet_operator_api_writes_total`` by (verb, resource)."""
    totals: Counter[tuple[str, str]] = Counter()
    for family in text_string_to_metric_families(text):
        if family.name != "sessionfleet_operator_api_writes":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                totals[(sample.labels["verb"], sample.labels["resource"])] += int(sample.value)
    return totals


# ---------------------------------------------------------------- the session watch


@dataclass
class Tracker:
    """When each session's create was sent and answered, and when the watch saw it move."""

    sent: dict[str, float] = field(default_factory=dict)
    sent_wall: dict[str, float] = field(default_factory=dict)
    """Wall-clock send times, to compare with the operator's ``status.boundAt``."""
    bound_at: dict[str, float] = field(default_factory=dict)
    """``status.boundAt`` (when the operator decided the binding), as a Unix time."""
    acked: dict[str, float] = field(default_factory=dict)
    bound: dict[str, float] = field(default_factory=dict)
    finished: dict[str, float] = field(default_factory=dict)
    deleted: dict[str, float] = field(default_factory=dict)
    worker: dict[str, str] = field(default_factory=dict)
    create_errors: Counter[str] = field(default_factory=Counter)
    patch_errors: Counter[str] = field(default_factory=Counter)
    watch_restarts: int = 0
    relisted: int = 0

    def observe(self, kind: str, obj: dict[str, Any], now: float) -> None:
        """Record what one watch event says about its session."""
        name = str((obj.get("metadata") or {}).get("name", ""))
        if kind == "DELETED":
            self.deleted.setdefault(name, now)
            return
        status = obj.get("status") or {}
        phase = status.get("phase")
        if phase == "Bound" and name not in self.bound:
            self.bound[name] = now
            self.worker[name] = str(status.get("worker"))
            stamp = status.get("boundAt")
            if stamp:
                self.bound_at[name] = datetime.fromisoformat(
                    stamp.replace("Z", "+00:00")
                ).timestamp()
        elif phase == "Finished":
            self.finished.setdefault(name, now)

    def errors(self) -> dict[str, Any]:
        """The failed creates and patches, by error, and how often the watch restarted."""
        return {
            "create_errors": dict(self.create_errors),
            "patch_errors": dict(self.patch_errors),
            "watch_restarts": self.watch_restarts,
        }

    def count(self, names: Iterable[str], seen: dict[str, float]) -> int:
        """How many of ``names`` are in ``seen``."""
        return sum(1 for name in names if name in seen)


async def watch_sessions(kube: Kube, namespace: str, tracker: Tracker) -> None:
    """Follow the namespace's AgentSessions until cancelled (list, then watch; relist on 410)."""
    resource_version = ""
    for _attempt in range(1000):  # bounded: a healthy watch restarts every 5 minutes
        try:
            if not resource_version:
                items, resource_version = await kube.list(SESSIONS, namespace)
                now = time.monotonic()
                for item in items:
                    tracker.observe("ADDED", item, now)
                tracker.relisted += 1
            async for kind, obj in kube.watch(
                SESSIONS, namespace, resource_version=resource_version, timeout_seconds=300
            ):
                now = time.monotonic()
                resource_version = str(
                    (obj.get("metadata") or {}).get("resourceVersion", resource_version)
                )
                if kind != "BOOKMARK":
                    tracker.observe(kind, obj, now)
        except Gone:
            resource_version = ""
        except KubeError as error:
            log(f"session watch interrupted ({error}); restarting")
            await asyncio.sleep(0.5)
        tracker.watch_restarts += 1


# ------------------------------------------------------------------ paced requests


@dataclass(frozen=True)
class Pace:
    """How well a paced run kept to its schedule."""

    requests: int
    seconds: float
    max_lag: float
    p99_lag: float

    @property
    def rate(self) -> float:
        """Requests sent per second, achieved."""
        return self.requests / self.seconds if self.seconds else float("nan")


async def paced(
    count: int,
    rate: float,
    max_in_flight: int,
    send: Callable[[int], Awaitable[None]],
) -> Pace:
    """Call ``send(i)`` for i in 0..count-1 at ``rate`` per second, open loop.

    Each call starts at its scheduled time unless ``max_in_flight`` calls are already
    waiting for answers; how late calls started is reported, so a saturated client or
    server shows up instead of silently turning the run into a closed loop.
    """
    in_flight = asyncio.Semaphore(max_in_flight)
    tasks: list[asyncio.Task[None]] = []
    lags: list[float] = []
    start = time.monotonic()

    async def one(index: int) -> None:
        try:
            await send(index)
        finally:
            in_flight.release()

    for index in range(count):
        due = start + index / rate
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        await in_flight.acquire()
        lags.append(max(0.0, time.monotonic() - due))
        tasks.append(asyncio.create_task(one(index)))
    await asyncio.gather(*tasks)
    return Pace(count, time.monotonic() - start, max(lags, default=0.0), percentile(lags, 99))


def session_body(name: str) -> dict[str, Any]:
    """An AgentSession as a router creates it, deleted as soon as it finishes."""
    return session(name, MODEL, ttlSecondsAfterFinished=0)


async def create_sessions(
    clients: list[Kube],
    namespace: str,
    names: list[str],
    rate: float,
    max_in_flight: int,
    tracker: Tracker,
    body_of: Callable[[str], dict[str, Any]] = session_body,
) -> Pace:
    """Create the sessions at ``rate`` per second, spread over ``clients``."""

    async def send(index: int) -> None:
        name = names[index]
        body = body_of(name)
        client = clients[index % len(clients)]
        for _attempt in range(3):  # a create that fails is retried; its clock restarts
            tracker.sent[name] = time.monotonic()
            tracker.sent_wall[name] = time.time()
            try:
                await client.create(SESSIONS, body, namespace)
            except KubeError as error:
                tracker.create_errors[type(error).__name__] += 1
                if error.status == 409:
                    break  # a timed-out create that did land
                await asyncio.sleep(0.2)
                continue
            tracker.acked[name] = time.monotonic()
            return

    return await paced(len(names), rate, max_in_flight, send)


async def finish_sessions(
    client: Kube, namespace: str, names: list[str], rate: float, tracker: Tracker
) -> Pace:
    """Mark each session ``spec.finished: true`` (one merge patch each), paced."""
    patch = {"spec": {"finished": True}}

    async def send(index: int) -> None:
        try:
            await client.patch(SESSIONS, names[index], patch, namespace)
        except KubeError as error:
            tracker.patch_errors[type(error).__name__] += 1

    return await paced(len(names), rate, 32, send)


async def wait_for(
    what: str, done: Callable[[], int], total: int, timeout: float, every: float = 5.0
) -> tuple[int, float]:
    """Poll ``done()`` (a count) until it reaches ``total`` or ``timeout`` passes."""
    start = time.monotonic()
    last_report = start
    while True:
        reached = int(done())
        now = time.monotonic()
        if reached >= total:
            return reached, now - start
        if now - start > timeout:
            log(f"gave up waiting for {what}: {reached}/{total} after {timeout:.0f} s")
            return reached, now - start
        if now - last_report >= every:
            log(f"  {what}: {reached}/{total}")
            last_report = now
        await asyncio.sleep(0.1)


# ---------------------------------------------------------------------- the fleet


@dataclass
class PhaseClock:
    """The start of a phase, to report the operator's CPU use and the load over it."""

    pid: int
    started: float
    cpu_at_start: float
    load: list[float] = field(default_factory=list)

    def sample_load(self) -> None:
        """Record the machine's 1-minute load average now."""
        self.load.append(os.getloadavg()[0])

    def summary(self) -> dict[str, float]:
        """Seconds elapsed, operator CPU seconds and share of one core, mean load."""
        seconds = time.monotonic() - self.started
        cpu = cpu_seconds(self.pid) - self.cpu_at_start
        self.sample_load()
        return {
            "seconds": round(seconds, 1),
            "operator_cpu_seconds": round(cpu, 1),
            "operator_cpu_share": round(cpu / seconds, 2) if seconds else float("nan"),
            "load_1m_mean": round(statistics.fmean(self.load), 1),
        }


@dataclass
class Bench:
    """The cluster, the operator and the clients of one benchmark run."""

    kubeconfig: Path
    kubectl: Path
    namespace: str
    operator: OperatorProcess
    clients: list[Kube]
    tracker: Tracker = field(default_factory=Tracker)

    @property
    def pid(self) -> int:
        """The operator's process id."""
        assert self.operator.process is not None
        return self.operator.process.pid

    def run_kubectl(self, *args: str, timeout: float = 120) -> str:
        """Run kubectl against the cluster; its stdout."""
        result = subprocess.run(
            [str(self.kubectl), f"--kubeconfig={self.kubeconfig}", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {result.stderr.strip()}")
        return result.stdout

    def kubectl_run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run kubectl against the cluster; the finished process (e2e.helpers' shape)."""
        return subprocess.run(
            [str(self.kubectl), f"--kubeconfig={self.kubeconfig}", *args],
            capture_output=True,
            text=True,
            timeout=120,
            check=check,
        )

    async def api_totals(self) -> Counter[RequestKey]:
        """The API server's request counters, now."""
        text = await asyncio.to_thread(self.run_kubectl, "get", "--raw", "/metrics")
        return parse_request_totals(text)

    async def operator_writes(self) -> Counter[tuple[str, str]]:
        """The operator's count of its own writes, now."""
        text = await asyncio.to_thread(self.operator.metrics)
        return operator_counter(text)

    def phase(self) -> PhaseClock:
        """Start timing a phase: the operator's CPU and the machine's load over it."""
        return PhaseClock(self.pid, time.monotonic(), cpu_seconds(self.pid))

    def memory(self) -> dict[str, float]:
        """The operator's RSS and peak RSS in MiB, and CPU seconds used so far."""
        status = proc_status(self.pid)
        return {
            "rss_mib": round(mib(status["VmRSS"]), 1),
            "peak_rss_mib": round(mib(status["VmHWM"]), 1),
            "cpu_seconds": round(cpu_seconds(self.pid), 1),
        }


def wait_namespaces_gone(bench: Bench, timeout: float) -> None:
    """Wait until no benchmark namespace is left, so no cleanup writes overlap a run."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        names = bench.run_kubectl("get", "namespaces", "-o", "name").split()
        left = [n for n in names if n.startswith("namespace/bench-operator-")]
        if not left:
            return
        time.sleep(2.0)
    log(f"benchmark namespaces still terminating after {timeout:.0f} s: {left}")


def prepare_namespace(bench: Bench) -> None:
    """CRDs applied and Established; the namespace and its default ServiceAccount."""
    wait_namespaces_gone(bench, 600)
    bench.run_kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRDS_DIR))
    wait_established(bench.kubectl_run, "-l", "app.kubernetes.io/part-of=sessionfleet")
    bench.run_kubectl("create", "namespace", bench.namespace)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            bench.run_kubectl("-n", bench.namespace, "get", "serviceaccount", "default")
            return
        except RuntimeError:
            time.sleep(0.5)
    raise RuntimeError("the namespace's default ServiceAccount never appeared")


async def start_fleet(bench: Bench, workers: int, max_sessions: int) -> None:
    """Create the workers, start the operator, wait until every worker is Ready."""
    kube = bench.clients[0]
    for index in range(workers):
        body = sim_worker(f"w{index}", MODEL, capacity={"maxSessions": max_sessions})
        await kube.create(WORKERS, body, bench.namespace)
    bench.operator.start()

    async def ready_epochs() -> dict[str, int]:
        items, _ = await kube.list(WORKERS, bench.namespace)
        return {
            item["metadata"]["name"]: int(item["status"].get("epoch") or 0)
            for item in items
            if (item.get("status") or {}).get("phase") == "Ready"
        }

    # Ready, and still Ready at the same epoch a few seconds later: a pod whose engine
    # failed to start is replaced by the operator, which is not what is measured here.
    deadline = time.monotonic() + 180
    previous: dict[str, int] = {}
    while True:
        epochs = await ready_epochs()
        if len(epochs) == workers and epochs == previous:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{len(epochs)}/{workers} workers steadily Ready after 180 s\n"
                f"{bench.operator.log_tail()}"
            )
        previous = epochs if len(epochs) == workers else {}
        await asyncio.sleep(5.0 if previous else 0.5)


def latency_summary(tracker: Tracker, names: list[str]) -> dict[str, Any]:
    """Bind latency percentiles (ms), from send and from the create's answer."""
    from_send = [tracker.bound[n] - tracker.sent[n] for n in names if n in tracker.bound]
    from_ack = [
        tracker.bound[n] - tracker.acked[n]
        for n in names
        if n in tracker.bound and n in tracker.acked
    ]
    create = [tracker.acked[n] - tracker.sent[n] for n in names if n in tracker.acked]
    # The operator stamps boundAt when it decides the binding, before its status patch;
    # both clocks are this machine's, so the interval splits in two: until the operator
    # acted on the new session, and from then until the binding reached a watcher.
    to_decision = [
        tracker.bound_at[n] - tracker.sent_wall[n] for n in names if n in tracker.bound_at
    ]
    to_seen = [
        (tracker.bound[n] - tracker.sent[n]) - (tracker.bound_at[n] - tracker.sent_wall[n])
        for n in names
        if n in tracker.bound_at
    ]

    def ms(values: list[float]) -> dict[str, float]:
        return {
            "p50": round(1000 * percentile(values, 50), 1),
            "p90": round(1000 * percentile(values, 90), 1),
            "p99": round(1000 * percentile(values, 99), 1),
            "max": round(1000 * max(values, default=float("nan")), 1),
            "mean": round(1000 * statistics.fmean(values), 1) if values else float("nan"),
        }

    return {
        "sessions": len(names),
        "bound": len(from_send),
        "bind_ms": ms(from_send),
        "bind_after_create_answer_ms": ms(from_ack),
        "create_request_ms": ms(create),
        "create_sent_to_operator_decision_ms": ms(to_decision),
        "operator_decision_to_bound_seen_ms": ms(to_seen),
        "per_worker": dict(
            sorted(Counter(tracker.worker[n] for n in names if n in tracker.worker).items())
        ),
    }


# ------------------------------------------------------------------------ phases


async def sample_load(clocks: list[PhaseClock]) -> None:
    """Sample the load average into the running phase's clock every 2 s, until cancelled."""
    while True:
        if clocks:
            clocks[-1].sample_load()
        await asyncio.sleep(2.0)


async def measure(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    """Run every phase; return the figures."""
    results: dict[str, Any] = {}
    tracker = bench.tracker
    clocks: list[PhaseClock] = []
    background = [
        asyncio.create_task(watch_sessions(bench.clients[0], bench.namespace, tracker)),
        asyncio.create_task(sample_load(clocks)),
    ]
    settle = 2 * args.resync + 3
    try:
        clocks.append(bench.phase())
        await asyncio.sleep(settle)
        results["memory_idle"] = {"sessions": 0, **bench.memory(), **clocks[-1].summary()}
        log(f"operator idle with {args.workers} Ready workers: {results['memory_idle']}")

        # 1. Bind latency, open loop; the lifecycle's counters start here.
        api_before = await bench.api_totals()
        op_before = await bench.operator_writes()
        names = [f"s{index:05d}" for index in range(args.sessions)]
        clocks.append(bench.phase())
        log(f"creating {len(names)} sessions at {args.rate}/s")
        pace = await create_sessions(
            bench.clients, bench.namespace, names, args.rate, args.max_in_flight, tracker
        )
        log(f"  sent in {pace.seconds:.1f} s ({pace.rate:.1f}/s, lag p99 {pace.p99_lag:.3f} s)")
        await wait_for("bound", lambda: tracker.count(names, tracker.bound), len(names), 300)
        results["bind"] = {
            **latency_summary(tracker, names),
            "rate_target": args.rate,
            "rate_achieved": round(pace.rate, 1),
            "start_lag_p99_s": round(pace.p99_lag, 3),
            "start_lag_max_s": round(pace.max_lag, 3),
            **clocks[-1].summary(),
        }
        await asyncio.sleep(settle)
        clocks.append(bench.phase())  # idle: what the sessions cost while nothing happens
        await asyncio.sleep(args.idle_window)
        results["memory_small"] = {
            "sessions": len(names),
            **bench.memory(),
            **clocks[-1].summary(),
        }
        log(f"operator with {len(names)} sessions bound: {results['memory_small']}")

        # 2. The rest of each session's life: finished, Finished, deleted.
        clocks.append(bench.phase())
        log(f"marking {len(names)} sessions finished at {args.finish_rate}/s")
        await finish_sessions(bench.clients[0], bench.namespace, names, args.finish_rate, tracker)
        await wait_for("deleted", lambda: tracker.count(names, tracker.deleted), len(names), 300)
        await asyncio.sleep(settle)
        api_after = await bench.api_totals()
        op_after = await bench.operator_writes()
        rows = write_rows(api_before, api_after)
        per_session = {
            who: round(sum(r.count for r in rows if r.who == who) / len(names), 3)
            for who in ("client", "operator", "operator (fleet)")
        }
        op_delta = {
            f"{verb} {resource}": op_after[(verb, resource)] - op_before.get((verb, resource), 0)
            for verb, resource in sorted(op_after)
        }
        results["writes"] = {
            "sessions": len(names),
            "finished_seen": tracker.count(names, tracker.finished),
            "deleted_seen": tracker.count(names, tracker.deleted),
            "rows": [r.__dict__ | {"per_session": round(r.count / len(names), 3)} for r in rows],
            "per_session": per_session,
            "operator_own_counter": {k: v for k, v in op_delta.items() if v},
            "finish_phase": clocks[-1].summary(),
        }

        # 3. Many sessions at once: memory at scale.
        big = [f"b{index:05d}" for index in range(args.big)]
        if big:
            api_before = await bench.api_totals()
            clocks.append(bench.phase())
            log(f"creating {len(big)} sessions at {args.big_rate}/s, {len(bench.clients)} clients")
            pace = await create_sessions(
                bench.clients, bench.namespace, big, args.big_rate, args.max_in_flight, tracker
            )
            log(f"  sent in {pace.seconds:.1f} s ({pace.rate:.1f}/s)")
            await wait_for(
                "bound", lambda: tracker.count(big, tracker.bound), len(big), args.big_timeout
            )
            results["bind_big"] = {
                **latency_summary(tracker, big),
                "rate_target": args.big_rate,
                "rate_achieved": round(pace.rate, 1),
                "start_lag_p99_s": round(pace.p99_lag, 3),
                **clocks[-1].summary(),
            }
            await asyncio.sleep(settle + 5)
            clocks.append(bench.phase())
            await asyncio.sleep(args.idle_window)
            api_after = await bench.api_totals()
            results["memory_big"] = {"sessions": len(big), **bench.memory(), **clocks[-1].summary()}
            operator_rows = [r for r in write_rows(api_before, api_after) if r.who == "operator"]
            results["bind_big"]["operator_writes_per_session"] = round(
                sum(r.count for r in operator_rows) / len(big), 3
            )
            log(f"operator with {len(big)} sessions bound: {results['memory_big']}")
    finally:
        for task in background:
            task.cancel()
    return {**results, **tracker.errors()}


# ------------------------------------------------------------------------ report


def report(results: dict[str, Any]) -> str:
    """The figures as Markdown tables."""
    lines: list[str] = []
    bind = results["bind"]
    lines += [
        f"Bind latency, {bind['sessions']} sessions at {bind['rate_target']}/s "
        f"(achieved {bind['rate_achieved']}/s), client-side, create sent -> watch sees Bound; "
        f"operator CPU {bind['operator_cpu_share']} of a core, load {bind['load_1m_mean']}:",
        "",
        "| figure | p50 | p90 | p99 | max |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, key in (
        ("create sent -> Bound seen (ms)", "bind_ms"),
        ("create answered -> Bound seen (ms)", "bind_after_create_answer_ms"),
        ("create request (ms)", "create_request_ms"),
        ("create sent -> operator decides (boundAt) (ms)", "create_sent_to_operator_decision_ms"),
        ("operator decides -> Bound seen (ms)", "operator_decision_to_bound_seen_ms"),
    ):
        row = bind[key]
        lines.append(f"| {label} | {row['p50']} | {row['p90']} | {row['p99']} | {row['max']} |")
    lines += ["", f"bound {bind['bound']}/{bind['sessions']}, per worker {bind['per_worker']}", ""]

    writes = results["writes"]
    lines += [
        f"API server write requests over the full life of {writes['sessions']} sessions "
        "(apiserver_request_total delta):",
        "",
        "| who | resource (group) | verb | requests | per session | non-2xx |",
        "|---|---|---|---:|---:|---:|",
    ]
    for row in writes["rows"]:
        if row["who"] == "cluster":
            continue
        lines.append(
            f"| {row['who']} | {row['resource']} ({row['group'] or 'core'}) | {row['verb']} "
            f"| {row['count']} | {row['per_session']} | {row['failed']} |"
        )
    per = writes["per_session"]
    lines += [
        "",
        f"per session: client {per['client']}, operator {per['operator']} (target <= 3), "
        f"operator fleet-level {per['operator (fleet)']}",
        f"operator's own counter: {writes['operator_own_counter']}",
        "",
        "| operator | sessions | VmRSS (MiB) | peak VmHWM (MiB) | idle CPU (cores) | load 1m |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for key, label in (
        ("memory_idle", "idle, workers Ready"),
        ("memory_small", "sessions bound, settled"),
        ("memory_big", "sessions bound, settled"),
    ):
        if key in results:
            mem = results[key]
            lines.append(
                f"| {label} | {mem['sessions']} | {mem['rss_mib']} | {mem['peak_rss_mib']} "
                f"| {mem['operator_cpu_share']} | {mem['load_1m_mean']} |"
            )
    if "bind_big" in results:
        big = results["bind_big"]
        lines += [
            "",
            f"{big['sessions']} sessions at {big['rate_target']}/s (achieved "
            f"{big['rate_achieved']}/s): bound {big['bound']} in {big['seconds']} s, bind p50 "
            f"{big['bind_ms']['p50']} ms, p99 {big['bind_ms']['p99']} ms; operator CPU "
            f"{big['operator_cpu_seconds']} s ({big['operator_cpu_share']} of a core), load "
            f"{big['load_1m_mean']}; operator writes per session while binding "
            f"{big['operator_writes_per_session']}",
        ]
    lines.append(
        f"errors: create {results['create_errors']}, finish {results['patch_errors']}; "
        f"watch restarts {results['watch_restarts']}"
    )
    return "\n".join(lines)


# -------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kubeconfig", type=Path, help="use this cluster instead of a new one")
    parser.add_argument("--state-dir", type=Path, help="state dir of the cluster started here")
    parser.add_argument("--sessions", type=int, default=1000, help="sessions for latency/writes")
    parser.add_argument("--rate", type=float, default=50.0, help="creates per second")
    parser.add_argument("--finish-rate", type=float, default=100.0, help="finish patches per s")
    parser.add_argument("--big", type=int, default=10000, help="sessions for memory at scale")
    parser.add_argument("--big-rate", type=float, default=300.0, help="creates per second")
    parser.add_argument("--big-timeout", type=float, default=600.0, help="seconds to bind them")
    parser.add_argument("--clients", type=int, default=4, help="concurrent API clients")
    parser.add_argument("--max-in-flight", type=int, default=64, help="open creates at most")
    parser.add_argument("--workers", type=int, default=4, help="simulated-engine workers")
    parser.add_argument("--max-sessions", type=int, default=5000, help="capacity per worker")
    parser.add_argument("--resync", type=float, default=2.0, help="operator --resync seconds")
    parser.add_argument(
        "--idle-window", type=float, default=20.0, help="seconds of idle CPU measured when bound"
    )
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    if args.workers * args.max_sessions < max(args.sessions, args.big):
        parser.error("--workers x --max-sessions must hold every session")
    return args


async def run(args: argparse.Namespace, kubeconfig: Path, log_dir: Path) -> dict[str, Any]:
    """Prepare the namespace and fleet, measure, and clean up the namespace."""
    namespace = f"bench-operator-{os.getpid()}"
    config = KubeConfig.load(str(kubeconfig))
    clients = [Kube(config, user_agent=f"bench-operator/{i}") for i in range(args.clients)]
    operator = OperatorProcess(
        kubeconfig,
        namespace,
        log_dir,
        f"--resync={args.resync}",
        f"--scrape-interval={15.0}",
        "--node-not-ready-toleration=30s",
    )
    bench = Bench(kubeconfig, find_tools().kubectl, namespace, operator, clients)
    try:
        prepare_namespace(bench)
        await start_fleet(bench, args.workers, args.max_sessions)
        log(f"{args.workers} workers Ready; operator pid {bench.pid}, log {operator.log_path}")
        return await measure(bench, args)
    finally:
        operator.stop()
        for client in clients:
            await client.aclose()
        try:  # with the operator gone, the namespace controller removes the sessions
            log(f"deleting namespace {namespace}")
            bench.run_kubectl("delete", "namespace", namespace, "--wait=false")
            wait_namespaces_gone(bench, 600)
        except RuntimeError as error:
            log(f"namespace not deleted: {error}")


def main(argv: list[str] | None = None) -> int:
    """Start or attach to a cluster, run the benchmark, print and save the figures."""
    args = parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-operator-"))
    cluster: LocalCluster | None = None
    if args.kubeconfig is not None:
        kubeconfig = args.kubeconfig
    else:
        cluster = LocalCluster.start(args.state_dir)
        kubeconfig = cluster.kubeconfig
    try:
        results = asyncio.run(run(args, kubeconfig, log_dir))
    finally:
        if cluster is not None:
            cluster.stop()
    publish(results, report(results), f"operator log: {log_dir}", args.out)
    return 0


def publish(results: dict[str, Any], table: str, logs: str, out: Path | None) -> None:
    """Print the figures (and where the logs are) and write them as JSON to ``out``."""
    results["machine"] = {"cpus": os.cpu_count()}
    print(table)
    print(f"\n{logs}", file=sys.stderr)
    if out is not None:
        out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
