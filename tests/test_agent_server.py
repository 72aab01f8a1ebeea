"""The agent's HTTP endpoints and the operator's criu driver talking to them, in-process.

CUDA and CRIU are stand-ins (no GPU here); HTTP is real on 127.0.0.1, and so is a
stand-in API server for the driver's pod lookup.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from criu_fakes import FakeCriu, FakeCuda, FakeEngine, Killer

from sessionfleet.agent.capability import Capability
from sessionfleet.agent.criu import NodeCheckpointer
from sessionfleet.agent.server import (
    MAX_BODY_BYTES,
    Agent,
    AgentSettings,
    CapabilityCache,
    build_app,
    parse_body,
    pod_names,
    serve,
    wants_refresh,
)
from sessionfleet.agent.telemetry import PodName, Snapshot
from sessionfleet.api import EngineType
from sessionfleet.api.worker import CheckpointStorage
from sessionfleet.checkpoint.agent_api import METADATA_FILE
from sessionfleet.checkpoint.driver import (
    CheckpointTarget,
    DriverError,
    DriverUnavailable,
    NotLeadingDriver,
)
from sessionfleet.checkpoint.paths import DEFAULT_STORAGE_ROOT, confined_parts, open_confined
from sessionfleet.kube import Kube, KubeConfig
from sessionfleet.operator.drivers.criu import CriuDriver, container_id_of, node_address_locator
from sessionfleet.policy.checkpoint import checkpoint_location
from sessionfleet.supervise import EXIT_TASK_FAILED

TOKEN = "s3cret"
NAMESPACE = "agents"
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
    root: Path
    """Namespace ``agents``'s tree in the agent's storage root (``root.parent``);
    ``root.parent.parent / "outside"`` is a directory beside the storage root."""
    looked_up: list[tuple[str, str]] = field(default_factory=list)
    probes: list[int] = field(default_factory=list)


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    cuda, engine, killer = FakeCuda(), FakeEngine(), Killer()
    criu = FakeCriu(cuda)
    capability = [CAPABLE]
    looked_up: list[tuple[str, str]] = []
    probes: list[int] = []
    storage = tmp_path / "storage"
    root = storage / NAMESPACE
    root.mkdir(parents=True)
    (tmp_path / "outside").mkdir()

    async def current() -> Capability:
        probes.append(1)
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
    settings = AgentSettings(node="gpu-1", token=TOKEN, capability_ttl=0, storage_root=storage)
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
        root,
        looked_up,
        probes,
    )
    await server.close()
    await agent.http.aclose()


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10) as client:
        yield client


def body(images: Path | str, **extra: Any) -> dict[str, Any]:
    return {
        "imagesDir": str(images),
        "namespace": NAMESPACE,
        "endpoint": "http://10.0.0.5:8000",
        "podUID": UID,
        "containerID": f"containerd://{CID}",
        **extra,
    }


def restore_body(images: Path | str, **extra: Any) -> dict[str, Any]:
    return {
        "imagesDir": str(images),
        "namespace": NAMESPACE,
        "endpoint": "http://10.0.0.9:8000",
        **extra,
    }


def auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_a_checkpoint_through_the_endpoint(node: Node, http: httpx.AsyncClient) -> None:
    images = node.root / "c1"
    answer = await http.post(f"{node.url}/checkpoint", json=body(images), headers=auth())
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
    assert (images / METADATA_FILE).is_file()

    restored = await http.post(
        f"{node.url}/restore",
        json=restore_body(images),
        headers=auth(),
    )
    assert restored.status_code == 200, restored.text
    assert restored.json()["pid"] == 777


async def test_a_failed_checkpoint_is_a_500_with_the_record(
    node: Node, http: httpx.AsyncClient
) -> None:
    node.criu.fail["dump"] = "criu dump exited 1"
    answer = await http.post(f"{node.url}/checkpoint", json=body(node.root / "c1"), headers=auth())
    assert answer.status_code == 500
    assert answer.json()["phase"] == "Failed"
    assert answer.json()["error"] == "Dump failed: criu dump exited 1"


def _untouched(node: Node) -> None:
    """Nothing was looked up, paused, locked or dumped."""
    assert node.looked_up == [] and node.cuda.calls == [] and node.engine.calls == []
    assert node.criu.dumps == [] and node.criu.restores == []


@pytest.mark.parametrize(
    ("headers", "payload", "status", "words"),
    [
        ({}, None, 401, "bearer token"),
        ({"Authorization": "Bearer wrong"}, None, 401, "bearer token"),
        (auth(), "not json", 400, "JSON object"),
        (auth(), [1, 2], 400, "JSON object"),
        (auth(), {"podUID": None}, 400, "podUID and containerID"),
        (auth(), {"imagesDir": "relative"}, 400, "absolute path"),
    ],
)
async def test_requests_are_checked(
    node: Node,
    http: httpx.AsyncClient,
    headers: dict[str, str],
    payload: Any,
    status: int,
    words: str,
) -> None:
    if payload is None:
        content = None
        json_body: Any = body(node.root / "c1")
    elif isinstance(payload, str):
        content, json_body = payload.encode(), None
    elif isinstance(payload, dict):
        content, json_body = None, {**body(node.root / "c1"), **payload}
    else:
        content, json_body = None, payload
    answer = await http.post(
        f"{node.url}/checkpoint", json=json_body, content=content, headers=headers
    )
    assert answer.status_code == status, answer.text
    assert words in answer.json()["error"]
    _untouched(node)


async def test_an_unknown_pod_is_a_404(node: Node, http: httpx.AsyncClient) -> None:
    other = "1b0c1c8e-3b1a-4c7e-9d1e-7f1e2d3c4b5a"
    answer = await http.post(
        f"{node.url}/checkpoint", json=body(node.root / "c1", podUID=other), headers=auth()
    )
    assert answer.status_code == 404
    assert answer.json()["error"] == f"no process of pod {other} on this node"
    assert node.cuda.calls == [] and node.engine.calls == []


# --- the token ------------------------------------------------------------------------

TOKEN_ENDPOINTS = [
    ("POST", "/checkpoint"),
    ("POST", "/restore"),
    ("GET", "/capability?refresh=1"),
    ("GET", "/capability"),
    ("GET", "/metrics"),
]
"""Every request that needs the token: it acts on processes, probes the node, says
which nodes can checkpoint, or names pods (the metrics' labels)."""


async def _call(
    http: httpx.AsyncClient,
    url: str,
    endpoint: tuple[str, str],
    images: Path,
    **headers: str | bytes,
) -> httpx.Response:
    method, path = endpoint
    payload = body(images) if method == "POST" else None
    return await http.request(method, f"{url}{path}", json=payload, headers=headers)


def test_every_mutating_route_is_one_that_needs_the_token(node: Node) -> None:
    mutating = {
        (route.method, route.resource.canonical)
        for route in build_app(node.agent).router.routes()
        if route.method not in ("GET", "HEAD") and route.resource is not None
    }
    assert mutating == {(m, p) for m, p in TOKEN_ENDPOINTS if m != "GET"}


@pytest.mark.parametrize("endpoint", TOKEN_ENDPOINTS, ids=lambda e: f"{e[0]} {e[1]}")
@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "",
        "Bearer",
        "Bearer wrong",
        f"Bearer {TOKEN}x",
        f"Bearer {TOKEN[:-1]}",
        TOKEN,  # without the scheme
        f"Basic {TOKEN}",
        f"Token {TOKEN}",
        "Bearer s3cr\u00e9t".encode(),  # not ASCII: bytes, as a client may send them
        b"Bearer \xff\xfe",  # not even UTF-8
    ],
    ids=lambda a: repr(a),
)
async def test_every_endpoint_that_needs_the_token_refuses_without_it(
    node: Node,
    http: httpx.AsyncClient,
    endpoint: tuple[str, str],
    authorization: str | bytes | None,
) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}
    probes = len(node.probes)
    answer = await _call(http, node.url, endpoint, node.root / "c1", **headers)
    assert answer.status_code == 401, answer.text
    assert answer.headers["WWW-Authenticate"] == "Bearer"
    assert answer.json() == {"error": "a valid bearer token is required"}
    assert len(node.probes) == probes, "a refused request must not probe the node"
    _untouched(node)


@pytest.mark.parametrize("endpoint", TOKEN_ENDPOINTS, ids=lambda e: f"{e[0]} {e[1]}")
async def test_the_token_opens_every_endpoint_that_needs_it(
    node: Node, http: httpx.AsyncClient, endpoint: tuple[str, str]
) -> None:
    images = node.root / "c1"
    await http.post(f"{node.url}/checkpoint", json=body(images), headers=auth())
    answer = await _call(http, node.url, endpoint, images, Authorization=f"bearer {TOKEN}")
    assert answer.status_code == 200, answer.text


@pytest.mark.parametrize("path", ["/healthz", "/readyz"])
async def test_only_the_probes_are_open(node: Node, http: httpx.AsyncClient, path: str) -> None:
    answer = await http.get(f"{node.url}{path}")
    assert answer.status_code == 200, answer.text


async def test_a_refresh_probes_again_and_a_plain_read_does_not(
    node: Node, http: httpx.AsyncClient
) -> None:
    node.agent.capabilities.ttl = 300
    await http.get(f"{node.url}/capability", headers=auth())
    probes = len(node.probes)
    assert (await http.get(f"{node.url}/capability", headers=auth())).is_success
    assert len(node.probes) == probes, "a plain GET answers from the cache"
    assert (await http.get(f"{node.url}/capability?refresh")).status_code == 401
    assert (await http.get(f"{node.url}/capability?refresh=1", headers=auth())).is_success
    assert len(node.probes) == probes + 1


@pytest.mark.parametrize(
    ("query", "refresh"),
    [({}, False), ({"refresh": "1"}, True), ({"refresh": ""}, True), ({"refresh": "0"}, False)],
)
def test_what_asks_for_a_refresh(query: dict[str, str], refresh: bool) -> None:
    assert wants_refresh(query) is refresh


@pytest.mark.parametrize("endpoint", TOKEN_ENDPOINTS, ids=lambda e: f"{e[0]} {e[1]}")
async def test_without_a_token_file_the_endpoints_are_disabled(
    http: httpx.AsyncClient, tmp_path: Path, endpoint: tuple[str, str]
) -> None:
    async def current() -> Capability:
        return CAPABLE

    agent = Agent(AgentSettings(node="n", storage_root=tmp_path), capability=current)
    server = TestServer(build_app(agent), host="127.0.0.1")
    await server.start_server()
    try:
        url = str(server.make_url("")).rstrip("/")
        answer = await _call(http, url, endpoint, tmp_path / "c1", **auth())
        if endpoint == ("GET", "/metrics"):
            # Telemetry alone (no criu driver, nobody to authenticate): open, and
            # docs/checkpoints.md asks for a NetworkPolicy.
            assert answer.status_code == 200
        else:
            assert answer.status_code == 503
            assert "--token-file" in answer.json()["error"]
    finally:
        await server.close()
        await agent.http.aclose()


# --- paths: confined to the storage root ------------------------------------------------

TRAVERSALS = [
    ("{root}/../outside/c1", "'..'"),
    ("{root}/c1/../../outside", "'..'"),
    ("{root}/./c1", "'.'"),
    ("{outside}/c1", "is not inside"),
    ("/etc/cron.d", "is not inside"),
    ("/", "is not inside"),
    ("{storage}", "is not inside"),  # the root itself
    ("{root}", "is not inside"),  # the namespace's tree itself: images inside it
    ("{root}-evil/c1", "is not inside"),  # a prefix, not a parent
    ("{storage}-evil/agents/c1", "is not inside"),  # the root's prefix, not the root
    ("{storage}/prod/agents/c1", "is not inside"),  # another namespace's tree
    ("{root}/escape/c1", "symbolic link"),  # escape -> outside: a symlink out of the root
    ("{root}/escape", "symbolic link"),
    ("{root}/%2e%2e/%2e%2e/etc", "printable ASCII"),
    ("{root}/..%2f..%2fetc", "printable ASCII"),
    ("{root}/..\\..\\etc", "printable ASCII"),
    ("{root}/\uff0e\uff0e/etc", "printable ASCII"),  # fullwidth dots
    ("{root}/c1\u0000/../../etc", "printable ASCII"),
    ("{root}/c1\n", "printable ASCII"),
    ("relative/c1", "absolute path"),
    ("", "absolute path"),
    ("{root}/" + "a" * 5000, "longer than 4096"),
]


@pytest.mark.parametrize("operation", ["/checkpoint", "/restore"])
@pytest.mark.parametrize(("template", "words"), TRAVERSALS, ids=[t for t, _ in TRAVERSALS])
async def test_paths_out_of_the_storage_root_are_refused(
    node: Node, http: httpx.AsyncClient, operation: str, template: str, words: str
) -> None:
    outside = node.root.parent.parent / "outside"
    (node.root / "escape").symlink_to(outside)
    images = template.format(root=node.root, storage=node.root.parent, outside=outside)
    answer = await http.post(f"{node.url}{operation}", json=body(images), headers=auth())
    assert answer.status_code == 400, answer.text
    assert words in answer.json()["error"]
    _untouched(node)
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("images", [7, None, ["/a"], {"path": "/a"}])
async def test_an_images_dir_that_is_not_a_string_is_refused(
    node: Node, http: httpx.AsyncClient, images: Any
) -> None:
    payload = {**body(node.root), "imagesDir": images}
    answer = await http.post(f"{node.url}/checkpoint", json=payload, headers=auth())
    assert answer.status_code == 400 and "absolute path" in answer.json()["error"]


# --- namespaces: one tree each under the one root ---------------------------------------


@pytest.mark.parametrize("operation", ["/checkpoint", "/restore"])
async def test_a_namespace_cannot_reach_into_another_namespaces_tree(
    node: Node, http: httpx.AsyncClient, operation: str
) -> None:
    """Namespace ``llama`` whose worker sets ``storage.path`` to ``<root>/prod`` gets the
    default location ``<root>/prod/llama/<worker>/<name>``: inside the agent's root, and
    inside namespace ``prod``'s tree. Refused: the first component below the root must be
    the namespace of the request."""
    storage = node.root.parent
    prod = storage / "prod" / "llama" / "w"
    prod.mkdir(parents=True)
    (prod / "c1").mkdir()
    (prod / "c1" / METADATA_FILE).write_text(json.dumps({"gpus": [GPU]}))
    images = prod / "c2" if operation == "/checkpoint" else prod / "c1"
    answer = await http.post(
        f"{node.url}{operation}", json=body(images, namespace="llama"), headers=auth()
    )
    assert answer.status_code == 400, answer.text
    assert f"is not inside {storage}/llama/" in answer.json()["error"]
    _untouched(node)
    assert not (prod / "c2").exists()


@pytest.mark.parametrize("namespace", [None, "", "Prod", "a/b", "..", "x" * 64, 7])
async def test_a_request_names_a_valid_namespace(
    node: Node, http: httpx.AsyncClient, namespace: Any
) -> None:
    payload = {**body(node.root / "c1"), "namespace": namespace}
    answer = await http.post(f"{node.url}/checkpoint", json=payload, headers=auth())
    assert answer.status_code == 400 and "namespace" in answer.json()["error"]
    _untouched(node)


def test_namespaces_are_compared_as_whole_components(tmp_path: Path) -> None:
    root = tmp_path / "root"
    assert confined_parts(f"{root}/llama/w/c", root, "llama") == ("llama", "w", "c")
    for images in (f"{root}/llama-2/w/c", f"{root}/llamas/c", f"{root}/prod/llama/c"):
        with pytest.raises(ValueError, match="is not inside"):
            confined_parts(images, root, "llama")
    with pytest.raises(ValueError, match="is not inside"):
        confined_parts(f"{root}2/llama/c", root, "llama")


# --- links: never followed below the root -----------------------------------------------


async def test_a_symlink_below_the_root_is_refused_even_when_it_stays_inside(
    node: Node, http: httpx.AsyncClient
) -> None:
    (node.root / "real").mkdir()
    (node.root / "alias").symlink_to(node.root / "real")
    answer = await http.post(
        f"{node.url}/checkpoint", json=body(node.root / "alias" / "c1"), headers=auth()
    )
    assert answer.status_code == 400, answer.text
    assert "symbolic link" in answer.json()["error"]
    assert not (node.root / "real" / "c1").exists()
    _untouched(node)


async def test_a_link_swapped_in_after_the_check_writes_nothing_outside(
    node: Node, http: httpx.AsyncClient
) -> None:
    """A pod sharing the storage replaces ``<ns>/w`` by a link to a directory outside the
    root after the agent checked the path (here: while the node's capability is read,
    which comes between the check and the dump). The old agent resolved the path once
    and then wrote by name, through the new link."""
    outside = node.root.parent.parent / "outside"
    (node.root / "w").mkdir()

    async def swap_then_capable() -> Capability:
        if (node.root / "w").is_dir() and not (node.root / "w").is_symlink():
            (node.root / "w").rename(node.root / "w-before")
            (node.root / "w").symlink_to(outside)
        return CAPABLE

    node.agent.capabilities.probe = swap_then_capable
    answer = await http.post(
        f"{node.url}/checkpoint", json=body(node.root / "w" / "c1"), headers=auth()
    )
    assert answer.status_code == 400, answer.text
    assert "symbolic link" in answer.json()["error"]
    assert list(outside.iterdir()) == []
    _untouched(node)


async def test_a_link_swapped_in_during_the_dump_writes_nothing_outside(
    node: Node, http: httpx.AsyncClient
) -> None:
    """The swap happens once the directory is open, while CRIU dumps: every later file
    operation (CRIU's images, the metadata) goes through the held directory."""
    outside = node.root.parent.parent / "outside"
    (node.root / "w").mkdir()

    async def swap() -> None:
        (node.root / "w").rename(node.root / "w-before")
        (node.root / "w").symlink_to(outside)

    node.criu.on_dump = swap
    answer = await http.post(
        f"{node.url}/checkpoint", json=body(node.root / "w" / "c1"), headers=auth()
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["imagesDir"] == str(node.root / "w" / "c1")
    assert list(outside.iterdir()) == []
    held = node.root / "w-before" / "c1"
    assert sorted(p.name for p in held.iterdir()) == sorted(
        ["pages-1.img", "core-1.img", METADATA_FILE]
    )


def test_a_root_behind_a_symlink_is_followed_as_configured(tmp_path: Path) -> None:
    real = tmp_path / "real-root"
    real.mkdir()
    (tmp_path / "root-link").symlink_to(real)
    with pytest.raises(ValueError, match="is not inside"):
        confined_parts(str(tmp_path / "elsewhere" / "ns" / "c1"), tmp_path / "root-link", "ns")
    for asked in (tmp_path / "root-link" / "ns" / "c1", real / "ns" / "c1"):
        with open_confined(str(asked), tmp_path / "root-link", "ns", create=True) as held:
            assert held.path == asked
    assert (real / "ns" / "c1").is_dir()
    assert (real / "ns" / "c1").stat().st_mode & 0o777 == 0o700, "only root writes images"


def test_a_missing_directory_is_a_lookup_error_without_create(tmp_path: Path) -> None:
    with pytest.raises(LookupError, match="does not exist"):
        open_confined(str(tmp_path / "ns" / "c1"), tmp_path, "ns", create=False)
    assert not (tmp_path / "ns").exists()


async def test_planted_metadata_links_are_neither_read_nor_written_through(
    node: Node, http: httpx.AsyncClient
) -> None:
    secret = node.root.parent.parent / "outside" / "secret.json"
    secret.write_text('{"gpus": ["GPU-00000000-0000-0000-0000-000000000000"]}')
    images = node.root / "planted"
    images.mkdir()
    (images / METADATA_FILE).symlink_to(secret)
    restored = await http.post(
        f"{node.url}/restore",
        json=restore_body(images),
        headers=auth(),
    )
    assert restored.status_code == 400 and "unreadable" in restored.json()["error"]
    assert node.criu.restores == []

    answer = await http.post(f"{node.url}/checkpoint", json=body(images), headers=auth())
    assert answer.status_code == 200, answer.text
    assert not (images / METADATA_FILE).is_symlink(), "the link is replaced, not followed"
    assert json.loads((images / METADATA_FILE).read_text())["gpus"] == [GPU]
    assert secret.read_text().startswith('{"gpus": ["GPU-0000')


# --- numbers, types and bodies ----------------------------------------------------------

BAD_CHECKPOINTS = [
    ({"lockTimeoutSeconds": 0}, "lockTimeoutSeconds"),
    ({"lockTimeoutSeconds": 0.0001}, "lockTimeoutSeconds"),
    ({"lockTimeoutSeconds": -1}, "lockTimeoutSeconds"),
    ({"lockTimeoutSeconds": 601}, "lockTimeoutSeconds"),
    ({"lockTimeoutSeconds": 10**30}, "lockTimeoutSeconds"),
    ({"lockTimeoutSeconds": True}, "lockTimeoutSeconds"),
    ({"lockTimeoutSeconds": "30"}, "lockTimeoutSeconds"),
    ({"lockTimeoutSeconds": None}, "lockTimeoutSeconds"),
    ({"leaveRunning": "no"}, "leaveRunning"),
    ({"leaveRunning": 0}, "leaveRunning"),
    ({"podUID": "../../etc"}, "podUID is not"),
    ({"podUID": 42}, "podUID and containerID"),
    ({"containerID": "containerd://abc"}, "containerID is not"),
    ({"containerID": "a" * 10_000}, "containerID is not"),
    ({"endpoint": "file:///etc/passwd"}, "endpoint"),
    ({"endpoint": "http://10.0.0.5:99999"}, "endpoint"),
    ({"endpoint": "http://"}, "endpoint"),
    ({"endpoint": "http://x/" + "a" * 3000}, "endpoint"),
    ({"endpoint": ["http://x"]}, "endpoint"),
]


@pytest.mark.parametrize(("change", "words"), BAD_CHECKPOINTS, ids=lambda v: repr(v)[:40])
async def test_checkpoint_fields_are_bounded_and_typed(
    node: Node, http: httpx.AsyncClient, change: dict[str, Any], words: str
) -> None:
    payload = {**body(node.root / "c1"), **change}
    answer = await http.post(f"{node.url}/checkpoint", json=payload, headers=auth())
    assert answer.status_code == 400, answer.text
    assert words in answer.json()["error"]
    _untouched(node)


BAD_RESTORES = [
    ({"gpus": "GPU-1"}, "gpus must be a list"),
    ({"gpus": [1]}, "gpus must be a list"),
    ({"gpus": [GPU] * 65}, "at most 64"),
    ({"gpus": ["GPU-C"]}, "not a GPU UUID"),
    ({"gpus": ["MIG-5ab8c1d2-0b6f-2a3e-9f11-0123456789ab"]}, "MIG"),
]


@pytest.mark.parametrize(("change", "words"), BAD_RESTORES, ids=lambda v: repr(v)[:40])
async def test_restore_fields_are_bounded_and_typed(
    node: Node, http: httpx.AsyncClient, change: dict[str, Any], words: str
) -> None:
    payload = {**restore_body(node.root / "c1"), **change}
    answer = await http.post(f"{node.url}/restore", json=payload, headers=auth())
    assert answer.status_code == 400, answer.text
    assert words in answer.json()["error"]
    _untouched(node)


RAW_BODIES = [
    (b"", "JSON object"),
    (b"not json", "JSON object"),
    (b"[1, 2]", "JSON object"),
    (b'"a string"', "JSON object"),
    (b"42", "JSON object"),
    (b"null", "JSON object"),
    (b'{"imagesDir": ', "JSON object"),
    (b"\xff\xfe{}", "JSON object"),  # not UTF-8
    (b'{"lockTimeoutSeconds": NaN}', "NaN is not a JSON number"),
    (b'{"lockTimeoutSeconds": Infinity}', "Infinity is not a JSON number"),
    (b"[" * 100_000, "larger than"),
    (b"[" * 50_000 + b"]" * 50_000, "larger than"),
    (b"[" * 30_000 + b"]" * 30_000, "nested too deeply"),
    (b'{"lockTimeoutSeconds": ' + b"9" * 5000 + b"}", "JSON object"),
]


@pytest.mark.parametrize(("raw", "words"), RAW_BODIES, ids=lambda v: repr(v)[:30])
async def test_malformed_bodies_are_refused(
    node: Node, http: httpx.AsyncClient, raw: bytes, words: str
) -> None:
    answer = await http.post(
        f"{node.url}/checkpoint",
        content=raw,
        headers={**auth(), "Content-Type": "application/json"},
    )
    assert answer.status_code == (413 if words == "larger than" else 400), answer.text
    assert words in answer.json()["error"]
    _untouched(node)


async def test_an_out_of_range_number_in_raw_json_is_refused(
    node: Node, http: httpx.AsyncClient
) -> None:
    text = json.dumps(body(node.root / "c1"))[:-1] + ', "lockTimeoutSeconds": 1e400}'
    answer = await http.post(f"{node.url}/checkpoint", content=text.encode(), headers=auth())
    assert answer.status_code == 400 and "lockTimeoutSeconds" in answer.json()["error"]


def test_parse_body() -> None:
    assert parse_body(b'{"a": 1}') == {"a": 1}
    for raw in (b"[]", b"NaN", b"{", b"[" * 100_000):
        with pytest.raises(ValueError):
            parse_body(raw)
    assert MAX_BODY_BYTES == 64 * 1024


# --- capability and supervision ---------------------------------------------------------


async def test_a_node_that_cannot_checkpoint_answers_503_with_reasons(
    node: Node, http: httpx.AsyncClient
) -> None:
    node.capability[0] = INCAPABLE
    answer = await http.post(f"{node.url}/checkpoint", json=body(node.root / "c1"), headers=auth())
    assert answer.status_code == 503
    assert answer.json()["reasons"] == list(INCAPABLE.reasons)
    capability = (await http.get(f"{node.url}/capability", headers=auth())).json()
    assert capability["ok"] is False and capability["node"] == "gpu-1"
    assert capability["reasons"] == list(INCAPABLE.reasons)


async def _broken_probe() -> Capability:
    raise RuntimeError("libcuda exploded")


def _failing_agent(port: int = 0) -> Agent:
    settings = AgentSettings(
        node="n", host="127.0.0.1", port=port, interval=0.05, capability_ttl=0.05
    )
    return Agent(settings, sampler=lambda: Snapshot(False, "no NVML"), capability=_broken_probe)


async def test_readyz_names_a_background_loop_that_died(http: httpx.AsyncClient) -> None:
    agent = _failing_agent()
    server = TestServer(build_app(agent), host="127.0.0.1")
    await server.start_server()
    try:
        async with agent.running() as supervisor:
            await asyncio.wait_for(supervisor.failed.wait(), 10)
            answer = await http.get(str(server.make_url("/readyz")))
            assert answer.status_code == 503
            assert answer.json()["task"] == "capability"
            assert "libcuda exploded" in answer.json()["error"]
            assert (await http.get(str(server.make_url("/healthz")))).status_code == 200
    finally:
        await server.close()


async def test_readyz_lists_the_running_loops(node: Node, http: httpx.AsyncClient) -> None:
    async with node.agent.running():
        answer = await http.get(f"{node.url}/readyz")
    assert answer.status_code == 200
    assert answer.json() == {"ready": True, "tasks": ["sampling", "capability"]}


async def test_serve_exits_non_zero_when_a_loop_dies(caplog: pytest.LogCaptureFixture) -> None:
    stop = asyncio.Event()
    code = await asyncio.wait_for(serve(_failing_agent(), stop), 10)
    assert code == EXIT_TASK_FAILED != 0
    assert "background task capability died: RuntimeError: libcuda exploded" in caplog.text
    assert not stop.is_set()


async def test_serve_exits_zero_when_stopped() -> None:
    async def fine() -> Capability:
        return CAPABLE

    stop = asyncio.Event()
    settings = AgentSettings(node="n", host="127.0.0.1", port=0, interval=0.05)
    agent = Agent(settings, sampler=lambda: Snapshot(False, "no NVML"), capability=fine)
    serving = asyncio.create_task(serve(agent, stop))
    await asyncio.sleep(0.2)
    assert agent.supervisor.healthy and agent.supervisor.names == ["sampling", "capability"]
    stop.set()
    assert await asyncio.wait_for(serving, 10) == 0


def test_the_command_exits_with_the_serve_loops_status(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from sessionfleet.agent import server
    from sessionfleet.agent.cli import run
    from sessionfleet.cli import build_parser

    async def died(agent: Agent, stop: asyncio.Event | None = None) -> int:
        await agent.http.aclose()
        return EXIT_TASK_FAILED

    monkeypatch.setattr(server, "serve", died)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    args = build_parser().parse_args(["agent", "--node-name=n", f"--storage-root={tmp_path}"])
    assert run(args) == EXIT_TASK_FAILED


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


def driver(
    http: httpx.AsyncClient, kube: Kube, url: str, token: str = TOKEN, **kw: Any
) -> CriuDriver:
    async def locate(node_name: str) -> str:
        assert node_name == "gpu-1"
        return url

    return CriuDriver(http, kube, locate=locate, token=token, **kw)


async def test_the_driver_checkpoints_and_restores_through_the_agent(
    node: Node, http: httpx.AsyncClient, kube: Kube
) -> None:
    criu = driver(http, kube, node.url)
    outcome = await criu.save(target(node.root))
    assert outcome.location == str(node.root / "c1") and outcome.size_bytes == 4196
    assert node.looked_up == [(UID, f"containerd://{CID}")]
    loaded = await criu.load(target(node.root))
    assert loaded.location == str(node.root / "c1")
    assert criu.restore_args(EngineType.VLLM, str(node.root)) == []


async def test_a_deposed_operator_never_reaches_the_agent(
    node: Node, http: httpx.AsyncClient, kube: Kube
) -> None:
    """The gate is asked before each call: once closed, no process is paused or dumped."""
    leading = [True]
    criu = driver(http, kube, node.url, write_gate=lambda: leading[0])
    await criu.save(target(node.root))
    calls = list(node.cuda.calls)
    leading[0] = False
    for call in (criu.save, criu.load):
        with pytest.raises(NotLeadingDriver, match="not the leader"):
            await call(target(node.root, location=str(node.root / "c2")))
    assert node.cuda.calls == calls
    assert not (node.root / "c2").exists()


async def test_the_operators_default_locations_are_inside_the_agents_default_root() -> None:
    location = checkpoint_location(
        CheckpointStorage().path, "agents", "w", "w-manual-1", destination=None
    )
    assert confined_parts(location, DEFAULT_STORAGE_ROOT, "agents") == ("agents", "w", "w-manual-1")


async def test_the_driver_reports_a_location_outside_the_agents_root(
    node: Node, http: httpx.AsyncClient, kube: Kube, tmp_path: Path
) -> None:
    with pytest.raises(DriverError, match=r"failed \(400\): imagesDir .* storage root"):
        await driver(http, kube, node.url).save(target(tmp_path / "outside"))
    assert node.cuda.calls == []


async def test_the_driver_maps_the_agents_answers(
    node: Node, http: httpx.AsyncClient, kube: Kube
) -> None:
    node.capability[0] = INCAPABLE
    with pytest.raises(DriverUnavailable, match="node gpu-1: .*criu is not installed"):
        await driver(http, kube, node.url).save(target(node.root))
    node.capability[0] = CAPABLE
    with pytest.raises(DriverError, match="401"):
        await driver(http, kube, node.url, token="wrong").save(target(node.root))
    node.criu.fail["dump"] = "disk full"
    node.cuda.fail["restore"] = "CUDA_ERROR_OUT_OF_MEMORY"
    with pytest.raises(DriverError, match=r"\(Fatal\).*killed: recover with a cold start"):
        await driver(http, kube, node.url).save(target(node.root))
    assert node.killer.killed == [4242]
    with pytest.raises(DriverUnavailable, match="engine driver"):
        await driver(http, kube, node.url).save(target(node.root, sessions=("s1",)))
    with pytest.raises(DriverError, match="cannot read pod agents/w-2"):
        await driver(http, kube, node.url).save(target(node.root, pod="w-2"))
    with pytest.raises(DriverError, match="unreachable"):
        await driver(http, kube, "http://127.0.0.1:9").save(target(node.root))


async def test_agents_are_located_at_their_nodes_internal_ip(kube: Kube) -> None:
    locate = node_address_locator(kube, port=9401)
    assert await locate("gpu-1") == "https://10.1.2.3:9401"
    assert await locate("v6") == "https://[fd00::7]:9401"
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
