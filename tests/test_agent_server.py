"""The agent's HTTP endpoints and the operator's criu driver talking to them, in-process.

CUDA and CRIU are stand-ins (no GPU here); HTTP is real on 127.0.0.1, and so is a
stand-in API server for the driver's pod lookup.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from criu_fakes import FakeCriu, FakeCuda, FakeEngine, Killer

from sessionfleet.agent.server import Agent, AgentSettings, CapabilityCache, build_app, pod_names
from sessionfleet.agent.telemetry import PodName, Snapshot
from sessionfleet.api import EngineType
from sessionfleet.checkpoint.capability import Capability
from sessionfleet.checkpoint.criu import (
    CriuDriver,
    NodeCheckpointer,
    container_id_of,
    node_address_locator,
)
from sessionfleet.checkpoint.driver import CheckpointTarget, DriverError, DriverUnavailable
from sessionfleet.kube import Kube, KubeConfig

TOKEN = "s3cret"
UID = "0b0c1c8e-3b1a-4c7e-9d1e-7f1e2d3c4b5a"
CID = "a" * 64
GPU = "GPU-5ab8c1d2-0b6f-2a3e-9f11-0123456789ab"
CAPABLE = Capability(ok=True, driver_version="580.65.06", can_remap_gpus=True)
INCAPABLE = Capability(
    ok=False,
    reasons=("no NVIDIA driver (NVML: NVML Shared Library Not Found)", "criu is not installed"),
)


@dataclass
class Node:
    """One agent with stand-in GPU parts, served on 127.0.0.1."""

    url: str
    agent: Agent
    cuda: FakeCuda
    criu: FakeCriu
    engine: FakeEngine
    killer: Killer
    capability: list[Capability]
    looked_up: list[tuple[str, str]] = field(default_factory=list)


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    cuda, engine, killer = FakeCuda(), FakeEngine(), Killer()
    criu = FakeCriu(cuda)
    capability = [CAPABLE]
    looked_up: list[tuple[str, str]] = []

    async def current() -> Capability:
        return capability[0]

    def find_pid(uid: str, container: str) -> int:
        looked_up.append((uid, container))
        if uid != UID:
            raise LookupError(f"no process of pod {uid} on this node")
        return 4242

    checkpointer = NodeCheckpointer(
        node="gpu-1",
        capability=current,
        make_cuda=lambda: cuda,
        criu=criu,
        engine_for=lambda endpoint: engine,
        find_pid=find_pid,
        gpus_of=lambda pid: [GPU],
        kill=killer,
    )
    settings = AgentSettings(node="gpu-1", token=TOKEN, capability_ttl=0)
    agent = Agent(settings, capability=current, checkpointer=checkpointer)
    server = TestServer(build_app(agent), host="127.0.0.1")
    await server.start_server()
    yield Node(
        str(server.make_url("")).rstrip("/"),
        agent,
        cuda,
        criu,
        engine,
        killer,
        capability,
        looked_up,
    )
    await server.close()
    await agent.http.aclose()


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10) as client:
        yield client


def body(images: Path, **extra: Any) -> dict[str, Any]:
    return {
        "imagesDir": str(images),
        "endpoint": "http://10.0.0.5:8000",
        "podUID": UID,
        "containerID": f"containerd://{CID}",
        **extra,
    }


def auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_a_checkpoint_through_the_endpoint(
    node: Node, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    answer = await http.post(f"{node.url}/checkpoint", json=body(tmp_path / "c1"), headers=auth())
    assert answer.status_code == 200, answer.text
    run = answer.json()
    assert (run["phase"], run["ok"], run["pid"], run["gpus"]) == ("Resumed", True, 4242, [GPU])
    assert [s["action"] for s in run["steps"]] == [
        "PauseEngine",
        "Lock",
        "CheckpointGpu",
        "Dump",
        "RestoreGpu",
        "Unlock",
        "ResumeEngine",
    ]
    assert node.looked_up == [(UID, f"containerd://{CID}")]
    assert node.agent.state.operations == {("checkpoint", "Resumed"): 1}

    restored = await http.post(
        f"{node.url}/restore",
        json={"imagesDir": str(tmp_path / "c1"), "endpoint": "http://10.0.0.9:8000"},
        headers=auth(),
    )
    assert restored.status_code == 200, restored.text
    assert restored.json()["pid"] == 777


async def test_a_failed_checkpoint_is_a_500_with_the_record(
    node: Node, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    node.criu.fail["dump"] = "criu dump exited 1"
    answer = await http.post(f"{node.url}/checkpoint", json=body(tmp_path), headers=auth())
    assert answer.status_code == 500
    assert answer.json()["phase"] == "Failed"
    assert answer.json()["error"] == "Dump failed: criu dump exited 1"


@pytest.mark.parametrize(
    ("headers", "payload", "status", "words"),
    [
        ({}, None, 401, "bearer token"),
        ({"Authorization": "Bearer wrong"}, None, 401, "bearer token"),
        (auth(), "not json", 400, "JSON object"),
        (auth(), [1, 2], 400, "JSON object"),
        (auth(), {"podUID": None}, 400, "podUID and containerID"),
        (auth(), {"imagesDir": "relative"}, 400, "absolute path"),
        (auth(), {"podUID": "other"}, 404, "no process of pod other"),
    ],
)
async def test_requests_are_checked(
    node: Node,
    http: httpx.AsyncClient,
    tmp_path: Path,
    headers: dict[str, str],
    payload: Any,
    status: int,
    words: str,
) -> None:
    if payload is None:
        content = None
        json_body: Any = body(tmp_path)
    elif isinstance(payload, str):
        content, json_body = payload.encode(), None
    elif isinstance(payload, dict):
        content, json_body = None, {**body(tmp_path), **payload}
    else:
        content, json_body = None, payload
    answer = await http.post(
        f"{node.url}/checkpoint", json=json_body, content=content, headers=headers
    )
    assert answer.status_code == status, answer.text
    assert words in answer.json()["error"]
    assert node.cuda.calls == [] and node.engine.calls == []


async def test_a_node_that_cannot_checkpoint_answers_503_with_reasons(
    node: Node, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    node.capability[0] = INCAPABLE
    answer = await http.post(f"{node.url}/checkpoint", json=body(tmp_path), headers=auth())
    assert answer.status_code == 503
    assert answer.json()["reasons"] == list(INCAPABLE.reasons)
    capability = (await http.get(f"{node.url}/capability")).json()
    assert capability["ok"] is False and capability["node"] == "gpu-1"
    assert capability["reasons"] == list(INCAPABLE.reasons)


async def test_without_a_token_the_endpoints_are_disabled(
    http: httpx.AsyncClient, tmp_path: Path
) -> None:
    async def current() -> Capability:
        return CAPABLE

    agent = Agent(AgentSettings(node="n"), capability=current)
    server = TestServer(build_app(agent), host="127.0.0.1")
    await server.start_server()
    try:
        answer = await http.post(str(server.make_url("/checkpoint")), json=body(tmp_path))
        assert answer.status_code == 503
        assert "--token-file" in answer.json()["error"]
    finally:
        await server.close()
        await agent.http.aclose()


async def test_the_capability_cache_probes_once_per_ttl() -> None:
    probes: list[int] = []
    now = [0.0]

    async def probe() -> Capability:
        probes.append(1)
        return CAPABLE

    cache = CapabilityCache(probe, ttl=60, clock=lambda: now[0])
    await cache.get()
    await cache.get()
    now[0] = 30
    await cache.get()
    assert len(probes) == 1
    now[0] = 61
    await cache.get()
    await cache.get(refresh=True)
    assert len(probes) == 3


def test_pod_names_and_container_ids_from_api_objects() -> None:
    items = [
        {"metadata": {"uid": UID, "namespace": "agents", "name": "w-1"}},
        {"metadata": {"name": "no-uid"}},
    ]
    names = pod_names(items)
    assert list(names) == [UID] and names[UID].name == "w-1"
    pod = {"status": {"containerStatuses": [{"name": "engine", "containerID": "cri-o://x"}]}}
    assert container_id_of(pod, "engine") == "cri-o://x"
    assert container_id_of(pod, "sidecar") == ""


# --- the operator's driver ----------------------------------------------------------


@pytest.fixture
async def kube() -> AsyncIterator[Kube]:
    """A stand-in API server that knows one pod."""

    async def get_pod(request: web.Request) -> web.Response:
        if request.match_info["name"] != "w-1":
            return web.json_response(
                {"kind": "Status", "message": "pods not found", "code": 404}, status=404
            )
        return web.json_response(
            {
                "metadata": {"name": "w-1", "namespace": "agents", "uid": UID},
                "status": {
                    "containerStatuses": [{"name": "engine", "containerID": f"containerd://{CID}"}]
                },
            }
        )

    async def list_pods(request: web.Request) -> web.Response:
        node_name = request.query.get("fieldSelector", "").removeprefix("spec.nodeName=")
        items = [{"metadata": {"name": "w-1", "namespace": "agents", "uid": UID}}]
        return web.json_response(
            {"items": items if node_name == "gpu-1" else [], "metadata": {"resourceVersion": "7"}}
        )

    async def get_node(request: web.Request) -> web.Response:
        addresses = [
            {"type": "Hostname", "address": "gpu-1"},
            {
                "type": "InternalIP",
                "address": "10.1.2.3" if request.match_info["name"] == "gpu-1" else "fd00::7",
            },
        ]
        if request.match_info["name"] == "bare":
            addresses = []
        return web.json_response({"status": {"addresses": addresses}})

    app = web.Application()
    app.router.add_get("/api/v1/namespaces/{namespace}/pods/{name}", get_pod)
    app.router.add_get("/api/v1/pods", list_pods)
    app.router.add_get("/api/v1/nodes/{name}", get_node)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    client = Kube(KubeConfig(server=str(server.make_url("")).rstrip("/")))
    yield client
    await client.aclose()
    await server.close()


def target(tmp_path: Path, **changes: Any) -> CheckpointTarget:
    fields: dict[str, Any] = {
        "namespace": "agents",
        "worker": "w",
        "epoch": 1,
        "engine": EngineType.VLLM,
        "endpoint": "http://10.0.0.5:8000",
        "location": str(tmp_path / "c1"),
        "pod": "w-1",
        "node": "gpu-1",
    }
    return CheckpointTarget(**{**fields, **changes})


def driver(http: httpx.AsyncClient, kube: Kube, url: str, token: str = TOKEN) -> CriuDriver:
    async def locate(node_name: str) -> str:
        assert node_name == "gpu-1"
        return url

    return CriuDriver(http, kube, locate=locate, token=token)


async def test_the_driver_checkpoints_and_restores_through_the_agent(
    node: Node, http: httpx.AsyncClient, kube: Kube, tmp_path: Path
) -> None:
    criu = driver(http, kube, node.url)
    outcome = await criu.save(target(tmp_path))
    assert outcome.location == str(tmp_path / "c1") and outcome.size_bytes == 4196
    assert node.looked_up == [(UID, f"containerd://{CID}")]
    loaded = await criu.load(target(tmp_path))
    assert loaded.location == str(tmp_path / "c1")
    assert criu.restore_args(EngineType.VLLM, str(tmp_path)) == []


async def test_the_driver_maps_the_agents_answers(
    node: Node, http: httpx.AsyncClient, kube: Kube, tmp_path: Path
) -> None:
    node.capability[0] = INCAPABLE
    with pytest.raises(DriverUnavailable, match="node gpu-1: .*criu is not installed"):
        await driver(http, kube, node.url).save(target(tmp_path))
    node.capability[0] = CAPABLE
    with pytest.raises(DriverError, match="401"):
        await driver(http, kube, node.url, token="wrong").save(target(tmp_path))
    node.criu.fail["dump"] = "disk full"
    node.cuda.fail["restore"] = "CUDA_ERROR_OUT_OF_MEMORY"
    with pytest.raises(DriverError, match=r"\(Fatal\).*killed: recover with a cold start"):
        await driver(http, kube, node.url).save(target(tmp_path))
    assert node.killer.killed == [4242]
    with pytest.raises(DriverUnavailable, match="engine driver"):
        await driver(http, kube, node.url).save(target(tmp_path, sessions=("s1",)))
    with pytest.raises(DriverError, match="cannot read pod agents/w-2"):
        await driver(http, kube, node.url).save(target(tmp_path, pod="w-2"))
    with pytest.raises(DriverError, match="unreachable"):
        await driver(http, kube, "http://127.0.0.1:9").save(target(tmp_path))


async def test_agents_are_located_at_their_nodes_internal_ip(kube: Kube) -> None:
    locate = node_address_locator(kube, port=9401)
    assert await locate("gpu-1") == "http://10.1.2.3:9401"
    assert await locate("v6") == "http://[fd00::7]:9401"
    with pytest.raises(DriverError, match="no InternalIP"):
        await locate("bare")


async def test_the_agent_names_its_nodes_pods(kube: Kube) -> None:
    async def current() -> Capability:
        return INCAPABLE

    settings = AgentSettings(node="gpu-1", interval=0.05, pod_refresh=0.05)
    agent = Agent(
        settings, sampler=lambda: Snapshot(False, "no NVML"), capability=current, kube=kube
    )
    async with agent.running():
        for _ in range(100):
            if agent.state.names and agent.state.capable is not None:
                break
            await asyncio.sleep(0.02)
    assert agent.state.names[UID] == PodName("agents", "w-1")
    assert agent.state.capable is False
