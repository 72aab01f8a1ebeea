"""The chaos suite's scene: a fleet under load, a fault, and what must hold afterwards.

A :class:`Scene` runs, in one namespace of a real cluster: a DrainPolicy, two
InferenceWorkers running the simulated engine behind backed KWOK pods (``src`` and
``dst``, each on a node of its own), **two operator replicas electing a leader**, one
router, and sessions pinned to ``src``. :class:`Load` sends every session's turns
through the router without pause, retrying a turn until it is answered (retries are
counted, a turn never answered is a failure). :class:`Watch` samples, twice a second,
that no worker ever has two live pods and that a worker's hold (its
PodDisruptionBudget) stands whenever sessions are pinned to it.

A replica that exits on its own (status 1: it lost the Lease, or a task died) is
started again, as a Deployment's restartPolicy would; one a test kills stays down
until the test starts it.

A test then starts a drain or a migration, injects its fault, and calls
:meth:`Scene.verdict`, which checks what the suite promises — every binding survives,
no pod is duplicated, holds stay up while sessions are pinned, every session ends
Bound or Finished, the router answered every turn — and returns the figures, also
written to ``build/chaos/<case>.json`` for bench/README.md.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from kubernetes import client
from kubernetes import config as kube_config

from e2e.helpers import wait_until
from e2e.localcluster import LocalCluster
from e2e.operator import (
    REPO_ROOT,
    WORKER_LABEL,
    Custom,
    OperatorProcess,
    Process,
    drain_policy,
    on_own_nodes,
    session,
    sim_worker,
    start_router,
)
from sessionfleet.resources.names import session_object_name

FIGURES_DIR = REPO_ROOT / "build" / "chaos"
PINNED_PHASES = ("Bound", "Migrating", "Restoring")
SLOW_SECONDS = 2.5
SYSTEM = "You are a coding agent working in a large repository. " * 20


@dataclass
class Turns:
    """What the load saw, counted across its sessions."""

    answered: int = 0
    retries: int = 0
    failed: list[str] = field(default_factory=list)
    served_by: Counter[str] = field(default_factory=Counter)
    """Answered turns per worker (the router's ``X-Sessionfleet-Worker``)."""
    last_problem: dict[str, str] = field(default_factory=dict)
    """Each session's latest failed attempt, with when it ended (for a failed wait)."""


class Load:
    """Every session's turns through the router, one after another, each until answered."""

    def __init__(self, url: str, session_ids: list[str], give_up_after: float = 120.0) -> None:
        self.url = url
        self.session_ids = session_ids
        self.give_up_after = give_up_after
        self.turns = Turns()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(sid,), daemon=True) for sid in session_ids
        ]

    def start(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> Turns:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.give_up_after + 30)
        return self.turns

    def _run(self, session_id: str) -> None:
        history = [{"role": "system", "content": SYSTEM}]
        with httpx.Client(timeout=60) as http:
            step = 0
            while not self._stop.is_set():
                history.append({"role": "user", "content": f"turn {step}"})
                answer = self._turn(http, session_id, history)
                if answer is None:
                    history.pop()
                else:
                    history.append({"role": "assistant", "content": answer})
                    # A bounded history: the test is about routing, not prompt growth.
                    del history[1:-16]
                step += 1
                time.sleep(0.2)

    def _turn(
        self, http: httpx.Client, session_id: str, history: list[dict[str, str]]
    ) -> str | None:
        started = time.monotonic()
        while True:
            try:
                response = http.post(
                    f"{self.url}/v1/chat/completions",
                    json={"model": "m", "messages": history, "max_tokens": 8},
                    headers={"X-Session-Id": session_id},
                )
                if response.status_code == 200:
                    with self._lock:
                        self.turns.answered += 1
                        self.turns.served_by[response.headers.get("x-sessionfleet-worker", "")] += 1
                    return str(response.json()["choices"][0]["message"]["content"])
                problem = f"{response.status_code} {response.text[:200]}"
            except httpx.HTTPError as error:
                problem = repr(error)
            with self._lock:
                self.turns.last_problem[session_id] = f"{time.strftime('%H:%M:%S')} {problem}"
            if time.monotonic() - started > self.give_up_after:
                with self._lock:
                    self.turns.failed.append(f"{session_id}: {problem}")
                return None
            with self._lock:
                self.turns.retries += 1
            time.sleep(0.5)


@dataclass
class Sample:
    """What :class:`Watch` found wrong, and how often it could look."""

    samples: int = 0
    unreachable: int = 0
    """Samples the API server failed, or took over ``SLOW_SECONDS`` to answer."""
    duplicate_pods: list[str] = field(default_factory=list)
    holds_missing: list[str] = field(default_factory=list)


class Watch:
    """Samples pods, holds and bindings twice a second while the scene runs."""

    def __init__(self, kubeconfig: Path, namespace: str, workers: list[str]) -> None:
        # One try per request: a sample the API server cannot answer is counted, not
        # retried for seconds by urllib3 while the fault comes and goes unseen. Set
        # before the client is made: its connection pool reads it only then.
        configuration = client.Configuration()
        kube_config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=str(kubeconfig), client_configuration=configuration
        )
        configuration.retries = False
        api = client.ApiClient(configuration)
        self.api = api
        self.core = client.CoreV1Api(api)
        self.policy = client.PolicyV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.namespace = namespace
        self.workers = workers
        self.found = Sample()
        self.hold_seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Watch:
        self._thread.start()
        return self

    def stop(self) -> Sample:
        self._stop.set()
        self._thread.join(timeout=30)
        self.api.close()
        return self.found

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            started = time.monotonic()
            try:
                self._sample()
            except Exception:  # the API server may be down: that is the fault under test
                self.found.unreachable += 1
                continue
            if time.monotonic() - started > SLOW_SECONDS:
                self.found.unreachable += 1

    def _sample(self) -> None:
        pods = self.core.list_namespaced_pod(
            self.namespace, label_selector=WORKER_LABEL, _request_timeout=3
        ).items
        pdbs = self.policy.list_namespaced_pod_disruption_budget(
            self.namespace, label_selector=WORKER_LABEL, _request_timeout=3
        ).items
        sessions = self.custom.list_namespaced_custom_object(
            "sessionfleet.dev",
            "v1alpha1",
            self.namespace,
            "agentsessions",
            _request_timeout=3,
        )["items"]
        self.found.samples += 1
        held = {p.metadata.labels[WORKER_LABEL] for p in pdbs}
        self.hold_seen |= held
        stamp = time.strftime("%H:%M:%S")
        for worker in self.workers:
            live = [
                p.metadata.name
                for p in pods
                if p.metadata.labels.get(WORKER_LABEL) == worker
                and p.metadata.deletion_timestamp is None
                and p.status.phase not in ("Failed", "Succeeded")
            ]
            if len(live) > 1:
                self.found.duplicate_pods.append(f"{stamp} {worker}: {live}")
            pinned = [
                s["metadata"]["name"]
                for s in sessions
                if (s.get("status") or {}).get("worker") == worker
                and (s.get("status") or {}).get("phase") in PINNED_PHASES
            ]
            # A hold is put up by the pass after a binding: judged once it was seen.
            if pinned and worker in self.hold_seen and worker not in held:
                self.found.holds_missing.append(f"{stamp} {worker}: {pinned} pinned, no PDB")


class Scene:
    """A fleet under load in one namespace; see the module docstring."""

    def __init__(
        self,
        case: str,
        cluster: LocalCluster,
        api: Any,
        namespace: str,
        nodes: list[str],
        logs: Path,
        *,
        policy: dict[str, Any],
        sessions: int = 4,
        router_kubeconfig: Path | None = None,
        operator_args: tuple[str, ...] = (),
        worker_spec: dict[str, Any] | None = None,
    ) -> None:
        self.case = case
        self.cluster = cluster
        self.api = api
        self.namespace = namespace
        self.logs = logs
        self.crs = Custom(client.CustomObjectsApi(api), namespace)
        self.operators = [
            OperatorProcess(cluster.kubeconfig, namespace, logs / f"op{i}", *operator_args)
            for i in range(2)
        ]
        self.router: Process | None = None
        self.url = ""
        self.session_names: dict[str, str] = {}
        self.load: Load | None = None
        self.watch: Watch | None = None
        self.fault_ended: float | None = None
        self.restarts = 0
        self._closing = threading.Event()
        self._kubelet = threading.Thread(target=self._restart_failed, daemon=True)
        try:
            self._setup(nodes, policy, sessions, router_kubeconfig, worker_spec or {})
        except BaseException:
            self.close()  # the test never gets the scene to close: leave no process behind
            raise
        self._kubelet.start()

    def _restart_failed(self) -> None:
        """Start again every replica that exited non-zero, as the kubelet would."""
        while not self._closing.wait(0.5):
            for operator in self.operators:
                process = operator.process
                if process is not None and (process.poll() or 0) > 0:
                    self.restarts += 1
                    operator.start()

    def _setup(
        self,
        nodes: list[str],
        policy: dict[str, Any],
        count: int,
        router_kubeconfig: Path | None,
        worker_spec: dict[str, Any],
    ) -> None:
        self.crs.create(drain_policy("chaos", **policy))
        for name, node in (("src", nodes[0]), ("dst", nodes[1])):
            worker = sim_worker(name, capacity={"maxSessions": 64}, **worker_spec)
            self.crs.create(on_own_nodes(worker, self.namespace, node))
        for operator in self.operators:
            operator.log_path.parent.mkdir(parents=True, exist_ok=True)
            operator.start()
        self.wait(
            lambda: self.crs.all_in_phase("inferenceworkers", "Ready", 2)(),
            timeout=90,
            what="workers src and dst Ready",
        )
        self.url, self.router = start_router(
            router_kubeconfig or self.cluster.kubeconfig, self.namespace, "chaos", self.logs
        )
        for index in range(count):
            session_id = f"id-{self.case}-{index}"
            name = session_object_name(session_id)
            self.session_names[session_id] = name
            body = session(f"s{index}", workerPin="src") | {"metadata": {"name": name}}
            body["spec"]["sessionId"] = session_id
            self.crs.create(body)
        self.wait(
            lambda: self.bindings() == dict.fromkeys(self.session_names.values(), "src"),
            timeout=60,
            what="every session bound to src",
        )
        self.wait(lambda: self.has_hold("src"), timeout=30, what="src's hold")
        self.watch = Watch(self.cluster.kubeconfig, self.namespace, ["src", "dst"]).start()
        self.load = Load(self.url, list(self.session_names)).start()
        self.wait(lambda: self.load is not None and self.load.turns.answered >= 8, 60, "turns")

    # ----------------------------------------------------------------- reading

    def bindings(self) -> dict[str, str | None]:
        return {
            s["metadata"]["name"]: (s.get("status") or {}).get("worker")
            for s in self.crs.list("agentsessions")
            if s["metadata"]["name"] in self.session_names.values()
        }

    def phases(self) -> dict[str, str | None]:
        return {
            s["metadata"]["name"]: (s.get("status") or {}).get("phase")
            for s in self.crs.list("agentsessions")
            if s["metadata"]["name"] in self.session_names.values()
        }

    def has_hold(self, worker: str) -> bool:
        pdbs = client.PolicyV1Api(self.api).list_namespaced_pod_disruption_budget(
            self.namespace, label_selector=f"{WORKER_LABEL}={worker}"
        )
        return bool(pdbs.items)

    def leader(self) -> OperatorProcess:
        """The replica whose readiness answer says it leads."""

        def find() -> OperatorProcess | None:
            for operator in self.operators:
                try:
                    answer = httpx.get(f"http://127.0.0.1:{operator.health_port}/readyz", timeout=2)
                except httpx.HTTPError:
                    continue
                if answer.status_code == 200 and answer.json().get("role") == "leader":
                    return operator
            return None

        found: OperatorProcess = self.wait(find, timeout=60, what="a leader")
        return found

    def picture(self, session_name: str) -> str:
        """What a failed wait needs: the session's status, the workers', nodes and roles."""
        lines = [f"session {session_name}: {self.crs.status('agentsessions', session_name)}"]
        for worker in self.crs.list("inferenceworkers"):
            status = worker.get("status") or {}
            conditions = [
                (c.get("type"), c.get("status"), c.get("reason"))
                for c in status.get("conditions") or ()
            ]
            lines.append(
                f"worker {worker['metadata']['name']}: {status.get('phase')} epoch "
                f"{status.get('epoch')} pod {status.get('pod')} on {status.get('node')} "
                f"pinned {status.get('pinnedSessions')} {conditions}"
            )
        for node in client.CoreV1Api(self.api).list_node().items:
            ready = [c for c in node.status.conditions or () if c.type == "Ready"]
            lines.append(
                f"node {node.metadata.name}: Ready={ready[0].status if ready else None} "
                f"since {ready[0].last_transition_time if ready else None}"
            )
        for operator in self.operators:
            try:
                answer = httpx.get(f"http://127.0.0.1:{operator.health_port}/readyz", timeout=2)
                lines.append(f"{operator.log_path.parent.name} /readyz: {answer.text}")
            except httpx.HTTPError as error:
                lines.append(f"{operator.log_path.parent.name} /readyz: {error!r}")
        return "\n".join(lines)

    def load_picture(self) -> str:
        """The load's counts and each session's latest problem; the router's own counts."""
        assert self.load is not None
        turns = self.load.turns
        lines = [f"answered {turns.answered}, retries {turns.retries}, failed {turns.failed[:4]}"]
        lines += [f"  {sid}: {problem}" for sid, problem in sorted(turns.last_problem.items())]
        try:
            text = httpx.get(f"{self.url}/metrics", timeout=5).text
            lines += [
                line
                for line in text.splitlines()
                if line.startswith("sessionfleet_router_") and "_bucket" not in line
            ]
        except httpx.HTTPError as error:
            lines.append(f"router /metrics: {error!r}")
        return "\n".join(lines)

    def logs_tail(self) -> str:
        parts = [f"--- {o.log_path.parent.name} ---\n{o.log_tail(30)}" for o in self.operators]
        if self.router is not None:
            parts.append(f"--- router ---\n{self.router.log_tail(30)}")
        return "\n".join(parts)

    def wait(
        self, check: Any, timeout: float, what: str, state: Callable[[], str] | None = None
    ) -> Any:
        """Wait as ``wait_until``; a timeout also shows the logs and ``state()``, if given."""
        try:
            return wait_until(check, timeout=timeout, what=what)
        except AssertionError as error:
            shown = f"\n{state()}" if state is not None else ""
            raise AssertionError(f"{error}\n{self.logs_tail()}{shown}") from None

    # ----------------------------------------------------------------- acting

    def drain(self, worker: str = "src") -> None:
        self.crs.patch("inferenceworkers", worker, {"spec": {"drain": True}})

    def draining(self) -> str:
        """Start the drain of src, wait until it is Draining; return its recorded start."""
        self.drain()
        self.wait(
            lambda: self.crs.status("inferenceworkers", "src").get("phase") == "Draining",
            timeout=30,
            what="src Draining",
        )
        return str(self.crs.status("inferenceworkers", "src")["drainStartedAt"])

    def drain_completes(self, started_at: str) -> None:
        """The drain resumed (not restarted), and completes once the sessions finish."""
        status = self.crs.status("inferenceworkers", "src")
        assert status["drainStartedAt"] == started_at, "the drain restarted instead of resuming"
        self.finish_sessions()
        self.wait(
            lambda: (
                self.crs.status("inferenceworkers", "src").get("phase") == "Drained"
                and not self.has_hold("src")
            ),
            timeout=90,
            what="src Drained and its hold gone",
        )

    def finish_sessions(self) -> None:
        """Mark every session finished, as a client's last turn does."""
        for name in self.session_names.values():
            self.crs.patch("agentsessions", name, {"spec": {"finished": True}})

    def recovered(self, timeout: float = 60) -> float:
        """Seconds from the fault's end until a new session is bound: the operator acts.

        Then every session gets a few more turns answered, so the verdict also covers
        the fleet after the fault.
        """
        assert self.fault_ended is not None and self.load is not None
        probe = f"probe-{int(time.monotonic() * 1000) % 100000}"
        self.crs.create(session(probe, workerPin="dst"))
        self.wait(
            lambda: self.crs.status("agentsessions", probe).get("phase") == "Bound",
            timeout=timeout,
            what="a new session bound after the fault",
            state=lambda: self.picture(probe),
        )
        recovery = round(time.monotonic() - self.fault_ended, 2)
        load = self.load
        target = load.turns.answered + 3 * len(self.session_names)
        self.wait(
            lambda: load.turns.answered >= target,
            timeout=90,
            what="turns after the fault",
            state=lambda: f"{self.load_picture()}\n{self.picture(probe)}",
        )
        return recovery

    # ----------------------------------------------------------------- verdict

    def verdict(self, *, expect_worker: str, recovery_seconds: float) -> dict[str, Any]:
        """Stop the load and check every promise; return the figures (and write them)."""
        assert self.load is not None and self.watch is not None
        turns = self.load.stop()
        found = self.watch.stop()
        bindings = self.bindings()
        phases = self.phases()
        lost = {
            name: (bindings.get(name), phases.get(name))
            for name in self.session_names.values()
            if bindings.get(name) != expect_worker or phases.get(name) not in ("Bound", "Finished")
        }
        figures = {
            "case": self.case,
            "turnsAnswered": turns.answered,
            "retries": turns.retries,
            "turnsFailed": len(turns.failed),
            "servedBy": dict(turns.served_by),
            "bindingsLost": len(lost),
            "duplicatePods": len(found.duplicate_pods),
            "holdsMissing": len(found.holds_missing),
            "samples": found.samples,
            "samplesUnreachable": found.unreachable,
            "recoverySeconds": recovery_seconds,
            "operatorRestarts": self.restarts,
        }
        FIGURES_DIR.mkdir(parents=True, exist_ok=True)
        (FIGURES_DIR / f"{self.case}.json").write_text(json.dumps(figures, indent=2) + "\n")
        print(f"\nchaos {self.case}: {json.dumps(figures)}")
        detail = json.dumps(
            {
                "lost": lost,
                "failed": turns.failed[:5],
                "duplicates": found.duplicate_pods[:5],
                "holds": found.holds_missing[:5],
            },
            indent=1,
        )
        problems = f"{detail}\n{self.logs_tail()}"
        assert not turns.failed, problems
        assert not lost, problems
        assert not found.duplicate_pods, problems
        assert not found.holds_missing, problems
        assert turns.answered > 0 and found.samples > 0, problems
        return figures

    def close(self) -> None:
        self._closing.set()
        if self._kubelet.is_alive():
            self._kubelet.join(timeout=5)
        if self.load is not None:
            self.load.stop()
        if self.watch is not None:
            self.watch.stop()
        if self.router is not None:
            self.router.stop()
        for operator in self.operators:
            operator.stop()


__all__ = ["Load", "Scene", "Turns", "Watch"]
