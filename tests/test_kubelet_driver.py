"""The kubelet driver against a local HTTP server standing in for the API server's node proxy.

The stand-in answers as the API server and the kubelet behind it do: Status objects for
the API server's own refusals (RBAC, a missing node), plain text for the kubelet's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from sessionfleet.api import CheckpointDriver, EngineType
from sessionfleet.checkpoint.driver import CheckpointTarget, DriverError, DriverUnavailable
from sessionfleet.kube import Kube, KubeConfig
from sessionfleet.operator.drivers.kubelet import (
    LOAD_REFUSAL,
    KubeletDriver,
    archive_location,
    checkpoint_path,
    parse_answer,
)

ARCHIVE = "/var/lib/kubelet/checkpoints/checkpoint-w-1_agents-engine-2026-11-29T15:10:54Z.tar"
UNIMPLEMENTED = (
    "checkpointing of agents/w-1/engine failed (rpc error: code = Unimplemented desc = "
    "unknown method CheckpointContainer for service runtime.v1.RuntimeService)"
)


def status(code: int, reason: str, message: str, **details: Any) -> web.Response:
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
        **({"details": details} if details else {}),
    }
    return web.json_response(body, status=code)


class ApiServer:
    """Records requests; answers per node name."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    async def proxy(self, request: web.Request) -> web.Response:
        node = request.match_info["node"]
        self.seen.append(
            {
                "path": request.path,
                "query": dict(request.query),
                "auth": request.headers.get("Authorization"),
            }
        )
        if node == "good":
            return web.json_response({"items": [ARCHIVE]})
        if node == "gate-off":
            return web.Response(status=404, text="404 page not found\n")
        if node == "rbac":
            return status(
                403,
                "Forbidden",
                'nodes "rbac" is forbidden: User "system:serviceaccount:sf:operator" cannot '
                'create resource "nodes/proxy" in API group "" at the cluster scope',
                name="rbac",
                kind="nodes",
            )
        if node == "gone":
            return status(404, "NotFound", 'nodes "gone" not found', name="gone", kind="nodes")
        if node == "no-pod":
            return web.Response(status=404, text="pod does not exist\n")
        if node == "old-runtime":
            return web.Response(status=500, text=UNIMPLEMENTED)
        if node == "criu-fails":
            return web.Response(
                status=500, text="checkpointing of agents/w-1/engine failed (exit status 1)"
            )
        if node == "odd":
            return web.json_response({"items": []})
        return web.Response(status=418)


@pytest.fixture
async def api() -> AsyncIterator[tuple[ApiServer, Kube]]:
    server_state = ApiServer()
    app = web.Application()
    app.router.add_post(
        "/api/v1/nodes/{node}/proxy/checkpoint/{namespace}/{pod}/{container}", server_state.proxy
    )
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    kube = Kube(KubeConfig(server=str(server.make_url("")).rstrip("/"), token="t0ken"))
    yield server_state, kube
    await kube.aclose()
    await server.close()


def target(node: str | None = "good", **changes: Any) -> CheckpointTarget:
    fields: dict[str, Any] = {
        "namespace": "agents",
        "worker": "w",
        "epoch": 1,
        "engine": EngineType.VLLM,
        "endpoint": "http://10.0.0.5:8000",
        "location": "/checkpoints/agents/w/c1",
        "pod": "w-1",
        "node": node,
    }
    return CheckpointTarget(**{**fields, **changes})


async def test_a_checkpoint_returns_the_archive_on_its_node(
    api: tuple[ApiServer, Kube],
) -> None:
    server, kube = api
    driver = KubeletDriver(kube, timeout=120)
    assert driver.name is CheckpointDriver.KUBELET
    outcome = await driver.save(target())
    assert outcome.location == f"kubelet://good{ARCHIVE}"
    assert outcome.seconds >= 0
    assert server.seen == [
        {
            "path": "/api/v1/nodes/good/proxy/checkpoint/agents/w-1/engine",
            "query": {"timeout": "120"},
            "auth": "Bearer t0ken",
        }
    ]


@pytest.mark.parametrize(
    ("node", "kind", "words"),
    [
        ("gate-off", DriverUnavailable, "ContainerCheckpoint feature gate"),
        ("rbac", DriverUnavailable, "`create` on `nodes/proxy`"),
        ("old-runtime", DriverUnavailable, "CRI-O or containerd 2.x"),
        ("gone", DriverError, 'node gone not found: nodes "gone" not found'),
        ("no-pod", DriverError, "cannot checkpoint agents/w-1/engine: pod does not exist"),
        ("criu-fails", DriverError, "failed: 500: checkpointing of agents/w-1/engine failed"),
        ("odd", DriverError, "names no archive"),
    ],
)
async def test_errors_map_to_the_driver_tree(
    api: tuple[ApiServer, Kube], node: str, kind: type[DriverError], words: str
) -> None:
    _, kube = api
    with pytest.raises(DriverError) as caught:
        await KubeletDriver(kube).save(target(node))
    assert type(caught.value) is kind
    assert words in str(caught.value)


async def test_the_rbac_refusal_warns_what_nodes_proxy_grants(
    api: tuple[ApiServer, Kube],
) -> None:
    _, kube = api
    with pytest.raises(DriverUnavailable, match="exec included"):
        await KubeletDriver(kube).save(target("rbac"))


async def test_per_session_checkpoints_are_not_this_drivers(
    api: tuple[ApiServer, Kube],
) -> None:
    server, kube = api
    with pytest.raises(DriverUnavailable, match="engine driver"):
        await KubeletDriver(kube).save(target(sessions=("s1",)))
    with pytest.raises(DriverError, match="no scheduled pod"):
        await KubeletDriver(kube).save(target(None))
    assert server.seen == []


async def test_load_refuses_and_restore_args_add_nothing(api: tuple[ApiServer, Kube]) -> None:
    _, kube = api
    driver = KubeletDriver(kube)
    with pytest.raises(DriverUnavailable) as caught:
        await driver.load(target())
    assert str(caught.value) == LOAD_REFUSAL
    assert "OCI image built from the archive" in LOAD_REFUSAL
    assert driver.restore_args(EngineType.VLLM, "kubelet://good/x.tar") == []


def test_paths_and_answers() -> None:
    assert checkpoint_path("n/1", "ns", "p", "c") == "/api/v1/nodes/n%2F1/proxy/checkpoint/ns/p/c"
    assert archive_location("n1", "/a.tar") == "kubelet://n1/a.tar"
    assert parse_answer({"items": ["/a.tar", "/b.tar"]}) == "/a.tar"
    with pytest.raises(DriverError, match="relative"):
        parse_answer({"items": ["a.tar"]})
    with pytest.raises(DriverError, match="names no archive"):
        parse_answer({"items": "a.tar"})
