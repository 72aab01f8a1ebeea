"""Endpoint Picker benchmark: the decision time the EPP adds, and its CPU per decision.

Run from the repository root (after ``make venv`` and ``make e2e-tools``)::

    .venv/bin/python bench/epp/run.py [--out FILE]     # make bench-epp

It starts a real control plane (the e2e harness; or uses ``--kubeconfig``), applies the
CRDs, creates a namespace with ``--workers`` InferenceWorkers made Ready with a status
endpoint by patching their status directly (no engine runs: the EPP only picks, nothing
is proxied) and ``--sessions`` AgentSessions, each given a bound status (a worker,
phase Bound) through the status subresource, in concurrent chunks. No operator runs.
Then ``sessionfleet epp`` runs as a real process for the namespace, and the benchmark
waits for its gRPC health ``readiness``.

The load is an open-loop generator in this process (grpc.aio over one HTTP/2 channel,
as Envoy's ext_proc filter keeps one per cluster): each request starts at its scheduled
time whatever the earlier ones are doing, bounded only by ``--max-in-flight`` open
streams (a request that waits for that cap starts late: its lag is reported). A
request is one ``ExternalProcessor.Process`` stream for a turn of an existing bound
session picked at random, in Envoy's message order (``tests/epp_client.py``):
request headers (with ``X-Session-Id`` and ``protocol_config``), then the body (a small
OpenAI chat request) in one chunk with ``end_of_stream``; the EPP answers with the
destination; then the stream is closed. Two kinds of exchange (``--exchanges``):

* ``decision``: the request only; after the answers carrying the destination (in
  ``FULL_DUPLEX_STREAMED``: the headers answer and the body echo) the stream is
  half-closed and its end awaited;
* ``full``: then also the response as Envoy forwards it: response headers (200, the
  served endpoint in ``envoy.lb`` metadata) and a JSON body with ``usage`` in one chunk,
  each answered, then the end. The EPP records the turn's usage in its ledger and its
  usage flusher patches each session's status every ``--flush-interval`` s (10 by
  default), so this exercises the accounting path and its API writes.

Per request: **decision time**, from just before the last request message is written
(the body with ``end_of_stream``) to the answer carrying ``x-gateway-destination-
endpoint`` being read (what the gateway waits for before it can pick the upstream), and
the **stream time**, from the stream's start to its end. Each destination is checked
against the session's bound worker (a mismatch is an error).

For each exchange kind and each ``--rates`` rate: ``--warmup`` s at that rate, then
``--seconds`` s measured. Over the measured window: the EPP process's CPU seconds
(``/proc/<pid>/stat``, utime+stime) divided by the decisions = **CPU per decision**;
this generator's own CPU (it shares the machine's cores with the EPP and the control
plane); the machine's 1-minute load average, sampled every second. The decision
phases all run before the full ones, so that the usage writes of a full phase do not
land in a decision phase.

Nothing here is pass/fail; the figures are printed as a table and, with ``--out``,
written as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
# Appended, not prepended: the repository root holds a folder named operator/, which
# must not hide the standard library's operator module.
sys.path.append(str(REPO))

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from e2e.localcluster import LocalCluster, find_tools  # noqa: E402
from sessionfleet.kube import SESSIONS, WORKERS, Kube, KubeConfig, KubeError  # noqa: E402
from sessionfleet.resources.names import session_object_name  # noqa: E402
from tests.epp_client import (  # noqa: E402
    DESTINATION,
    MODES,
    request_body,
    request_headers,
    response_body,
    response_headers,
)

VENV_BIN = Path(sys.executable).parent
SESSIONFLEET = VENV_BIN / "sessionfleet"
GROUP_VERSION = "sessionfleet.dev/v1alpha1"
MODEL = "bench-model"
CRDS_DIR = REPO / "crds"
EXCHANGES = ("decision", "full")


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


def cpu_seconds(pid: int | str) -> float:
    """User + system CPU time a process (all its threads) has used so far."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    # After the command name: utime is field 14 and stime 15 (1-based), 12 and 13 here.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    """A process's resident set size in MiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ------------------------------------------------------------------ the fleet


def worker_endpoint(index: int) -> str:
    """A made-up engine address per worker: the EPP names it and nothing connects to it."""
    return f"http://127.4.{index // 250}.{index % 250 + 1}:8000"


def session_id(index: int) -> str:
    return f"bench-epp-{index:06d}"


async def create_fleet(
    clients: list[Kube], namespace: str, workers: int, sessions: int, concurrency: int
) -> dict[str, str]:
    """Ready workers and bound sessions; returns each session id's expected ``ip:port``."""
    kube = clients[0]
    capacity = max(1000, 2 * sessions // max(1, workers) + 1)
    for index in range(workers):
        name = f"w{index}"
        await kube.create(
            WORKERS,
            {
                "apiVersion": GROUP_VERSION,
                "kind": "InferenceWorker",
                "metadata": {"name": name},
                "spec": {
                    "model": MODEL,
                    "engine": {"type": "sim"},
                    "gpus": 1,
                    "capacity": {"maxSessions": capacity},
                },
            },
            namespace,
        )
        await kube.patch(
            WORKERS,
            name,
            {"status": {"phase": "Ready", "endpoint": worker_endpoint(index)}},
            namespace,
            status=True,
        )
    expected: dict[str, str] = {}
    gate = asyncio.Semaphore(concurrency)
    errors: Counter[str] = Counter()
    bound_at = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    async def one(index: int) -> None:
        sid = session_id(index)
        name = session_object_name(sid)
        worker = index % workers
        client = clients[index % len(clients)]
        created = False
        async with gate:
            for _attempt in range(3):
                try:
                    if not created:
                        try:
                            await client.create(
                                SESSIONS,
                                {
                                    "apiVersion": GROUP_VERSION,
                                    "kind": "AgentSession",
                                    "metadata": {"name": name},
                                    "spec": {"sessionId": sid, "model": MODEL},
                                },
                                namespace,
                            )
                        except KubeError as error:
                            if error.status != 409:  # 409: a create that timed out did land
                                raise
                        created = True
                    await client.patch(
                        SESSIONS,
                        name,
                        {"status": {"phase": "Bound", "worker": f"w{worker}", "boundAt": bound_at}},
                        namespace,
                        status=True,
                    )
                    expected[sid] = worker_endpoint(worker).removeprefix("http://")
                    return
                except KubeError as error:
                    errors[type(error).__name__] += 1
                    await asyncio.sleep(0.5)

    started = time.monotonic()
    chunk = 500
    for first in range(0, sessions, chunk):
        await asyncio.gather(*(one(i) for i in range(first, min(sessions, first + chunk))))
        log(f"  {len(expected)}/{sessions} sessions bound ({time.monotonic() - started:.0f} s)")
    if errors:
        log(f"  API errors while creating sessions (retried): {dict(errors)}")
    if len(expected) < sessions:
        raise RuntimeError(f"only {len(expected)}/{sessions} sessions were created and bound")
    return expected


# ------------------------------------------------------------------ the EPP


class Epp:
    """``sessionfleet epp`` as a process of its own."""

    def __init__(self, kubeconfig: Path, namespace: str, log_path: Path, extra: list[str]) -> None:
        self.port = free_port()
        self.log_path = log_path
        argv = [
            str(SESSIONFLEET),
            "epp",
            "--host=127.0.0.1",
            f"--port={self.port}",
            "--metrics-port=0",
            "--health-port=0",
            # Plaintext, as the numbers before TLS were measured: TLS is the gateway's cost.
            "--no-secure-serving",
            f"--namespace={namespace}",
            f"--kubeconfig={kubeconfig}",
            "--replica=bench-epp",
            "--log-level=WARNING",
            *extra,
        ]
        self.process = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=log_path.open("wb"), start_new_session=True
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    async def wait_ready(self, timeout: float = 60.0) -> float:
        """Wait for gRPC health ``readiness`` SERVING; return the seconds it took."""
        started = time.monotonic()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() - started < timeout:
                if self.process.poll() is not None:
                    raise RuntimeError(f"the EPP exited:\n{self.log_tail()}")
                try:
                    reply = await stub.Check(
                        health_pb2.HealthCheckRequest(service="readiness"), timeout=2
                    )
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return time.monotonic() - started
                except grpc.RpcError:
                    pass
                await asyncio.sleep(0.2)
        raise RuntimeError(f"the EPP was not ready within {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        return self.process.returncode


# ------------------------------------------------------------------ the load


@dataclass
class Sample:
    """One request: decision and stream times in seconds, or an error."""

    decision: float | None = None
    stream: float | None = None
    error: str | None = None


@dataclass
class Messages:
    """The ext_proc messages, built once: the generator should cost as little as it can."""

    mode: int
    headers: dict[str, Any]
    """Each session id's ``request_headers`` message."""
    body: Any
    response_headers: dict[str, Any]
    """Each ``ip:port``'s ``response_headers`` message (served endpoint in metadata)."""
    response_body: Any

    @classmethod
    def build(cls, mode: int, expected: dict[str, str]) -> Messages:
        chat = {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": "You are a coding agent. " * 20},
                {"role": "user", "content": "Run the tests and fix what fails."},
            ],
            "max_tokens": 16,
        }
        body = json.dumps(chat).encode()
        answer = {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "Done: all tests pass."},
                    "finish_reason": "stop",
                }
            ],
            "usage": {
                "prompt_tokens": 140,
                "completion_tokens": 16,
                "total_tokens": 156,
                "prompt_tokens_details": {"cached_tokens": 128},
            },
        }
        headers = {
            sid: request_headers(
                {
                    ":authority": "gateway.local",
                    ":scheme": "http",
                    "content-type": "application/json",
                    "content-length": str(len(body)),
                    "x-session-id": sid,
                },
                mode=mode,
                response_mode=mode,
            )
            for sid in expected
        }
        served = {
            endpoint: response_headers(200, served=endpoint) for endpoint in set(expected.values())
        }
        return cls(
            mode,
            headers,
            request_body(body, True),
            served,
            response_body(json.dumps(answer).encode(), True),
        )


def _destination(answer: Any) -> str | None:
    """The destination header of a deciding answer, None if it carries none."""
    kind = answer.WhichOneof("response")
    if kind not in ("request_headers", "request_body"):
        return None
    for option in getattr(answer, kind).response.header_mutation.set_headers:
        if option.header.key == DESTINATION:
            return str(option.header.raw_value.decode())
    return None


class Refused(Exception):
    """The EPP answered something else than the next expected answer."""


class Generator:
    """Sends one ext_proc stream per request over a shared channel."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        messages: Messages,
        expected: dict[str, str],
        timeout: float,
        seed: int,
    ) -> None:
        from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

        self.process = pb_grpc.ExternalProcessorStub(channel).Process
        self.messages = messages
        self.expected = expected
        self.ids = list(expected)
        self.timeout = timeout
        self.random = random.Random(seed)
        self.full_ok = 0
        """Full exchanges that ended without error, warm-ups included."""

    async def request(self, full: bool) -> Sample:
        """One turn of a random session; its times or its error."""
        sid = self.ids[self.random.randrange(len(self.ids))]
        sample = Sample()
        started = time.perf_counter()
        call = self.process(timeout=self.timeout)
        try:
            await self._exchange(call, sid, full, sample)
            await call.done_writing()
            if await call.read() is not grpc.aio.EOF:
                sample.error = "unexpected answer at the end"
            code = await call.code()
            if code != grpc.StatusCode.OK and sample.error is None:
                sample.error = f"grpc {code.name}"
        except grpc.aio.AioRpcError as error:
            sample.error = sample.error or f"grpc {error.code().name}"
        except (Refused, EOFError) as error:
            sample.error = sample.error or str(error)
            call.cancel()
        except Exception as error:  # counted, not raised: the run goes on
            sample.error = sample.error or type(error).__name__
            call.cancel()
        sample.stream = time.perf_counter() - started
        if full and sample.error is None:
            self.full_ok += 1
        return sample

    async def _read(self, call: Any, want: str) -> Any:
        answer = await call.read()
        if answer is grpc.aio.EOF:
            raise EOFError("the EPP ended the stream early")
        kind = answer.WhichOneof("response")
        if kind != want:
            if kind == "immediate_response":
                immediate = answer.immediate_response
                raise Refused(f"immediate {immediate.status.code} {immediate.details}")
            raise Refused(f"answer {kind}, expected {want}")
        return answer

    async def _exchange(self, call: Any, sid: str, full: bool, sample: Sample) -> None:
        messages = self.messages
        duplex = messages.mode == MODES.FULL_DUPLEX_STREAMED
        await call.write(messages.headers[sid])
        if not duplex:  # BUFFERED: the headers are answered first, without a decision
            await self._read(call, "request_headers")
        sent = time.perf_counter()
        await call.write(messages.body)
        try:
            answer = await self._read(call, "request_headers" if duplex else "request_body")
        except Refused as refused:
            sample.error = str(refused)
            return
        sample.decision = time.perf_counter() - sent
        endpoint = _destination(answer)
        if endpoint is None:
            sample.error = "no destination"
        elif endpoint.split(",")[0] != self.expected[sid]:
            sample.error = "wrong destination"
        if duplex:
            await self._read(call, "request_body")  # the body, streamed back
        if not full:
            return
        await call.write(messages.response_headers[self.expected[sid]])
        await self._read(call, "response_headers")
        await call.write(messages.response_body)
        await self._read(call, "response_body")


@dataclass
class Pace:
    """How well a paced run kept to its schedule."""

    requests: int
    seconds: float
    """From the first scheduled start to the last start, plus one interval."""
    lags: list[float] = field(default_factory=list)
    capped: int = 0
    """Requests that found ``max_in_flight`` streams open and waited."""


async def paced(
    rate: float, seconds: float, max_in_flight: int, send: Callable[[], Awaitable[Sample]]
) -> tuple[Pace, list[Sample]]:
    """Call ``send()`` ``rate`` times a second for ``seconds``, open loop.

    Each call starts at its scheduled time whatever the earlier ones are doing, unless
    ``max_in_flight`` are open: then it waits for one to end, and starts late. How late
    every call started is kept, so a saturated generator or EPP shows up instead of
    silently turning the run into a closed loop.
    """
    count = max(1, round(rate * seconds))
    gate = asyncio.Semaphore(max_in_flight)
    samples: list[Sample] = []
    tasks: list[asyncio.Task[None]] = []
    pace = Pace(count, 0.0)

    async def one() -> None:
        try:
            samples.append(await send())
        finally:
            gate.release()

    start = time.perf_counter()
    for index in range(count):
        due = start + index / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if gate.locked():
            pace.capped += 1
        await gate.acquire()
        now = time.perf_counter()
        pace.lags.append(max(0.0, now - due))
        tasks.append(asyncio.create_task(one()))
    # The schedule spans count / rate seconds: the last start plus one interval.
    pace.seconds = time.perf_counter() - start + 1 / rate
    await asyncio.gather(*tasks)
    return pace, samples


# ------------------------------------------------------------------ phases


def ms(values: list[float]) -> dict[str, float]:
    """Percentiles of seconds, in milliseconds."""
    return {
        "p50": round(1000 * percentile(values, 50), 3),
        "p90": round(1000 * percentile(values, 90), 3),
        "p99": round(1000 * percentile(values, 99), 3),
        "max": round(1000 * max(values, default=float("nan")), 3),
        "mean": round(1000 * statistics.fmean(values), 3) if values else float("nan"),
    }


async def sample_load(into: list[float]) -> None:
    """Append the 1-minute load average every second, until cancelled."""
    while True:
        into.append(os.getloadavg()[0])
        await asyncio.sleep(1.0)


async def phase(
    generator: Generator,
    epp: Epp,
    exchange: str,
    rate: float,
    args: argparse.Namespace,
    idle_cores: float,
) -> dict[str, Any]:
    """Warm up, then measure one exchange kind at one rate."""
    full = exchange == "full"

    def send() -> Awaitable[Sample]:
        return generator.request(full)

    if args.warmup > 0:
        await paced(rate, args.warmup, args.max_in_flight, send)
    load: list[float] = []
    sampler = asyncio.create_task(sample_load(load))
    epp_cpu, own_cpu = cpu_seconds(epp.pid), cpu_seconds("self")
    started = time.perf_counter()
    try:
        pace, samples = await paced(rate, args.seconds, args.max_in_flight, send)
    finally:
        sampler.cancel()
    window = time.perf_counter() - started
    epp_cpu, own_cpu = cpu_seconds(epp.pid) - epp_cpu, cpu_seconds("self") - own_cpu
    decided = [s.decision for s in samples if s.decision is not None]
    ok = [s for s in samples if s.error is None]
    errors = Counter(s.error for s in samples if s.error is not None)
    decisions = len(decided)
    return {
        "exchange": exchange,
        "rate_target": rate,
        "requests": pace.requests,
        "rate_achieved": round(pace.requests / pace.seconds, 1) if pace.seconds else None,
        "window_s": round(window, 2),
        "decisions": decisions,
        "ok": len(ok),
        "errors": dict(errors),
        "decision_ms": ms(decided),
        "stream_ms": ms([s.stream for s in ok if s.stream is not None]),
        "start_lag_ms": {
            "p99": round(1000 * percentile(pace.lags, 99), 3),
            "max": round(1000 * max(pace.lags, default=0.0), 3),
        },
        "capped": pace.capped,
        "epp_cpu_s": round(epp_cpu, 3),
        "epp_cpu_us_per_decision": round(1e6 * epp_cpu / decisions, 1) if decisions else None,
        "epp_cores": round(epp_cpu / window, 3),
        # Less what the EPP burns with no request (health loop, Lease renewal, watches).
        "epp_cpu_us_per_decision_net_of_idle": (
            round(1e6 * max(0.0, epp_cpu - idle_cores * window) / decisions, 1)
            if decisions
            else None
        ),
        "generator_cpu_s": round(own_cpu, 3),
        "generator_cpu_us_per_request": round(1e6 * own_cpu / pace.requests, 1),
        "generator_cores": round(own_cpu / window, 3),
        "epp_rss_mib": round(rss_mib(epp.pid), 1),
        "load_1m_mean": round(statistics.fmean(load), 2) if load else None,
        "load_1m_max": round(max(load), 2) if load else None,
    }


def report(results: dict[str, Any]) -> str:
    """The figures as a Markdown table."""
    config = results["config"]
    lines = [
        f"Endpoint Picker, {config['mode']}, {config['workers']} workers, "
        f"{config['sessions']} bound sessions, {config['seconds']} s per phase after "
        f"{config['warmup']} s of warm-up, at most {config['max_in_flight']} streams open.",
        f"The generator runs on the same {results['machine']['cpus']} CPUs as the EPP and "
        "the control plane (its CPU is shown): latencies include its scheduling, and the "
        "machine's load.",
        "",
        "| exchange | rate (achieved) | requests | errors | decision p50 / p90 / p99 / max ms "
        "| stream p50 / p99 ms | start lag p99 ms | EPP CPU µs/decision, net of idle (cores) "
        "| generator CPU µs/request (cores) | load 1m |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results["phases"]:
        d, s = row["decision_ms"], row["stream_ms"]
        errors = sum(row["errors"].values())
        lines.append(
            f"| {row['exchange']} | {row['rate_target']:g}/s ({row['rate_achieved']}) "
            f"| {row['requests']} | {errors} "
            f"| {d['p50']:.2f} / {d['p90']:.2f} / {d['p99']:.2f} / {d['max']:.2f} "
            f"| {s['p50']:.2f} / {s['p99']:.2f} | {row['start_lag_ms']['p99']:.2f} "
            f"| {row['epp_cpu_us_per_decision']}, {row['epp_cpu_us_per_decision_net_of_idle']} "
            f"({row['epp_cores']}) "
            f"| {row['generator_cpu_us_per_request']} ({row['generator_cores']}) "
            f"| {row['load_1m_mean']} |"
        )
    for row in results["phases"]:
        if row["errors"]:
            lines.append(f"errors, {row['exchange']} at {row['rate_target']:g}/s: {row['errors']}")
        if row["capped"]:
            lines.append(
                f"{row['capped']} requests of {row['exchange']} at {row['rate_target']:g}/s "
                f"waited for the in-flight cap"
            )
    usage = results["usage"]
    lines += [
        f"EPP ready {results['epp_ready_s']} s after start; idle {results['epp_idle_cores']} "
        f"of a core; exit code {results['epp_exit_code']}. Usage accounting: "
        f"{usage['turns_in_session_status']} turns in the sessions' status for "
        f"{usage['full_exchanges_ok']} full exchanges (warm-ups included).",
        "CPU from /proc/<pid>/stat (utime+stime, all threads), 1/"
        f"{os.sysconf('SC_CLK_TCK')} s resolution; load average at the end "
        f"{results['machine']['loadavg_end']}.",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kubeconfig", type=Path, help="use this cluster instead of a new one")
    parser.add_argument("--state-dir", type=Path, help="state dir of the cluster started here")
    parser.add_argument("--workers", type=int, default=8, help="Ready InferenceWorkers")
    parser.add_argument("--sessions", type=int, default=2000, help="bound AgentSessions")
    parser.add_argument("--rates", default="500,2000", help="requests per second, comma-separated")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per rate")
    parser.add_argument("--warmup", type=float, default=2.0, help="warm-up seconds per rate")
    parser.add_argument(
        "--exchanges",
        default="decision,full",
        help="decision (request only), full (with the response and its usage), or both",
    )
    parser.add_argument(
        "--mode",
        choices=("FULL_DUPLEX_STREAMED", "BUFFERED"),
        default="FULL_DUPLEX_STREAMED",
        help="the body mode announced in protocol_config",
    )
    parser.add_argument("--max-in-flight", type=int, default=256, help="open streams at most")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per stream")
    parser.add_argument("--clients", type=int, default=4, help="API clients for the setup")
    parser.add_argument(
        "--setup-concurrency", type=int, default=32, help="API requests in flight in the setup"
    )
    parser.add_argument(
        "--idle", type=float, default=5.0, help="seconds of EPP idle CPU measured before the load"
    )
    parser.add_argument("--seed", type=int, default=1, help="the session picker's seed")
    parser.add_argument(
        "--epp-arg",
        action="append",
        default=[],
        help="an extra flag for sessionfleet epp (repeat), e.g. --epp-arg=--flush-interval=1",
    )
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    args.rate_list = [float(r) for r in args.rates.split(",") if r.strip()]
    args.exchange_list = [e.strip() for e in args.exchanges.split(",") if e.strip()]
    if not args.rate_list or any(r <= 0 for r in args.rate_list):
        parser.error("--rates must be positive numbers")
    if not args.exchange_list or set(args.exchange_list) - set(EXCHANGES):
        parser.error(f"--exchanges: one or more of {', '.join(EXCHANGES)}")
    if args.workers < 1 or args.sessions < 1:
        parser.error("--workers and --sessions must be at least 1")
    return args


def kubectl(kubeconfig: Path, *argv: str, timeout: float = 120) -> str:
    result = subprocess.run(
        [str(find_tools().kubectl), f"--kubeconfig={kubeconfig}", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(argv)}: {result.stderr.strip()}")
    return result.stdout


async def run(args: argparse.Namespace, kubeconfig: Path, work: Path) -> dict[str, Any]:
    """Prepare the namespace, start the EPP, run the phases; delete the namespace."""
    namespace = f"bench-epp-{os.getpid()}"
    mode = getattr(MODES, args.mode)
    kubectl(kubeconfig, "apply", "--server-side", "--force-conflicts", "-f", str(CRDS_DIR))
    kubectl(
        kubeconfig,
        "wait",
        "--for=condition=Established",
        "crd",
        "-l",
        "app.kubernetes.io/part-of=sessionfleet",
        "--timeout=60s",
    )
    kubectl(kubeconfig, "create", "namespace", namespace)
    config = KubeConfig.load(str(kubeconfig))
    clients = [Kube(config, user_agent=f"bench-epp/{i}") for i in range(args.clients)]
    epp: Epp | None = None
    try:
        log(f"creating {args.workers} workers and {args.sessions} bound sessions in {namespace}")
        expected = await create_fleet(
            clients, namespace, args.workers, args.sessions, args.setup_concurrency
        )
        epp = Epp(kubeconfig, namespace, work / "epp.log", args.epp_arg)
        ready = await epp.wait_ready()
        log(f"EPP pid {epp.pid} ready in {ready:.1f} s on port {epp.port}; log {epp.log_path}")
        messages = Messages.build(mode, expected)
        idle_cores = 0.0
        if args.idle > 0:  # what the EPP costs with no request, to set its figures against
            before = cpu_seconds(epp.pid)
            await asyncio.sleep(args.idle)
            idle_cores = (cpu_seconds(epp.pid) - before) / args.idle
            log(f"EPP idle: {idle_cores:.4f} of a core over {args.idle:g} s")
        phases: list[dict[str, Any]] = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.port}") as channel:
            generator = Generator(channel, messages, expected, args.timeout, args.seed)
            for exchange in args.exchange_list:
                for rate in args.rate_list:
                    log(f"{exchange} at {rate:g}/s: {args.warmup:g} s warm-up, {args.seconds:g} s")
                    row = await phase(generator, epp, exchange, rate, args, idle_cores)
                    phases.append(row)
                    d = row["decision_ms"]
                    log(
                        f"  achieved {row['rate_achieved']}/s, decision p50 {d['p50']:.2f} "
                        f"p99 {d['p99']:.2f} ms, EPP {row['epp_cpu_us_per_decision']} µs/decision,"
                        f" errors {row['errors'] or 0}"
                    )
                    if epp.process.poll() is not None:
                        raise RuntimeError(f"the EPP exited:\n{epp.log_tail()}")
            full_ok = generator.full_ok
        # A clean stop writes the usage still in the ledger: then every full exchange
        # should show as one turn in its session's status.
        code = epp.stop()
        items, _ = await clients[0].list(SESSIONS, namespace)
        recorded = sum(int((item.get("status") or {}).get("turns") or 0) for item in items)
        log(f"EPP exited with {code}; turns in the sessions' status {recorded} / {full_ok}")
        return {
            "config": {
                "mode": args.mode,
                "workers": args.workers,
                "sessions": args.sessions,
                "seconds": args.seconds,
                "warmup": args.warmup,
                "max_in_flight": args.max_in_flight,
                "epp_args": args.epp_arg,
            },
            "epp_ready_s": round(ready, 2),
            "epp_idle_cores": round(idle_cores, 4),
            "epp_exit_code": code,
            "usage": {"full_exchanges_ok": full_ok, "turns_in_session_status": recorded},
            "phases": phases,
        }
    finally:
        if epp is not None:
            stopped = epp.stop()
            if stopped not in (0, None):
                log(f"the EPP exited with {stopped}:\n{epp.log_tail()}")
        for client in clients:
            await client.aclose()
        try:
            kubectl(kubeconfig, "delete", "namespace", namespace, "--wait=false")
        except RuntimeError as error:
            log(f"namespace not deleted: {error}")


def main(argv: list[str] | None = None) -> int:
    """Start or attach to a cluster, run the benchmark, print and save the figures."""
    args = parse_args(argv)
    # SIGTERM (a timeout, a kill) ends the run through the finally blocks, which stop
    # the EPP and the cluster.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(tempfile.mkdtemp(prefix="bench-epp-"))
    cluster: LocalCluster | None = None
    if args.kubeconfig is not None:
        kubeconfig = args.kubeconfig
    else:
        cluster = LocalCluster.start(args.state_dir)
        kubeconfig = cluster.kubeconfig
    try:
        results = asyncio.run(run(args, kubeconfig, work))
    finally:
        if cluster is not None:
            cluster.stop()
    results["machine"] = {
        "cpus": os.cpu_count(),
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "python": sys.version.split()[0],
        "grpcio": grpc.__version__,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }
    print(report(results))
    print(f"\nEPP log: {work / 'epp.log'}", file=sys.stderr)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
