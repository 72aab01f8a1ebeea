"""``sessionfleet epp`` on the real control plane, with the GAIE CRDs and real engines.

The InferencePool CRD is the Gateway API Inference Extension's own (the release pinned
in ``e2e/tools/gaie/go.mod``, copied from its Go module by ``e2e/build-tools.sh``). No
gateway runs here: :class:`tests.epp_client.Envoy` plays Envoy's ext_proc filter against
a real ``sessionfleet epp`` process, sends each turn to the engine the EPP named (a
simulated engine behind a backed pod, ``ip:port``) over HTTP, and feeds the engine's
real response back to the EPP, so the endpoint served and the usage are real.
"""

from __future__ import annotations

import asyncio
import json
import re
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.helpers import Kubectl, wait_established, wait_until
from e2e.localcluster import LocalCluster, find_tools
from e2e.operator import (
    SESSIONFLEET,
    Custom,
    OperatorProcess,
    Process,
    bound_to,
    drain_policy,
    free_port,
    on_own_nodes,
    ready_workers,
    sim_worker,
    wait_for,
    worker_pods,
)
from sessionfleet.resources.names import session_object_name
from tests.epp_client import (
    MODES,
    Envoy,
    Turn,
    Upstream,
    destination_of,
    immediate_of,
    request_body,
    request_headers,
    tls_channel,
)

pytestmark = pytest.mark.timeout(240)

POOL_GROUP, POOL_VERSION, POOLS = "inference.networking.k8s.io", "v1", "inferencepools"
EPP_SERVICE = "sessionfleet-epp"
EPP_REPLICA = "epp-e2e"
SYSTEM = "You are a coding agent working in a large repository. " * 40
HOP_BY_HOP = {"connection", "transfer-encoding", "keep-alive"}


# --- the GAIE CRDs and an InferencePool ------------------------------------------------


@pytest.fixture(scope="session")
def gaie_crds(kubectl: Kubectl) -> str:
    """GAIE's CRDs from the pinned release, applied and Established; returns the version."""
    crds = find_tools().gaie_crds_dir
    # Server-side and forced: every xdist worker applies the same objects.
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crds))
    wait_established(kubectl, f"{POOLS}.{POOL_GROUP}")
    return (crds / "VERSION").read_text().strip()


def inference_pool(name: str, port: int, **spec: Any) -> dict[str, Any]:
    """An InferencePool over the workers' pods of model m, picked by the EPP's Service."""
    return {
        "apiVersion": f"{POOL_GROUP}/{POOL_VERSION}",
        "kind": "InferencePool",
        "metadata": {"name": name},
        "spec": {
            "selector": {
                "matchLabels": {
                    "app.kubernetes.io/managed-by": "sessionfleet",
                    "sessionfleet.dev/model": "m",
                }
            },
            "targetPorts": [{"number": port}],
            "endpointPickerRef": {
                "name": EPP_SERVICE,
                "port": {"number": 9002},
                "failureMode": "FailClose",
            },
            **spec,
        },
    }


def create_pool(api: Any, core: Any, namespace: str, engine_port: int) -> dict[str, Any]:
    """The EPP's Service (it routes nowhere here) and an InferencePool pointing at it."""
    core.create_namespaced_service(
        namespace,
        {
            "metadata": {"name": EPP_SERVICE},
            "spec": {
                "selector": {"app.kubernetes.io/name": "sessionfleet-epp"},
                "ports": [{"name": "grpc", "port": 9002, "appProtocol": "http2"}],
            },
        },
    )
    custom = client.CustomObjectsApi(api)
    pool = custom.create_namespaced_custom_object(
        POOL_GROUP, POOL_VERSION, namespace, POOLS, inference_pool("agents", engine_port)
    )
    # The real CRD's schema is enforced: a pool without targetPorts is refused.
    broken = inference_pool("broken", engine_port)
    del broken["spec"]["targetPorts"]
    with pytest.raises(ApiException) as refused:
        custom.create_namespaced_custom_object(POOL_GROUP, POOL_VERSION, namespace, POOLS, broken)
    assert refused.value.status == 422 and "targetPorts" in str(refused.value.body)
    return pool  # type: ignore[no-any-return]


# --- the EPP process --------------------------------------------------------------------


def health(port: int, service: str, *, tls: bool = True) -> int:
    """The gRPC health status of one service of the EPP (over TLS, or its plaintext port)."""
    if tls:
        certificate = ssl.get_server_certificate(("127.0.0.1", port)).encode()
        secure = grpc.ssl_channel_credentials(root_certificates=certificate)
        channel = grpc.secure_channel(f"127.0.0.1:{port}", secure)
    else:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        return int(reply.status)


@pytest.fixture
def epp(cluster: LocalCluster, namespace: str, tmp_path: Path) -> Iterator[int]:
    """``sessionfleet epp`` for the namespace, once its readiness is SERVING; its port."""
    yield from run_epp(cluster, namespace, tmp_path)


def run_epp(cluster: LocalCluster, namespace: str, tmp_path: Path, *extra: str) -> Iterator[int]:
    """Run ``sessionfleet epp`` with ``extra`` flags until the test ends; yield its port.

    It serves TLS with the certificate it makes at start (the default); readiness is read
    from its plaintext health port, as Kubernetes' probes read it.
    """
    port, health_port = free_port(), free_port()
    process = Process(
        [
            str(SESSIONFLEET),
            "epp",
            "--host=127.0.0.1",
            f"--port={port}",
            f"--health-port={health_port}",
            "--metrics-port=0",
            f"--namespace={namespace}",
            f"--kubeconfig={cluster.kubeconfig}",
            f"--replica={EPP_REPLICA}",
            "--flush-interval=1",
            "--retry-after=2",
            *extra,
        ],
        tmp_path / "epp.log",
    )

    def ready() -> bool:
        if process.popen.poll() is not None:
            raise AssertionError(f"the EPP exited:\n{process.log_tail()}")
        try:
            ready = health(health_port, "readiness", tls=False)
            return ready == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    try:
        wait_until(ready, timeout=30, what="the EPP's gRPC readiness")
        yield port
    finally:
        assert process.stop() == 0, process.log_tail()


# --- turns through the EPP to the engines ----------------------------------------------


async def forward(endpoint: str, headers: dict[str, str], body: bytes) -> Upstream:
    """Send the request to ``ip:port`` as Envoy would, keeping the response's chunks."""
    async with (
        httpx.AsyncClient(timeout=30) as http,
        http.stream(
            "POST", f"http://{endpoint}/v1/chat/completions", headers=headers, content=body
        ) as response,
    ):
        chunks = [chunk async for chunk in response.aiter_raw()]
        kept = {k: v for k, v in response.headers.items() if k.lower() not in HOP_BY_HOP}
        return Upstream(response.status_code, kept, chunks)


class Agent:
    """One agent session talking through the EPP; its history grows with each turn."""

    def __init__(self, envoy: Envoy, session_id: str) -> None:
        self.envoy = envoy
        self.session_id = session_id
        self.history = [{"role": "system", "content": SYSTEM}]

    async def turn(
        self, text: str, *, mode: int = MODES.FULL_DUPLEX_STREAMED, **kwargs: Any
    ) -> Turn:
        messages = [*self.history, {"role": "user", "content": text}]
        stream = mode == MODES.FULL_DUPLEX_STREAMED
        body: dict[str, Any] = {"model": "m", "messages": messages, "max_tokens": 8}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        turn = await self.envoy.turn(
            {"x-session-id": self.session_id},
            json.dumps(body).encode(),
            forward,
            mode=mode,
            **kwargs,
        )
        if turn.upstream is not None:
            assert turn.upstream.status == 200, turn.body
            self.history += [{"role": "user", "content": text}, reply_of(turn, stream)]
        return turn


def reply_of(turn: Turn, stream: bool) -> dict[str, str]:
    if not stream:
        return dict(turn.json["choices"][0]["message"])
    text = ""
    for line in turn.body.decode().splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices") or ():
                text += (choice.get("delta") or {}).get("content") or ""
    return {"role": "assistant", "content": text}


def endpoints(crs: Custom) -> dict[str, str]:
    """Each worker's engine as the protocol names endpoints: ``ip:port``."""
    return {
        w["metadata"]["name"]: w["status"]["endpoint"].removeprefix("http://")
        for w in crs.list("inferenceworkers")
    }


def src_and_dst(
    crs: Custom, namespace: str, own_nodes: list[str], operator: OperatorProcess
) -> dict[str, str]:
    """Two Ready simulated workers, src and dst, one on each own node; their endpoints."""
    crs.create(on_own_nodes(sim_worker("src"), namespace, own_nodes[0]))
    crs.create(on_own_nodes(sim_worker("dst"), namespace, own_nodes[1]))
    ready_workers(crs, 2, operator)
    return endpoints(crs)


def checkpointed_worker(name: str, storage: Path) -> dict[str, Any]:
    return sim_worker(name, checkpoint={"driver": "engine", "storage": {"path": str(storage)}})


def bound_where_named(
    turn: Turn, where: dict[str, str], session_id: str, crs: Custom, operator: OperatorProcess
) -> None:
    """The new session's turn named one endpoint, and the session is Bound to its worker."""
    assert len(turn.destination) == 1 and turn.destination[0] in where.values()
    chosen = {v: k for k, v in where.items()}[turn.destination[0]]
    wait_for(
        operator,
        lambda: bound_to(crs).get(session_object_name(session_id)) == chosen,
        timeout=30,
        what=f"{session_id} Bound to the worker the EPP named",
    )


def held(turn: Turn) -> None:
    """The EPP answered the turn itself: 503 session_held, with Retry-After."""
    assert turn.immediate is not None, turn.destination
    status, headers, body = turn.immediate
    assert (status, body["error"]["code"]) == (503, "session_held"), turn.immediate
    assert headers["retry-after"] == "2" and headers["x-sessionfleet-reason"] == "session_held"


async def poll(check: Any, *, timeout: float, what: str, operator: OperatorProcess) -> None:
    """``wait_for`` off the event loop, so the EPP's streams held open keep going."""
    await asyncio.to_thread(wait_for, operator, check, timeout=timeout, what=what)


# --- the tests --------------------------------------------------------------------------


async def test_the_epp_routes_places_and_accounts_sessions_in_both_body_modes(
    gaie_crds: str,
    operator: OperatorProcess,
    crs: Custom,
    api: Any,
    core: Any,
    namespace: str,
    own_nodes: list[str],
    epp: int,
) -> None:
    assert gaie_crds.startswith("v1.")
    where = src_and_dst(crs, namespace, own_nodes, operator)
    port = int(where["src"].rsplit(":", 1)[1])
    pool = create_pool(api, core, namespace, port)
    assert pool["spec"]["endpointPickerRef"]["kind"] == "Service"  # the CRD's default
    selector = ",".join(f"{k}={v}" for k, v in pool["spec"]["selector"]["matchLabels"].items())
    pods = core.list_namespaced_pod(namespace, label_selector=selector).items
    assert sorted(f"{p.status.pod_ip}:{port}" for p in pods) == sorted(where.values())

    serving = health_pb2.HealthCheckResponse.SERVING
    for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        assert health(epp, service) == serving

    async with await tls_channel(epp) as channel:
        envoy = Envoy(channel)
        # A hint naming only dst's endpoint: the new session is placed there.
        agent = Agent(envoy, "agent-1")
        first = await agent.turn("start", subset=[where["dst"]])
        assert first.destination == [where["dst"]]
        assert first.mutations["x-sessionfleet-session-id"] == "agent-1"
        name = session_object_name("agent-1")
        wait_for(
            operator,
            lambda: crs.status("agentsessions", name).get("phase") == "Bound",
            timeout=30,
            what="the new session recorded and Bound",
        )
        recorded = crs.get("agentsessions", name)
        assert recorded["spec"]["workerHint"] == "dst"
        assert recorded["status"]["worker"] == "dst"

        # Every turn of the session picks its worker, whatever the body mode; the
        # engine's prefix cache shows the turns really landed on one engine.
        for step, mode in enumerate([MODES.FULL_DUPLEX_STREAMED, MODES.BUFFERED] * 2):
            turn = await agent.turn(f"step {step}", mode=mode)
            assert turn.destination == [where["dst"]], (step, mode)
        usage = turn.json["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] > 0.8 * usage["prompt_tokens"]

        # A hint that leaves out the session's worker: 503, never another worker.
        outside = await agent.turn("elsewhere?", subset=[where["src"]])
        assert outside.immediate is not None and outside.immediate[0] == 503
        assert outside.immediate[2]["error"]["code"] == "no_ready_worker"
        # An empty hint: 503.
        empty = await agent.turn("nowhere", subset=[])
        assert empty.immediate is not None and empty.immediate[0] == 503

        # A second new session without a hint: placed by the placement function, one
        # endpoint (no fallbacks by default).
        other = Agent(envoy, "agent-2")
        placed = await other.turn("hello", mode=MODES.BUFFERED)
        bound_where_named(placed, where, "agent-2", crs, operator)

    # Usage from the response bodies reaches the session's status (5 turns served).
    wait_for(
        operator,
        lambda: crs.status("agentsessions", name).get("turns") == 5,
        timeout=15,
        what="5 turns in agent-1's status",
    )
    status = crs.status("agentsessions", name)
    assert status["promptTokens"] >= 5 * usage["prompt_tokens"] // 2
    assert status["cachedTokens"] > 0


async def buffered_decision(channel: Any, headers: dict[str, str], body: bytes) -> Any:
    """One BUFFERED request's headers and whole body (one message); the EPP's body answer."""
    call = pb_grpc.ExternalProcessorStub(channel).Process()
    await call.write(request_headers(headers, mode=MODES.BUFFERED))
    assert (await asyncio.wait_for(call.read(), 10)).WhichOneof("response") == "request_headers"
    await call.write(request_body(body, True))
    answer = await asyncio.wait_for(call.read(), 10)
    call.cancel()
    return answer


def chat_of_size(size: int) -> bytes:
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "x" * size}]}
    ).encode()


async def test_the_epp_serves_tls_an_unannounced_gateway_and_bodies_up_to_its_limit(
    gaie_crds: str,
    operator: OperatorProcess,
    crs: Custom,
    namespace: str,
    own_nodes: list[str],
    epp: int,
) -> None:
    """As kgateway connects (TLS) and as Envoy before 1.34 streams (no protocol_config)."""
    where = src_and_dst(crs, namespace, own_nodes, operator)
    assert health(epp, "readiness") == health_pb2.HealthCheckResponse.SERVING  # over TLS
    async with await tls_channel(epp) as channel:
        envoy = Envoy(channel)
        # BUFFERED without protocol_config: the gateway waits for the headers answer;
        # the EPP decides there after its mode probe, and names one endpoint.
        agent = Agent(envoy, "old-envoy")
        first = await agent.turn("start", mode=MODES.BUFFERED, announce=False)
        bound_where_named(first, where, "old-envoy", crs, operator)
        again = await agent.turn("again", mode=MODES.BUFFERED, announce=False)
        assert again.destination == first.destination

        # 5 MiB in one BUFFERED message, past grpc.aio's default 4 MiB: decided.
        session = {"x-session-id": "old-envoy"}
        answer = await buffered_decision(channel, session, chat_of_size(5 << 20))
        assert answer.WhichOneof("response") == "request_body"
        assert destination_of(answer)[0] == first.destination[0]
        # Past the 8 MiB limit: the EPP's own 413, not a gRPC stream error.
        answer = await buffered_decision(channel, session, chat_of_size(9 << 20))
        status, _, error = immediate_of(answer)
        assert (status, error["error"]["code"]) == (413, "body_too_large")


async def test_the_epp_holds_a_session_while_it_migrates_and_while_its_worker_restores(
    gaie_crds: str,
    operator: OperatorProcess,
    crs: Custom,
    api: Any,
    core: Any,
    namespace: str,
    own_nodes: list[str],
    kubectl: Kubectl,
    epp: int,
    tmp_path: Path,
) -> None:
    crs.create(drain_policy("move", mode="Migrate", deadline="5m"))
    crs.create(on_own_nodes(checkpointed_worker("src", tmp_path), namespace, own_nodes[0]))
    crs.create(on_own_nodes(checkpointed_worker("dst", tmp_path), namespace, own_nodes[1]))
    ready_workers(crs, 2, operator)
    where = endpoints(crs)
    create_pool(api, core, namespace, int(where["src"].rsplit(":", 1)[1]))
    name = session_object_name("agent")
    coordination = client.CoordinationV1Api(api)
    # The EPP takes part in the turn-boundary handshake as a router replica does: it
    # holds one of its slot Leases (epp-0 … by default), as itself.
    epp_leases = lambda: [  # noqa: E731
        lease
        for lease in coordination.list_namespaced_lease(namespace).items
        if lease.spec.holder_identity == EPP_REPLICA
    ]
    wait_until(epp_leases, timeout=15, what="the EPP's Lease")
    (slot,) = epp_leases()
    assert re.fullmatch(r"epp-[0-9]+", slot.metadata.name), slot.metadata.name
    assert slot.metadata.labels["sessionfleet.dev/component"] == "router"

    async with await tls_channel(epp) as channel:
        agent = Agent(Envoy(channel, timeout=30), "agent")
        first = await agent.turn("start", subset=[where["src"]])
        assert first.destination == [where["src"]]
        await poll(
            lambda: bound_to(crs) == {name: "src"},
            timeout=30,
            what="bound to src",
            operator=operator,
        )
        for step in range(3):
            assert (await agent.turn(f"step {step}")).destination == [where["src"]]

        # A turn in flight through the EPP when the drain starts: the EPP does not
        # acknowledge until it ends, so the session stays on src meanwhile.
        release = asyncio.Event()
        decided = asyncio.Event()

        async def slow(endpoint: str, headers: dict[str, str], body: bytes) -> Upstream:
            decided.set()
            await release.wait()
            return await forward(endpoint, headers, body)

        envoy = agent.envoy
        body = json.dumps({"model": "m", "messages": agent.history, "max_tokens": 8}).encode()
        in_flight = asyncio.ensure_future(
            envoy.turn({"x-session-id": "agent"}, body, slow, mode=MODES.BUFFERED)
        )
        await asyncio.wait_for(decided.wait(), 10)
        kubectl("cordon", own_nodes[0])
        await poll(
            lambda: crs.status("agentsessions", name).get("phase") == "Migrating",
            timeout=30,
            what="the session Migrating",
            operator=operator,
        )
        held(await agent.turn("while Migrating"))
        await asyncio.sleep(3)
        annotations = crs.get("agentsessions", name)["metadata"].get("annotations") or {}
        assert f"ack.sessionfleet.dev/{EPP_REPLICA}" not in annotations
        assert bound_to(crs) == {name: "src"}, "no move while the EPP has a turn in flight"
        held(await agent.turn("still Migrating"))

        release.set()
        finished = await asyncio.wait_for(in_flight, 30)
        assert finished.destination == [where["src"]] and finished.upstream is not None
        await poll(
            lambda: bound_to(crs) == {name: "dst"},
            timeout=60,
            what="the session moved once the EPP acknowledged",
            operator=operator,
        )
        annotations = crs.get("agentsessions", name)["metadata"].get("annotations") or {}
        assert f"ack.sessionfleet.dev/{EPP_REPLICA}" in annotations
        moved = await agent.turn("on dst now")
        assert moved.destination == [where["dst"]]
        usage = json.loads(moved.body.decode().split("data: ")[-2])["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] > 0.5 * usage["prompt_tokens"]

        # dst's pod goes away while its node takes no new pod: the session is Restoring
        # and the EPP answers 503 session_held at once (docs/epp.md, "Held sessions").
        epoch = crs.status("inferenceworkers", "dst")["epoch"]
        hold = {"key": "e2e.sessionfleet.dev/hold", "value": "x", "effect": "NoSchedule"}
        node = core.read_node(own_nodes[1])
        taints = core.api_client.sanitize_for_serialization(node.spec.taints or [])
        core.patch_node(own_nodes[1], {"spec": {"taints": [*taints, hold]}})
        (pod,) = worker_pods(core, namespace, "dst")
        core.delete_namespaced_pod(pod.metadata.name, namespace, grace_period_seconds=0)
        await poll(
            lambda: crs.status("agentsessions", name).get("phase") == "Restoring",
            timeout=30,
            what="the session Restoring",
            operator=operator,
        )
        held(await agent.turn("while Restoring"))
        core.patch_node(own_nodes[1], {"spec": {"taints": taints}})
        await poll(
            lambda: (
                crs.status("agentsessions", name).get("phase") == "Bound"
                and crs.status("inferenceworkers", "dst").get("epoch", 0) > epoch
            ),
            timeout=60,
            what="dst's next epoch Ready and the session Bound again",
            operator=operator,
        )
        restored = endpoints(crs)["dst"]
        back = await agent.turn("after the restore")
        assert back.destination == [restored]


# --- behind real gateways: the pool, control headers, NGINX's half-close, GAIE metrics ----


@pytest.fixture
def pool_epp(cluster: LocalCluster, namespace: str, tmp_path: Path) -> Iterator[tuple[int, int]]:
    """``sessionfleet epp --pool-name=agents``; its gRPC and metrics ports."""
    metrics_port = free_port()
    flags = ("--pool-name=agents", f"--metrics-port={metrics_port}", "--fallbacks=0")
    for port in run_epp(cluster, namespace, tmp_path, *flags):
        yield port, metrics_port


def metric(port: int, line_start: str) -> float | None:
    """The value of the first sample of ``GET /metrics`` starting with ``line_start``."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return None


async def nginx_turn(channel: Any, headers: dict[str, str], body: bytes) -> tuple[str, list[Any]]:
    """One request as NGINX Gateway Fabric's shim sends it: no protocol_config, headers as
    ``value``, the whole body, half-close; it reads the answers to the end and takes the
    destination from the request_headers answer only."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    call = pb_grpc.ExternalProcessorStub(channel).Process()
    values = {":method": "POST", ":path": "/v1/chat/completions", **headers}
    header_map = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, value=v) for k, v in values.items()]
    )
    await call.write(pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=header_map)))
    await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
    await call.done_writing()
    answers = [answer async for answer in call]
    assert await call.code() == grpc.StatusCode.OK
    destination = ""
    for answer in answers:
        for option in answer.request_headers.response.header_mutation.set_headers:
            if option.header.key == "x-gateway-destination-endpoint":
                destination = option.header.raw_value.decode()
    return destination, answers


async def test_the_epp_serves_its_pool_strips_control_headers_and_takes_nginx_turns(
    gaie_crds: str,
    operator: OperatorProcess,
    crs: Custom,
    api: Any,
    core: Any,
    namespace: str,
    own_nodes: list[str],
    pool_epp: tuple[int, int],
) -> None:
    epp_port, metrics_port = pool_epp
    where = src_and_dst(crs, namespace, own_nodes, operator)
    port = int(where["dst"].rsplit(":", 1)[1])
    # A pool that selects only dst's pod, by the worker label the operator puts on it.
    pool = inference_pool("agents", port)
    pool["spec"]["selector"]["matchLabels"]["sessionfleet.dev/worker"] = "dst"
    custom = client.CustomObjectsApi(api)
    custom.create_namespaced_custom_object(POOL_GROUP, POOL_VERSION, namespace, POOLS, pool)
    wait_until(
        lambda: metric(metrics_port, 'inference_pool_ready_pods{name="agents"}') == 1.0,
        timeout=30,
        what="the EPP's pool of one ready pod",
    )
    mismatched = 'sessionfleet_epp_pool_mismatched_workers{reason="NotSelected"}'
    assert metric(metrics_port, mismatched) == 1.0  # src: reported, never named

    seen: list[dict[str, str]] = []

    async def recording(endpoint: str, headers: dict[str, str], body: bytes) -> Upstream:
        seen.append({k.lower(): v for k, v in headers.items()})
        return await forward(endpoint, headers, body)

    control = {
        "x-gateway-inference-objective": "premium",
        "x-gateway-inference-fairness-id": "tenant-a",
        "x-gateway-model-name-rewrite": "m",
    }
    async with await tls_channel(epp_port) as channel:
        envoy = Envoy(channel)
        # Envoy style: new sessions and a stateless request, only ever to the pool's pod.
        for n in range(3):
            body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            turn = await envoy.turn(
                {"x-session-id": f"pooled-{n}", **control}, body.encode(), recording
            )
            assert turn.destination == [where["dst"]], n
            assert turn.upstream is not None and turn.upstream.status == 200
        assert seen and all(not (set(control) & set(headers)) for headers in seen)
        wait_for(
            operator,
            lambda: bound_to(crs).get(session_object_name("pooled-0")) == "dst",
            timeout=30,
            what="pooled-0 Bound to dst",
        )

        # NGINX Gateway Fabric style: the destination comes in the request_headers answer
        # (no protocol_config: full duplex assumed), and the new session is recorded
        # although the response never passes through the stream.
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "yo"}]})
        destination, answers = await nginx_turn(channel, {"x-session-id": "nginx-1"}, body.encode())
        assert destination == where["dst"], answers
        wait_for(
            operator,
            lambda: bound_to(crs).get(session_object_name("nginx-1")) == "dst",
            timeout=30,
            what="the NGINX-style session recorded and Bound",
        )

        # The pool moves to another target port: the EPP names the pod there, and says
        # the engine does not listen on it.
        custom.patch_namespaced_custom_object(
            POOL_GROUP,
            POOL_VERSION,
            namespace,
            POOLS,
            "agents",
            {"spec": {"targetPorts": [{"number": port + 1}]}},
        )
        ip = where["dst"].rsplit(":", 1)[0]
        moved = f"{ip}:{port + 1}"

        async def named() -> str:
            destination, _ = await nginx_turn(channel, {}, body.encode())
            return destination

        for _ in range(100):
            if await named() == moved:
                break
            await asyncio.sleep(0.1)
        assert await named() == moved
        differs = 'sessionfleet_epp_pool_mismatched_workers{reason="PortDiffers"}'
        assert metric(metrics_port, differs) == 1.0

    labels = 'model_name="m",target_model_name="m"'
    assert (metric(metrics_port, f"inference_objective_request_total{{{labels}}}") or 0) >= 4
    assert metric(metrics_port, f"inference_objective_input_tokens_count{{{labels}}}") == 3.0
