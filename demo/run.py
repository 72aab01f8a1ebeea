"""``make demo``: the whole system on a real local control plane.

Run by path from the repository root (``.venv/bin/python demo/run.py``)::

    demo/run.py [up] [--fast] [--sessions N] [--drain-mode M] [--checkpoints on|off|both]
                [--engine sim|vllm]
    demo/run.py down | status

``up`` starts the local cluster (3 KWOK nodes x 4 GPUs), installs the chart, runs the
operator, router and node agent as local processes under the chart's ServiceAccount
tokens, creates simulated InferenceWorkers, drives an agentic workload through the
router, drains a node and kills an engine in the middle, and writes the report to
``demo-out/``. The cluster and the processes stay up; ``down`` stops them all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # after the standard library: see e2e/localcluster/__main__.py

import yaml  # noqa: E402
from kubernetes import client  # noqa: E402

from demo.driver import Driver, make_workload, replay_workload  # noqa: E402
from demo.report import build_report, render_markdown, render_png, render_text  # noqa: E402
from e2e.helpers import wait_established  # noqa: E402
from e2e.localcluster import (  # noqa: E402
    BACKED_LABEL,
    ClusterError,
    LocalCluster,
    container_id_pid,
    find_tools,
    gpu_pod_tolerations,
)
from e2e.localcluster._components import Layout  # noqa: E402
from e2e.localcluster._process import ProcessRecord, is_running, spawn, stop  # noqa: E402
from sessionfleet.fleetsim import FleetConfig, simulate  # noqa: E402
from sessionfleet.workload import Session  # noqa: E402

NAMESPACE = "sessionfleet-demo"
RELEASE = "sf"
MODEL = "agent-model"
GROUP, VERSION = "sessionfleet.dev", "v1alpha1"
SESSIONFLEET = Path(sys.executable).parent / "sessionfleet"
DEMO_LABEL = "sessionfleet.dev/demo"


def log(message: str) -> None:
    """One progress line on stderr."""
    print(f"==> {message}", file=sys.stderr, flush=True)


class DemoError(RuntimeError):
    """The demo cannot go on; the message says why and what to do."""


# ------------------------------------------------------------------------ state


class State:
    """``<state-dir>/demo.json``: the demo's processes and addresses, for ``down``."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir
        self.file = state_dir / "demo.json"
        self.cluster_dir = state_dir / "cluster"
        self.data: dict[str, Any] = {"processes": []}

    def load(self) -> bool:
        """Read the file; False when there is none."""
        if not self.file.is_file():
            return False
        self.data = json.loads(self.file.read_text())
        return True

    def save(self) -> None:
        """Write the file."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.file.write_text(json.dumps(self.data, indent=2))

    def add(self, record: ProcessRecord) -> None:
        """Record a process the demo started."""
        self.data["processes"].append(record.to_json())
        self.save()

    def records(self) -> list[ProcessRecord]:
        """Return the processes recorded."""
        return [ProcessRecord.from_json(p) for p in self.data.get("processes", [])]

    def running(self) -> bool:
        """Whether a demo recorded here still runs (a process or the cluster)."""
        if any(is_running(r) for r in self.records()):
            return True
        return Layout(self.cluster_dir).state_file.is_file()


def down(state_dir: Path) -> int:
    """Stop every process the demo started, then its cluster."""
    state = State(state_dir)
    found = state.load()
    for record in reversed(state.records()):
        stop(record, timeout=10)
    if Layout(state.cluster_dir).state_file.is_file():
        LocalCluster.from_state_dir(state.cluster_dir).stop(remove_state=False)
        found = True
    state.file.unlink(missing_ok=True)
    print("demo stopped" if found else f"no demo recorded in {state_dir}", file=sys.stderr)
    print("unset KUBECONFIG", file=sys.stderr)
    return 0


# ---------------------------------------------------------------- kubernetes


def sa_kubeconfig(cluster: LocalCluster, account: str, path: Path) -> Path:
    """Write a kubeconfig whose only credential is a TokenRequest token of ``account``."""
    token = cluster.kubectl(
        "create", "token", account, f"--namespace={NAMESPACE}", "--duration=24h"
    ).stdout.strip()
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    server = admin["clusters"][0]["cluster"]
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "demo", "cluster": server}],
        "users": [{"name": account, "user": {"token": token}}],
        "contexts": [
            {
                "name": account,
                "context": {"cluster": "demo", "user": account, "namespace": NAMESPACE},
            }
        ],
        "current-context": account,
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def helm_install(cluster: LocalCluster) -> None:
    """``helm install`` the chart: CRDs, RBAC, ServiceAccounts.

    The router Deployment is scaled to 0 and the operator's pod is a KWOK pod that runs
    nothing: the operator and the router run here, as local processes, with the tokens
    of the chart's ServiceAccounts.
    """
    argv = [
        str(find_tools().helm),
        "install",
        RELEASE,
        str(REPO / "charts" / "sessionfleet"),
        f"--namespace={NAMESPACE}",
        "--create-namespace",
        f"--set=operator.watchNamespaces={{{NAMESPACE}}}",
        "--set=router.replicas=0",
        f"--kubeconfig={cluster.kubeconfig}",
    ]
    import subprocess

    result = subprocess.run(argv, capture_output=True, text=True, timeout=180, check=False)
    if result.returncode != 0:
        raise DemoError(f"helm install failed:\n{result.stderr}")
    wait_established(cluster.kubectl, "-l", "app.kubernetes.io/part-of=sessionfleet")


def drain_policy(mode: str, fast: bool, checkpoints: bool) -> dict[str, Any]:
    """Return the demo's DrainPolicy (the GitOps examples' shape, with short timings)."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "DrainPolicy",
        "metadata": {"name": "demo", "namespace": NAMESPACE},
        "spec": {
            "selector": {"matchLabels": {DEMO_LABEL: "true"}},
            "mode": mode,
            "gracePeriod": "2s" if fast else "6s",
            "deadline": "90s",
            "onDeadline": "Release",
            "triggers": {"workerDrain": True, "nodeCordon": True},
            "holds": ["PodDisruptionBudget"],
            "migrationScope": "Session",
            "checkpoint": checkpoints,
        },
    }


#: Workers that run the real vLLM with ``--engine vllm``: the one drained (its sessions
#: move to the other vLLM worker, which can load their KV) and the one killed (it comes
#: back as a new vLLM epoch).
VLLM_WORKERS = ("w-0", "w-1")
#: vLLM workers serve the tiny test model (e2e/vllm/README.md), whose 4,096-token context
#: the demo's longer sessions outgrow (the longest pass 32K tokens): stretched here
#: (random weights either way), with a KV cache that holds two such sessions.
VLLM_CONTEXT_ARGS = [
    "--max-model-len=65536",
    '--hf-overrides={"max_position_embeddings": 65536}',
    f"--kv-cache-memory-bytes={128 * 2**20}",
]


def worker(
    name: str, node: str, storage: Path | None, interval: str, engine: str = "sim"
) -> dict[str, Any]:
    """Return an InferenceWorker backed by a real process on ``node``.

    ``engine``: ``sim`` (the simulated engine) or ``vllm`` (the real vLLM that
    ``make e2e-vllm-tools`` installs). With ``storage`` (checkpoints on) a vLLM worker
    keeps its KV store there (docs/kvstore.md); without, it has none.
    """
    spec: dict[str, Any] = {
        "model": MODEL,
        "engine": {"type": "sim"}
        if engine == "sim"
        else {"type": "vllm", "args": VLLM_CONTEXT_ARGS},
        "gpus": 1,
        "drainPolicyRef": "demo",
        "template": {
            "labels": {BACKED_LABEL: "true"},
            "tolerations": gpu_pod_tolerations(),
            "nodeSelector": {"kubernetes.io/hostname": node},
        },
    }
    if storage is not None and engine == "sim":
        spec["checkpoint"] = {
            "driver": "engine",
            "storage": {"path": str(storage)},
            "interval": interval,
        }
    elif storage is not None:
        # vLLM's store saves every block behind its turn: no periodic checkpoint.
        spec["checkpoint"] = {"driver": "engine", "storage": {"path": str(storage)}}
    elif engine != "sim":
        spec["checkpoint"] = {"kvStore": {"type": "None"}}
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceWorker",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {DEMO_LABEL: "true"}},
        "spec": spec,
    }


def free_port() -> int:
    """Return a free loopback port."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ----------------------------------------------------------------------- run


class Demo:
    """One ``up`` run."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.state = State(args.state_dir)
        self.out: Path = args.out_dir
        self.t0 = time.monotonic()
        self.step = "starting"
        self.cluster: LocalCluster | None = None
        self.crs: Any = None
        self.core: Any = None
        self.router_url = ""

    def clock(self) -> float:
        """Seconds since the workload started."""
        return time.monotonic() - self.t0

    def get(self, plural: str, name: str) -> dict[str, Any]:
        """Get a custom object."""
        return dict(self.crs.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, plural, name))

    def objects(self, plural: str) -> list[dict[str, Any]]:
        """List the custom objects of one kind."""
        return list(
            self.crs.list_namespaced_custom_object(GROUP, VERSION, NAMESPACE, plural)["items"]
        )

    def wait(self, check: Any, timeout: float, what: str) -> Any:
        """Poll ``check`` until truthy; DemoError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            time.sleep(0.5)
        raise DemoError(f"timed out after {timeout:.0f} s waiting for {what}")

    def start(self) -> list[str]:
        """Cluster, chart, processes and workers; returns the worker names."""
        args, state = self.args, self.state
        log(f"starting the local control plane in {state.cluster_dir} (3 nodes x 4 GPUs)")
        state.data = {"processes": [], "started": time.time()}
        state.save()
        self.cluster = LocalCluster.start(
            state.cluster_dir, owned=False, gpu_nodes=3, gpus_per_node=4
        )
        api = self.cluster.api_client()
        self.crs = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)
        log("helm install charts/sessionfleet (CRDs, RBAC, ServiceAccounts)")
        helm_install(self.cluster)
        checkpoints = args.checkpoints != "off"
        self.cluster.kubectl(
            "apply",
            "-f",
            "-",
            input=json.dumps(drain_policy(args.drain_mode, args.fast, checkpoints)),
        )
        logs = state.dir / "logs"
        operator_cfg = sa_kubeconfig(
            self.cluster, f"{RELEASE}-sessionfleet-operator", state.dir / "operator.kubeconfig"
        )
        router_cfg = sa_kubeconfig(
            self.cluster, f"{RELEASE}-sessionfleet-router", state.dir / "router.kubeconfig"
        )
        env = dict(os.environ)
        ports = {name: free_port() for name in ("metrics", "health", "router", "agent")}
        log("running the operator, router and node agent under the chart's ServiceAccount tokens")
        state.add(
            spawn(
                "operator",
                [
                    str(SESSIONFLEET),
                    "operator",
                    f"--namespace={NAMESPACE}",
                    f"--kubeconfig={operator_cfg}",
                    f"--metrics-port={ports['metrics']}",
                    f"--health-port={ports['health']}",
                    "--resync=1",
                    "--scrape-interval=3",
                    "--node-not-ready-toleration=10s",
                ],
                logs / "operator.log",
                env=env,
            )
        )
        self.router_url = f"http://127.0.0.1:{ports['router']}"
        state.add(
            spawn(
                "router",
                [
                    str(SESSIONFLEET),
                    "router",
                    "--host=127.0.0.1",
                    f"--port={ports['router']}",
                    f"--namespace={NAMESPACE}",
                    f"--kubeconfig={router_cfg}",
                    "--replica=demo",
                    # The Lease slots the chart's admission policy lets the router's
                    # ServiceAccount hold (router.replicas=0: the chart's minimum, 8):
                    # without a live slot the operator does not wait for this router's
                    # turn-boundary acknowledgement before it moves a session.
                    f"--lease-prefix={RELEASE}-sessionfleet-router",
                    "--lease-slots=8",
                    "--flush-interval=1",
                    "--create-timeout=30",
                ],
                logs / "router.log",
                env=env,
            )
        )
        nodes = sorted(self.cluster.gpu_nodes)
        state.add(
            spawn(
                "agent",
                [
                    str(SESSIONFLEET),
                    "agent",
                    "--host=127.0.0.1",
                    f"--port={ports['agent']}",
                    f"--node-name={nodes[0]}",
                    "--interval=5",
                ],
                logs / "agent.log",
                env=env,
            )
        )
        state.data.update(
            kubeconfig=str(self.cluster.kubeconfig),
            router=self.router_url,
            operator_metrics=f"http://127.0.0.1:{ports['metrics']}/metrics",
            agent_metrics=f"http://127.0.0.1:{ports['agent']}/metrics",
            nodes=nodes,
        )
        state.save()
        storage = state.dir / "checkpoints"
        storage.mkdir(parents=True, exist_ok=True)
        names = [f"w-{i}" for i in range(args.workers)]
        interval = "3s" if args.fast else "8s"
        for i, name in enumerate(names):
            # Checkpoints "both": the last worker runs without, to show what is lost.
            use = checkpoints and not (args.checkpoints == "both" and i == len(names) - 1)
            engine = "vllm" if args.engine == "vllm" and name in VLLM_WORKERS else "sim"
            body = worker(name, nodes[i % len(nodes)], storage if use else None, interval, engine)
            self.crs.create_namespaced_custom_object(
                GROUP, VERSION, NAMESPACE, "inferenceworkers", body
            )
        real = [n for n in names if args.engine == "vllm" and n in VLLM_WORKERS]
        log(
            f"{len(names)} InferenceWorkers created (pods backed by processes)"
            + (f"; {', '.join(real)} on real vLLM (CPU build, tiny model)" if real else "")
        )

        def ready() -> bool:
            phases = [
                (w.get("status") or {}).get("phase") for w in self.objects("inferenceworkers")
            ]
            return len(phases) == len(names) and all(p == "Ready" for p in phases)

        # vLLM takes about 30 s to start where the simulated engine takes one.
        self.wait(ready, 300 if real else 120, "every worker Ready")
        import httpx

        self.wait(
            lambda: httpx.get(f"{self.router_url}/readyz", timeout=2).status_code == 200,
            60,
            "the router ready",
        )
        return names

    # ------------------------------------------------------------- scenario

    def pinned(self, workers: set[str]) -> list[str]:
        """Sessions bound to ``workers`` and not finished."""
        return [
            s["metadata"]["name"]
            for s in self.objects("agentsessions")
            if (s.get("status") or {}).get("worker") in workers
            and (s.get("status") or {}).get("phase") not in ("Finished", "Lost")
        ]

    async def drain(self, driver: Driver, node: str, workers: list[str]) -> dict[str, Any]:
        """Cordon and drain ``node`` once its workers hold sessions; time the drain."""
        total = driver.total_turns
        while driver.done_turns < 0.3 * total or not await asyncio.to_thread(
            self.pinned, set(workers)
        ):
            if driver.done_turns >= 0.8 * total:
                break
            await asyncio.sleep(0.5)
        pinned = await asyncio.to_thread(self.pinned, set(workers))
        self.step = f"draining {node}"
        started = self.clock()
        assert self.cluster is not None
        kubectl = find_tools().kubectl
        proc = await asyncio.create_subprocess_exec(
            str(kubectl),
            f"--kubeconfig={self.cluster.kubeconfig}",
            "drain",
            node,
            "--ignore-daemonsets",
            "--delete-emptydir-data",
            "--timeout=150s",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        output, _ = await proc.communicate()
        ended = self.clock()
        text = output.decode(errors="replace")
        (self.state.dir / "logs" / "drain.log").write_text(text)
        held = any(
            w in line and "disruption budget" in line for line in text.splitlines() for w in workers
        )
        sessions = await asyncio.to_thread(self.objects, "agentsessions")
        moves = [
            m
            for s in sessions
            for m in (s.get("status") or {}).get("migrations") or []
            if m.get("reason") == "Drain" and m.get("from") in workers
        ]
        migrated = sum(1 for m in moves if m.get("checkpoint"))
        released = len(moves) - migrated
        self.step = "workload"
        return {
            "node": node,
            "workers": workers,
            "started": round(started, 2),
            "ended": round(ended, 2),
            "completed": proc.returncode == 0,
            "held": held,
            "pinned_at_start": len(pinned),
            "migrated": migrated,
            "released": released,
            "waited": max(0, len(pinned) - len(moves)),
        }

    async def kill(
        self, driver: Driver, name: str, checkpoints: bool, after: asyncio.Task[Any] | None
    ) -> dict[str, Any]:
        """Kill ``name``'s engine process mid-workload; time its new epoch to Ready."""
        total = driver.total_turns
        while driver.done_turns < 0.5 * total:
            await asyncio.sleep(0.5)
        if after is not None:
            await asyncio.wait({after}, timeout=120)
        status = (await asyncio.to_thread(self.get, "inferenceworkers", name)).get("status") or {}
        if checkpoints:
            # Kill right after a fresh periodic checkpoint, as a crash might come any time:
            # what happened since the last checkpoint is recomputed either way.
            last = status.get("lastCheckpoint")
            for _ in range(60):
                await asyncio.sleep(0.25)
                status = (await asyncio.to_thread(self.get, "inferenceworkers", name)).get(
                    "status"
                ) or {}
                if status.get("lastCheckpoint") != last:
                    break
        epoch = int(status.get("epoch") or 0)
        pod = self.core.api_client.sanitize_for_serialization(
            self.core.read_namespaced_pod(status["pod"], NAMESPACE)
        )
        pid = container_id_pid(pod)
        if pid is None:
            raise DemoError(f"no engine process found for {name}")
        self.step = f"{name} killed; recovering"
        killed = self.clock()
        # The whole process group, as a container dies: vLLM runs three processes.
        os.killpg(pid, signal.SIGKILL)
        ready_at = None
        for _ in range(400):
            await asyncio.sleep(0.25)
            status = (await asyncio.to_thread(self.get, "inferenceworkers", name)).get(
                "status"
            ) or {}
            if int(status.get("epoch") or 0) > epoch and status.get("phase") == "Ready":
                ready_at = self.clock()
                break
        self.step = "workload"
        return {
            "worker": name,
            "checkpoints": "on" if checkpoints else "off",
            "killed": round(killed, 2),
            "ready": None if ready_at is None else round(ready_at, 2),
            "epoch_before": epoch,
            "epoch_after": status.get("epoch"),
            "restore_count": status.get("restoreCount", 0),
        }

    async def progress(self, driver: Driver) -> None:
        """Show a live status line on stderr."""
        tty = sys.stderr.isatty()
        last = 0.0
        while True:
            now = self.clock()
            line = (
                f"[{now:5.0f}s] {self.step:<28} turns {driver.done_turns}/{driver.total_turns} "
                f"sessions active {driver.active():>3} finished "
                f"{sum(1 for r in driver.runs.values() if r.ok)}/{len(driver.sessions)}"
            )
            if tty:
                print(f"\r{line}", end="", file=sys.stderr, flush=True)
            elif now - last >= 5:
                print(line, file=sys.stderr, flush=True)
                last = now
            await asyncio.sleep(1)

    async def scenario(
        self, names: list[str]
    ) -> tuple[Driver, dict[str, Any], list[dict[str, Any]]]:
        """Run the workload, with a drain and engine kills in the middle."""
        args = self.args
        sessions = self.workload()
        self.t0 = time.monotonic()
        driver = Driver(self.router_url, sessions, MODEL, clock=self.clock)
        nodes: list[str] = self.state.data["nodes"]
        drained_workers = [n for i, n in enumerate(names) if nodes[i % len(nodes)] == nodes[0]]
        survivors = [n for n in names if n not in drained_workers]
        self.step = "workload"
        ticker = asyncio.create_task(self.progress(driver))
        run = asyncio.create_task(driver.run())
        drain = asyncio.create_task(self.drain(driver, nodes[0], drained_workers))
        # A vLLM worker's checkpoints are its KV store (docs/kvstore.md).
        checkpointed = args.checkpoints != "off"
        kills = [asyncio.create_task(self.kill(driver, survivors[0], checkpointed, drain))]
        if args.checkpoints == "both":
            kills.append(asyncio.create_task(self.kill(driver, names[-1], False, drain)))
        await run
        drain_result = await drain
        failures = [await k for k in kills]
        ticker.cancel()
        print("", file=sys.stderr)
        return driver, drain_result, failures

    def workload(self) -> list[Session]:
        """Return the sessions to drive: the synthetic workload, or a trace (--trace)."""
        args = self.args
        if args.trace:
            return replay_workload(args.trace, model=MODEL, time_scale=args.time_scale)
        return make_workload(args.sessions, fast=args.fast, model=MODEL, seed=args.seed)

    def simulator(self, workers: int) -> list[dict[str, Any]]:
        """Simulate the same workload: round-robin, plain affinity, the operator."""
        sessions = self.workload()
        fleet = FleetConfig(workers=workers, model=MODEL, kv_tokens=1_048_576, restart_seconds=10.0)
        return [
            simulate(sessions, name, fleet).as_dict()
            for name in ("round-robin", "affinity", "operator")
        ]

    def run(self) -> int:
        """Everything; returns the exit status."""
        names = self.start()
        what = f"the trace {' '.join(self.args.trace)}" if self.args.trace else None
        log(
            f"driving {what or f'{self.args.sessions} root sessions'} through the router "
            f"at {self.router_url}"
        )
        driver, drain, failures = asyncio.run(self.scenario(names))
        log("waiting for the router's usage writes, then computing the report")
        time.sleep(2)
        settings = {
            "sessions": self.args.sessions,
            "fast": self.args.fast,
            "seed": self.args.seed,
            "workers": len(names),
            "drain_mode": self.args.drain_mode,
            "checkpoints": self.args.checkpoints,
            "wall_seconds": round(self.clock(), 1),
        }
        report = build_report(
            driver.runs,
            drain=drain,
            failures=failures,
            simulator=self.simulator(len(names)),
            settings=settings,
        )
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "report.json").write_text(json.dumps(report, indent=2))
        (self.out / "report.md").write_text(render_markdown(report))
        png = render_png(report, driver.runs, self.out / "demo.png")
        print(render_text(report))
        print(f"\nreport: {self.out / 'report.md'}" + (f", {self.out / 'demo.png'}" if png else ""))
        return 0

    def suggestions(self) -> str:
        """Return what to try while the demo's cluster is up."""
        return suggestions(self.state.data, [SESSIONFLEET.parent, find_tools().kubectl.parent])


def suggestions(data: dict[str, Any], path: list[Path]) -> str:
    """Return the commands to try against a demo that is up, from its ``demo.json`` data.

    ``path``: the directories to put first on ``PATH``: the virtual environment's bin,
    where kubectl finds the ``kubectl-sessionfleet`` plugin, and the pinned kubectl's
    (``kubectl events`` sorts the operator's events.k8s.io Events by their eventTime;
    ``kubectl get events --sort-by=.lastTimestamp`` cannot, they have no lastTimestamp).
    """
    dirs = ":".join(str(d) for d in dict.fromkeys(path))
    return "\n".join(
        [
            "",
            "The cluster stays up. Try:",
            f"  export KUBECONFIG={data['kubeconfig']}",
            f"  export PATH={dirs}:$PATH",
            f"  kubectl sessionfleet status -n {NAMESPACE}",
            f"  kubectl -n {NAMESPACE} get sessionfleet",
            f"  kubectl -n {NAMESPACE} describe inferenceworker w-1",
            f"  kubectl -n {NAMESPACE} events",
            f"  kubectl -n {NAMESPACE} events --for inferenceworker/w-1",
            f"  curl -s {data['router']}/v1/chat/completions -H 'X-Session-Id: try-1' "
            f'-d \'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi"}}]}}\'',
            f"  curl -s {data['router']}/metrics | grep sessionfleet_router",
            f"  curl -s {data['operator_metrics']} | grep sessionfleet_",
            f"  curl -s {data['agent_metrics']}",
            "  make demo-down    # stops the cluster and every process the demo started",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run it."""
    parser = argparse.ArgumentParser(
        prog="demo/run.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("action", nargs="?", default="up", choices=("up", "down", "status"))
    parser.add_argument("--state-dir", type=Path, default=REPO / ".demo-state")
    parser.add_argument("--out-dir", type=Path, default=REPO / "demo-out")
    parser.add_argument(
        "--sessions", type=int, default=0, help="root sessions (default 30, fast 10)"
    )
    parser.add_argument(
        "--drain-mode", default="WaitThenMigrate", choices=("Wait", "Migrate", "WaitThenMigrate")
    )
    parser.add_argument("--checkpoints", default="on", choices=("on", "off", "both"))
    parser.add_argument(
        "--engine",
        default="sim",
        choices=("sim", "vllm"),
        help="vllm: w-0 and w-1 run the real vLLM (make e2e-vllm-tools installs it)",
    )
    parser.add_argument("--workers", type=int, default=5)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--fast", action="store_true", help="seconds instead of minutes (CI)")
    parser.add_argument(
        "--trace",
        nargs="+",
        metavar="PATH",
        help="replay Claude Code JSON traces (files or a folder) or a Mooncake JSONL file "
        "instead of the synthetic workload (docs/simulator.md)",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="with --trace: multiply the trace's times (0.1: ten times as fast)",
    )
    parser.add_argument("--down-after", action="store_true", help="stop everything at the end")
    args = parser.parse_args(argv)
    args.state_dir = args.state_dir.resolve()
    args.out_dir = args.out_dir.resolve()
    if not args.sessions:
        args.sessions = 10 if args.fast else 30
    if args.workers < 4:
        parser.error("--workers must be at least 4 (two on the drained node, two to kill or keep)")
    if args.action == "down":
        return down(args.state_dir)
    state = State(args.state_dir)
    if args.action == "status":
        up = state.load() and state.running()
        print("up" if up else "down", json.dumps(state.data, indent=2) if up else "")
        return 0 if up else 1
    if state.load() and state.running():
        print(
            f"A demo is already up in {args.state_dir} (KUBECONFIG="
            f"{state.data.get('kubeconfig', '?')}). Stop it first with `make demo-down`.",
            file=sys.stderr,
        )
        return 2
    demo = Demo(args)
    try:
        code = demo.run()
    except (DemoError, ClusterError) as error:
        print(
            f"\ndemo failed: {error}\nlogs: {args.state_dir / 'logs'}, "
            f"{args.state_dir / 'cluster' / 'logs'}; `make demo-down` cleans up",
            file=sys.stderr,
        )
        if args.down_after:
            down(args.state_dir)
        return 1
    except BaseException:
        down(args.state_dir)
        raise
    if args.down_after:
        down(args.state_dir)
    else:
        print(demo.suggestions())
    return code


if __name__ == "__main__":
    sys.exit(main())
