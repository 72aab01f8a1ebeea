"""The router and simulated engines as real processes against the real control plane.

No operator runs here: each test creates its InferenceWorkers and sets their status
(phase Ready, endpoint) through the status subresource, as the operator would, for
sim-engine processes it starts itself on 127.3.x.y addresses (outside KWOK's pod
range). Routers run as ``sessionfleet router`` processes serving the test's namespace.
"""

from __future__ import annotations

import secrets
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client

from e2e.helpers import CRDS_DIR, Kubectl, wait_established, wait_until
from e2e.localcluster import LocalCluster
from e2e.operator import Process

pytestmark = pytest.mark.timeout(180)

SESSIONFLEET = Path(sys.executable).parent / "sessionfleet"
GROUP, VERSION = "sessionfleet.dev", "v1alpha1"
MODEL = "e2e-model"
SYSTEM = "You are a coding agent working in a large repository. " * 40


@pytest.fixture(scope="session")
def crds_installed(kubectl: Kubectl) -> None:
    """The sessionfleet CRDs, applied and Established (idempotent across workers)."""
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRDS_DIR))
    wait_established(kubectl, "-l", "app.kubernetes.io/part-of=sessionfleet")


@pytest.fixture
def custom(api: Any) -> Any:
    return client.CustomObjectsApi(api)


class Fleet:
    """Sim engines registered as Ready InferenceWorkers, and routers, for one namespace."""

    def __init__(self, cluster: LocalCluster, custom: Any, namespace: str, logs: Path) -> None:
        self.cluster = cluster
        self.custom = custom
        self.namespace = namespace
        self.logs = logs
        self.processes: list[Process] = []
        # A /24 of our own per test: parallel tests never collide on addresses.
        self.subnet = f"127.3.{secrets.randbelow(250) + 1}"
        self.next_host = 10

    def worker(self, name: str, *extra: str, max_sessions: int = 16) -> str:
        host = f"{self.subnet}.{self.next_host}"
        self.next_host += 1
        engine = Process(
            [
                str(SESSIONFLEET),
                "sim-engine",
                f"--host={host}",
                "--port=8000",
                f"--model={MODEL}",
                "--enable-force-include-usage",
                *extra,
            ],
            self.logs / f"engine-{name}.log",
        )
        self.processes.append(engine)
        endpoint = f"http://{host}:8000"
        engine.wait_http(f"{endpoint}/health")
        self.custom.create_namespaced_custom_object(
            GROUP,
            VERSION,
            self.namespace,
            "inferenceworkers",
            {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "InferenceWorker",
                "metadata": {"name": name},
                "spec": {
                    "model": MODEL,
                    "engine": {"type": "sim"},
                    "gpus": 1,
                    "capacity": {"maxSessions": max_sessions},
                },
            },
        )
        self.custom.patch_namespaced_custom_object_status(
            GROUP,
            VERSION,
            self.namespace,
            "inferenceworkers",
            name,
            {"status": {"phase": "Ready", "endpoint": endpoint}},
        )
        return endpoint

    def router(self, name: str, *extra: str) -> tuple[str, Process]:
        port = _free_port()
        router = Process(
            [
                str(SESSIONFLEET),
                "router",
                "--host=127.0.0.1",
                f"--port={port}",
                f"--namespace={self.namespace}",
                f"--kubeconfig={self.cluster.kubeconfig}",
                f"--replica={name}",
                "--flush-interval=1",
                # A loaded CI machine may answer a create slowly; latency is not under test.
                "--create-timeout=30",
                "--log-level=DEBUG",
                *extra,
            ],
            self.logs / f"router-{name}.log",
        )
        self.processes.append(router)
        url = f"http://127.0.0.1:{port}"
        router.wait_http(f"{url}/readyz")
        return url, router

    def sessions(self) -> dict[str, dict[str, Any]]:
        items = self.custom.list_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "agentsessions"
        )["items"]
        return {item["spec"]["sessionId"]: item for item in items}

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def fleet(
    cluster: LocalCluster,
    custom: Any,
    namespace: str,
    crds_installed: None,
    tmp_path: Path,
) -> Iterator[Fleet]:
    fleet = Fleet(cluster, custom, namespace, tmp_path)
    yield fleet
    fleet.stop()
    # Shown by pytest for a failing test: what the routers and engines logged.
    for process in fleet.processes:
        print(f"--- {process.log_path.name}\n{process.log_tail()}")


def turn(
    url: str, messages: list[dict[str, Any]], session: str | None = None, **headers: str
) -> httpx.Response:
    sent = {"X-Session-Id": session} if session else {}
    sent.update({k.replace("_", "-"): v for k, v in headers.items()})
    return httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 24},
        headers=sent,
        timeout=30,
    )


def opening(task: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]


def follow_up(messages: list[dict[str, Any]], answer: httpx.Response, n: int) -> None:
    messages += [
        {"role": "assistant", "content": answer.json()["choices"][0]["message"]["content"]},
        {"role": "user", "content": f"tool result {n}: " + "line of output\n" * 30},
    ]


def test_a_session_stays_on_its_engine_and_its_cache_grows(fleet: Fleet) -> None:
    for name in ("w1", "w2", "w3"):
        fleet.worker(name)
    url, _ = fleet.router("r1")
    messages = opening("Fix the flaky test.")
    workers, cached, prompts = [], [], []
    for n in range(6):
        answer = turn(url, messages, "agent-42")
        assert answer.status_code == 200, answer.text
        workers.append(answer.headers["X-Sessionfleet-Worker"])
        usage = answer.json()["usage"]
        cached.append(usage["prompt_tokens_details"]["cached_tokens"])
        prompts.append(usage["prompt_tokens"])
        follow_up(messages, answer, n)
    assert len(set(workers)) == 1
    assert cached[0] == 0
    assert all(later > earlier for earlier, later in zip(cached, cached[1:], strict=False))

    session = fleet.sessions()["agent-42"]
    assert session["spec"]["workerHint"] == workers[0]
    assert session["spec"]["client"] == "Header"

    def usage_written() -> dict[str, Any] | None:
        status = fleet.sessions()["agent-42"].get("status") or {}
        return status if status.get("turns") == 6 else None

    status = wait_until(usage_written, timeout=20, what="the session's usage in its status")
    assert status["promptTokens"] == sum(prompts)
    assert status["cachedTokens"] == sum(cached)
    assert status["recomputedTokens"] == sum(
        p - c for p, c in zip(prompts[1:], cached[1:], strict=True)
    )
    assert 0 < status["hitRatePercent"] < 100


def test_two_router_replicas_agree_on_every_binding(fleet: Fleet) -> None:
    for name in ("w1", "w2", "w3"):
        fleet.worker(name)
    url_a, _ = fleet.router("ra")
    url_b, _ = fleet.router("rb")
    conversations = {f"team-{n}": opening(f"task {n}") for n in range(8)}
    seen: dict[str, set[str]] = {sid: set() for sid in conversations}
    for n in range(3):
        for index, (sid, messages) in enumerate(conversations.items()):
            # Alternate the replica per session and per turn; the first turn of half
            # the sessions goes to each replica.
            url = (url_a, url_b)[(index + n) % 2]
            answer = turn(url, messages, sid)
            assert answer.status_code == 200, answer.text
            seen[sid].add(answer.headers["X-Sessionfleet-Worker"])
            follow_up(messages, answer, n)
    assert all(len(workers) == 1 for workers in seen.values()), seen
    sessions = fleet.sessions()
    assert sorted(sessions) == sorted(conversations)
    for sid, workers in seen.items():
        assert sessions[sid]["spec"]["workerHint"] == next(iter(workers))
    # Placement spread the sessions over the workers.
    assert len({s["spec"]["workerHint"] for s in sessions.values()}) == 3

    def all_counted() -> bool:
        return all((s.get("status") or {}).get("turns") == 3 for s in fleet.sessions().values())

    # Both replicas wrote usage for the same sessions; conditional writes lost none.
    wait_until(all_counted, timeout=20, what="3 turns counted per session")
    # Each write recorded its id under its replica (read back after a lost answer).
    for stored in fleet.sessions().values():
        assert set(stored["status"]["usageWrites"]) <= {"ra", "rb"}, stored["status"]


def test_racing_first_turns_on_two_replicas_bind_once(fleet: Fleet) -> None:
    for name in ("w1", "w2", "w3"):
        fleet.worker(name)
    url_a, _ = fleet.router("ra")
    url_b, _ = fleet.router("rb")
    sids = [f"race-{n}" for n in range(6)]
    # Each session's first turn reaches both replicas at the same moment: both try to
    # create its AgentSession; the loser of the create adopts the winner's choice.
    with ThreadPoolExecutor(max_workers=12) as pool:
        answers = list(
            pool.map(
                lambda job: (job[0], turn(job[1], opening(job[0]), job[0])),
                [(sid, url) for sid in sids for url in (url_a, url_b)],
            )
        )
    workers: dict[str, set[str]] = {sid: set() for sid in sids}
    for sid, answer in answers:
        assert answer.status_code == 200, answer.text
        workers[sid].add(answer.headers["X-Sessionfleet-Worker"])
    assert all(len(chosen) == 1 for chosen in workers.values()), workers
    sessions = fleet.sessions()
    assert sorted(sessions) == sids
    assert all(sessions[sid]["spec"]["workerHint"] in workers[sid] for sid in sids)


def test_a_restarted_router_keeps_every_binding(fleet: Fleet) -> None:
    for name in ("w1", "w2"):
        fleet.worker(name)
    url, router = fleet.router("before")
    bound = {}
    for n in range(6):
        answer = turn(url, opening(f"job {n}"), f"job-{n}")
        assert answer.status_code == 200
        bound[f"job-{n}"] = answer.headers["X-Sessionfleet-Worker"]
    assert set(bound.values()) == {"w1", "w2"}
    # SIGTERM: the router writes its pending usage before it exits.
    assert router.stop() == 0
    assert all((s.get("status") or {}).get("turns") == 1 for s in fleet.sessions().values())

    url, _ = fleet.router("after")
    for sid, worker in bound.items():
        answer = turn(url, opening(f"job {sid[4:]}"), sid)
        assert answer.status_code == 200
        assert answer.headers["X-Sessionfleet-Worker"] == worker
        assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_bad_requests_get_the_documented_errors(fleet: Fleet) -> None:
    fleet.worker("w1")
    url, _ = fleet.router("r1")

    def error(response: httpx.Response) -> tuple[int, str]:
        assert response.headers["X-Sessionfleet-Reason"] == response.json()["error"]["code"]
        return response.status_code, response.json()["error"]["code"]

    post = f"{url}/v1/chat/completions"
    assert error(httpx.post(post, content=b"{broken", timeout=10)) == (400, "invalid_body")
    assert error(httpx.post(post, json={"messages": []}, timeout=10)) == (400, "invalid_body")
    assert error(turn(url, opening("x"), "bad id")) == (400, "invalid_session_id")
    assert error(httpx.post(post, json={"model": "nope", "messages": []}, timeout=10)) == (
        404,
        "model_not_found",
    )
    assert error(httpx.get(post, timeout=10)) == (405, "method_not_allowed")
    assert error(httpx.get(f"{url}/elsewhere", timeout=10)) == (404, "not_found")
    # A request the engine refuses comes back as the engine said it.
    refused = httpx.post(post, json={"model": MODEL, "messages": []}, timeout=10)
    assert refused.status_code == 400 and "X-Sessionfleet-Reason" not in refused.headers

    # The final marker finishes the session; once the operator (here: the test) marks
    # it Finished, further turns are refused.
    assert turn(url, opening("x"), "last", X_Session_Final="true").status_code == 200

    def finished() -> dict[str, Any] | None:
        item = fleet.sessions().get("last")
        return item if item and item["spec"].get("finished") else None

    item = wait_until(finished, timeout=20, what="spec.finished of session last")
    fleet.custom.patch_namespaced_custom_object_status(
        GROUP,
        VERSION,
        fleet.namespace,
        "agentsessions",
        item["metadata"]["name"],
        {"status": {"phase": "Finished"}},
    )

    def refused_now() -> bool:
        return turn(url, opening("x"), "last").status_code == 409

    wait_until(refused_now, timeout=20, what="409 for a Finished session")
    # A worker that is not Ready: new sessions wait with a Retry-After.
    fleet.custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, fleet.namespace, "inferenceworkers", "w1", {"status": {"phase": "Starting"}}
    )

    def unavailable() -> httpx.Response | None:
        answer = turn(url, opening("y"), "newcomer")
        return answer if answer.status_code == 503 else None

    answer = wait_until(unavailable, timeout=20, what="503 while no worker is Ready")
    assert answer.json()["error"]["code"] == "no_ready_worker"
    assert answer.headers["Retry-After"]


# --- hostile clients (docs/router.md, Limits) ------------------------------------------


def _peak_rss_mib(pid: int) -> float:
    """The process's peak resident memory (VmHWM), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for pid {pid}")


CHART_MEMORY_LIMIT_MIB = 512


def test_compressed_and_maximum_size_bodies_keep_the_router_within_its_memory(
    fleet: Fleet,
) -> None:
    import asyncio
    import gzip
    import io
    import json

    import aiohttp

    fleet.worker("w1")
    url, router = fleet.router("r1")
    before = _peak_rss_mib(router.popen.pid)
    # 57 KB on the wire that would inflate to 56 MiB, and bodies of the maximum size
    # (8 MiB; the bulk in a field the engine ignores), 16 clients at once, 3 rounds.
    bomb = gzip.compress(
        json.dumps({"model": MODEL, "messages": [], "pad": "a" * (56 << 20)}).encode(), 9
    )
    pad = (8 << 20) - 200
    largest = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1,
            "metadata": {"pad": "b" * pad},
        }
    ).encode()
    assert len(largest) <= 8 << 20

    async def client(n: int, http: aiohttp.ClientSession) -> int:
        compressed = n % 2 == 0
        async with http.post(
            f"{url}/v1/chat/completions",
            data=io.BytesIO(bomb if compressed else largest),
            headers={"Content-Type": "application/json"}
            | ({"Content-Encoding": "gzip"} if compressed else {}),
        ) as answer:
            await answer.read()
            return answer.status

    async def rounds() -> list[int]:
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            statuses: list[int] = []
            for _ in range(3):
                statuses += await asyncio.gather(*(client(n, http) for n in range(16)))
            return statuses

    statuses = asyncio.run(rounds())
    assert statuses.count(415) == 24, statuses
    # The maximum-size bodies are served (or, beyond the in-flight cap, told to retry).
    assert set(statuses) - {415} <= {200, 503}, statuses
    assert statuses.count(200) >= 8
    peak = _peak_rss_mib(router.popen.pid)
    print(f"router peak resident memory: {before:.0f} MiB idle, {peak:.0f} MiB under load")
    assert peak < CHART_MEMORY_LIMIT_MIB


def test_slow_clients_are_cut_off_at_the_timeouts(fleet: Fleet) -> None:
    import socket
    import time

    fleet.worker("w1")
    url, _ = fleet.router("r1", "--idle-timeout=1", "--body-timeout=1")
    port = int(url.rsplit(":", 1)[1])

    def answer_after(data: bytes) -> tuple[bytes, float, float]:
        """What came back, when its first byte came, and when the router closed."""
        with socket.create_connection(("127.0.0.1", port), timeout=15) as connection:
            connection.sendall(data)
            started = time.monotonic()
            received = b""
            first = None
            while chunk := connection.recv(4096):
                first = first or time.monotonic() - started
                received += chunk
            closed = time.monotonic() - started
            return received, first or closed, closed

    # Headers that never end: the connection is closed at the idle timeout.
    nothing, _, closed = answer_after(b"POST /v1/chat/completions HTTP/1.1\r\nHost: r")
    assert nothing == b"" and 0.5 < closed < 5
    # A body that never comes: 408 at the body timeout, and the connection closed.
    timed_out, answered, closed = answer_after(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 500\r\n\r\n{"
    )
    assert timed_out.startswith(b"HTTP/1.1 408") and b"body_timeout" in timed_out
    assert 0.5 < answered < 5 and closed < 8


def test_hostile_paths_and_oversized_headers_never_reach_the_worker(fleet: Fleet) -> None:
    import json
    import socket

    fleet.worker("w1")
    url, _ = fleet.router("r1", "--max-header-bytes=16384")
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps(
        {"model": MODEL, "messages": opening("hostile paths"), "max_tokens": 4}
    ).encode()

    def answer(path: str, *extra: str) -> bytes:
        head = [f"POST {path} HTTP/1.1", "Host: r", f"Content-Length: {len(body)}", *extra]
        with socket.create_connection(("127.0.0.1", port), timeout=15) as connection:
            connection.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
            received = b""
            while chunk := connection.recv(65536):
                received += chunk
                if b"\r\n\r\n" in received and b"}" in received.split(b"\r\n\r\n", 1)[1]:
                    break
            return received

    # Before issue 29 these were forwarded byte for byte: the engine answered them.
    for path in ("/v1/../collective_rpc", "/v1/%2e%2e/sleep", "/v1//chat/completions"):
        refused = answer(path)
        assert refused.startswith(b"HTTP/1.1 404"), refused[:200]
        assert b"X-Sessionfleet-Reason: not_found" in refused
        assert b"X-Sessionfleet-Worker" not in refused
    fillers = [f"X-Filler-{i}: " + "a" * 8000 for i in range(3)]
    too_large = answer("/v1/chat/completions", *fillers)
    assert too_large.startswith(b"HTTP/1.1 431") and b"headers_too_large" in too_large
    served = answer("/v1/chat/completions", *fillers[:1])
    assert served.startswith(b"HTTP/1.1 200") and b"X-Sessionfleet-Worker: w1" in served


def test_a_flood_of_new_session_ids_is_limited_and_established_turns_go_on(
    fleet: Fleet,
) -> None:
    import asyncio
    import json
    import statistics
    import subprocess
    import time
    from collections.abc import Callable

    import aiohttp

    fleet.worker("w1", max_sessions=1000)
    fleet.worker("w2", max_sessions=1000)
    url, _ = fleet.router("r1")
    established = opening("the established session")
    for n in range(2):
        answer = turn(url, established, "established")
        assert answer.status_code == 200
        follow_up(established, answer, n)
    body = {"model": MODEL, "messages": opening("flood"), "max_tokens": 1}
    rate, seconds = 1000, 10

    async def established_turns(
        http: aiohttp.ClientSession, go_on: Callable[[float], bool]
    ) -> list[float]:
        latencies = []
        began = time.monotonic()
        while go_on(time.monotonic() - began):
            started = time.monotonic()
            async with http.post(
                f"{url}/v1/chat/completions",
                json={"model": MODEL, "messages": established, "max_tokens": 4},
                headers={"X-Session-Id": "established"},
            ) as answer:
                assert answer.status == 200
                await answer.read()
            latencies.append(time.monotonic() - started)
            await asyncio.sleep(0.1)
        return latencies

    async def run() -> tuple[dict[str, Any], list[float], list[float]]:
        async with aiohttp.ClientSession() as http:
            quiet = await established_turns(http, lambda elapsed: elapsed < 2)
            # The flood's client runs in a process of its own: in this one, its thousands
            # of requests a second would slow this client's turns as much as the router.
            # -P: not e2e/ first on its path, where operator.py would shadow the stdlib's.
            script = str(Path(__file__).parent / "flood_client.py")
            flooder = subprocess.Popen(
                [sys.executable, "-P", script, url, str(rate), str(seconds), json.dumps(body)],
                stdout=subprocess.PIPE,
                text=True,
            )
            # For as long as the flood really lasts (longer than its nominal 10 s on a
            # busy machine), and at least that.
            during = await established_turns(
                http, lambda elapsed: elapsed < seconds or flooder.poll() is None
            )
            out, _ = await asyncio.to_thread(flooder.communicate, timeout=120)
            return json.loads(out), quiet, during

    outcome, quiet, during = asyncio.run(run())
    statuses, flood_seconds = outcome["statuses"], outcome["seconds"]

    created = len(fleet.sessions())
    limited = statuses.count(429)
    print(
        f"flood: {len(statuses)} requests, {limited} answered 429, {statuses.count(200)} "
        f"served, {created} AgentSessions; established turn p50 "
        f"{statistics.median(quiet) * 1000:.1f} ms quiet, "
        f"{statistics.median(during) * 1000:.1f} ms during the flood "
        f"(max {max(during) * 1000:.1f} ms); the flood lasted {flood_seconds:.1f} s"
    )
    # 20 new sessions a second per client with a burst of 40 (the defaults): over the
    # flood's T seconds at most 40 + 20 x (T + 1) new sessions, plus the established one.
    assert created <= 1 + 40 + 20 * (flood_seconds + 1)
    assert limited >= len(statuses) - created
    assert set(statuses) <= {200, 429}
    assert len(during) >= 5


def _created_outcomes(url: str) -> dict[str, float]:
    """Return ``sessionfleet_router_sessions_created_total`` by outcome, from /metrics."""
    outcomes = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("sessionfleet_router_sessions_created_total{"):
            labels, value = line.rsplit(" ", 1)
            outcomes[labels.split('outcome="', 1)[1].split('"', 1)[0]] = float(value)
    return outcomes


def test_a_failed_first_turn_never_deletes_a_session_another_replica_serves(
    fleet: Fleet,
) -> None:
    """Issue 29, item 11: replica A's discard knows only its own turns."""
    fleet.worker("w1", "--decode-ms-per-token=20")
    # A gives up on a worker silent for 4 s; B waits as long as it takes.
    url_a, _ = fleet.router("ra", "--read-timeout=4")
    url_b, router_b = fleet.router("rb")

    def long_turn(url: str, task: str, tokens: int) -> httpx.Response:
        return httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": MODEL, "messages": opening(task), "max_tokens": tokens},
            headers={"X-Session-Id": "shared-7"},
            timeout=60,
        )

    with ThreadPoolExecutor(max_workers=2) as pool:
        # A creates the session; its first turn (2,000 tokens at 20 ms) outlasts A's timeout.
        first = pool.submit(long_turn, url_a, "a long answer", 2000)
        created = wait_until(
            lambda: fleet.sessions().get("shared-7"), timeout=20, what="A's AgentSession"
        )
        # B serves a turn of the same session (600 tokens: 12 s), in flight when A gives up.
        served = pool.submit(long_turn, url_b, "go on", 600)
        assert first.result().status_code == 502  # upstream_timeout: A's turn got no answer
        outcomes = wait_until(
            lambda: (o := _created_outcomes(url_a)) and ("kept" in o or "discarded" in o) and o,
            timeout=20,
            what="A's decision about the session of its failed first turn",
        )
        assert not served.done()  # B's turn was in flight, unwritten, when A decided
        assert outcomes.get("discarded", 0) == 0, outcomes
        assert served.result().status_code == 200, served.result().text
    survivor = fleet.sessions()["shared-7"]
    assert survivor["metadata"]["uid"] == created["metadata"]["uid"]
    assert survivor["metadata"]["annotations"]["sessionfleet.dev/served-by"] == "rb"
    # SIGTERM: B writes its turn's usage (if it has not yet), into the session that survived.
    assert router_b.stop() == 0
    status = fleet.sessions()["shared-7"]["status"]
    assert status["turns"] == 1 and "rb" in status["usageWrites"], status


def test_with_api_keys_only_the_owner_ends_or_steers_a_session(
    fleet: Fleet, tmp_path: Path
) -> None:
    """Issue 29, item 8: another client that knows the session id reaches a session of its own."""
    fleet.worker("w1")
    keys = tmp_path / "api-keys"
    keys.mkdir()
    (keys / "alice").write_text("key-alice\n")
    (keys / "mallory").write_text("key-mallory\n")
    url, _ = fleet.router("keys", f"--api-keys-dir={keys}")
    alice = {"Authorization": "Bearer key-alice"}
    answer = turn(url, opening("build"), "ci-run-9", **alice)
    assert answer.status_code == 200, answer.text
    owned = answer.headers["X-Sessionfleet-Session"]
    for extra in ({}, {"X-Session-Final": "true"}):
        answer = turn(url, opening("hijack"), "ci-run-9", x_api_key="key-mallory", **extra)
        assert answer.status_code == 200, answer.text
        assert answer.headers["X-Sessionfleet-Session"] != owned
    assert turn(url, opening("build"), "ci-run-9", x_api_key="nope").status_code == 401

    def by_owner() -> dict[str, dict[str, Any]] | None:
        sessions = {
            s["metadata"]["labels"]["sessionfleet.dev/owner"]: s
            for s in fleet.custom.list_namespaced_custom_object(
                GROUP, VERSION, fleet.namespace, "agentsessions"
            )["items"]
        }
        mallorys = sessions.get("mallory", {})
        return sessions if mallorys.get("spec", {}).get("finished") else None

    sessions = wait_until(by_owner, timeout=20, what="mallory's own session finished")
    assert sessions["alice"]["metadata"]["name"] == owned
    assert not sessions["alice"]["spec"].get("finished")
    # Alice's session goes on, on its worker; the final marker is hers to send.
    answer = turn(url, opening("build"), "ci-run-9", **alice, x_session_final="true")
    assert answer.status_code == 200 and answer.headers["X-Sessionfleet-Session"] == owned
    wait_until(
        lambda: fleet.custom.get_namespaced_custom_object(
            GROUP, VERSION, fleet.namespace, "agentsessions", owned
        )["spec"].get("finished"),
        timeout=20,
        what="alice's session finished by alice",
    )
