"""The node agent's HTTP server: telemetry on ``/metrics``, the ``criu`` driver's endpoint.

- ``GET /metrics``: GPU telemetry (:mod:`.telemetry`) in Prometheus text format;
- ``GET /capability``: whether this node can checkpoint GPU processes, and every reason
  it cannot (``?refresh=1`` probes again instead of answering from the cache);
- ``POST /checkpoint`` and ``POST /restore``: run the ``criu`` driver's state machine
  on a pod's engine process (:class:`sessionfleet.checkpoint.criu.NodeCheckpointer`).
  They need ``Authorization: Bearer <token>`` with the agent's ``--token-file``: they
  pause, lock and, after a fatal failure, kill other pods' processes. Without a token
  file they are disabled;
- ``GET /healthz``.

Answers to the POST endpoints: 200 with the run's record when it succeeded; 500 with
the record when it failed (``phase`` ``Failed``: undone, the engine serves as before;
``Fatal``: the process was killed); 503 with ``reasons`` when the node cannot
checkpoint; 400 for a malformed request; 401 without the token; 404 when the pod's
process or the checkpoint is not on this node; 409 while the same process is busy.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from sessionfleet.agent.cgroups import PodRef, find_container_pid, pod_of_cgroup
from sessionfleet.agent.telemetry import (
    AgentCollector,
    AgentState,
    NvmlSampler,
    PodName,
    Snapshot,
)
from sessionfleet.checkpoint.capability import Capability, detect
from sessionfleet.checkpoint.criu import (
    Busy,
    CheckpointRequest,
    CriuCli,
    CudaControl,
    HttpEngine,
    NodeCheckpointer,
    RestoreRequest,
    Run,
)
from sessionfleet.checkpoint.cuda import LIBCUDA, CudaCheckpointApi
from sessionfleet.checkpoint.driver import DriverUnavailable
from sessionfleet.kube import PODS, Kube, KubeError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AgentSettings:
    """How the agent runs."""

    node: str
    host: str = "0.0.0.0"
    port: int = 9400
    interval: float = 10.0
    """Seconds between GPU samples."""
    capability_ttl: float = 300.0
    """Seconds a capability probe is reused (``criu check`` takes a while)."""
    token: str | None = None
    """The shared secret the checkpoint endpoints require; ``None`` disables them."""
    proc: Path = Path("/proc")
    criu: str = "criu"
    libcuda: str = LIBCUDA
    pod_refresh: float = 60.0
    """Seconds between reads of this node's pods, for the namespace and name labels."""


class CapabilityCache:
    """Probes the node at most once per ``ttl`` seconds, one probe at a time."""

    def __init__(
        self,
        probe: Callable[[], Awaitable[Capability]],
        ttl: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.probe = probe
        self.ttl = ttl
        self.clock = clock
        self._value: Capability | None = None
        self._at = 0.0
        self._lock = asyncio.Lock()

    async def get(self, refresh: bool = False) -> Capability:
        """Return the cached capability, probing when it is stale or asked to."""
        async with self._lock:
            stale = self._value is None or self.clock() - self._at > self.ttl
            if refresh or stale:
                self._value = await self.probe()
                self._at = self.clock()
            assert self._value is not None
            return self._value


class Agent:
    """The agent's parts and background loops."""

    def __init__(
        self,
        settings: AgentSettings,
        *,
        sampler: Callable[[], Snapshot] | None = None,
        capability: Callable[[], Awaitable[Capability]] | None = None,
        checkpointer: NodeCheckpointer | None = None,
        kube: Kube | None = None,
    ) -> None:
        # The agent owns ``kube`` from here on and closes it when it stops.
        self.settings = settings
        self.state = AgentState(node=settings.node)
        self.nvml = NvmlSampler()
        self.sample = sampler or self.nvml.sample
        self.capabilities = CapabilityCache(
            capability or (lambda: detect(settings.criu, settings.libcuda)),
            settings.capability_ttl,
        )
        self.kube = kube
        self.http = httpx.AsyncClient(timeout=30.0)
        self.checkpointer = checkpointer or NodeCheckpointer(
            node=settings.node,
            capability=self.capabilities.get,
            make_cuda=self._make_cuda,
            criu=CriuCli(settings.criu),
            engine_for=lambda endpoint: HttpEngine(self.http, endpoint),
            find_pid=lambda uid, container: find_container_pid(uid, container, settings.proc),
            gpus_of=self.nvml.gpus_of,
        )
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(AgentCollector(self.state))

    def _make_cuda(self) -> CudaControl:
        return CudaCheckpointApi(self.settings.libcuda)

    async def sample_once(self) -> None:
        """Sample the GPUs and map their processes to pods."""
        snapshot = await asyncio.to_thread(self.sample)
        pids = {p.pid for p in snapshot.processes}
        pods = await asyncio.to_thread(self._pods_of, pids)
        self.state.snapshot, self.state.pods = snapshot, pods

    def _pods_of(self, pids: set[int]) -> dict[int, PodRef]:
        found = {}
        for pid in pids:
            try:
                pod = pod_of_cgroup((self.settings.proc / str(pid) / "cgroup").read_text())
            except OSError:
                continue  # ended since NVML listed it
            if pod is not None:
                found[pid] = pod
        return found

    async def _sampling(self) -> None:
        while True:
            try:
                await self.sample_once()
            except Exception:  # a sampling bug must not stop the server or the loop
                log.exception("GPU sampling failed")
            await asyncio.sleep(self.settings.interval)

    async def _capability(self) -> None:
        # Probe once at start so /metrics says early whether the node can checkpoint.
        while True:
            capability = await self.capabilities.get()
            if self.state.capable is None:
                log.info("%s", capability.explain())
            self.state.capable = capability.ok
            await asyncio.sleep(self.settings.capability_ttl)

    async def _pod_names(self) -> None:
        assert self.kube is not None
        said = False
        while True:
            try:
                items, _ = await self.kube.list(
                    PODS, field_selector=f"spec.nodeName={self.settings.node}"
                )
                self.state.names = pod_names(items)
                said = False
            except KubeError as error:
                if not said:
                    log.warning("cannot list this node's pods for labels: %s", error)
                    said = True
            await asyncio.sleep(self.settings.pod_refresh)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Run the background loops for the duration of the block."""
        loops = [self._sampling(), self._capability()]
        if self.kube is not None:
            loops.append(self._pod_names())
        tasks = [asyncio.create_task(loop) for loop in loops]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.http.aclose()
            if self.kube is not None:
                await self.kube.aclose()

    def count(self, run: Run) -> None:
        """Count a finished run for the operations metric."""
        key = (run.operation.value, run.phase.value)
        self.state.operations[key] = self.state.operations.get(key, 0) + 1


def pod_names(items: list[dict[str, Any]]) -> dict[str, PodName]:
    """Return pod UID → namespace and name from a pod list's items."""
    names = {}
    for item in items:
        meta = item.get("metadata") or {}
        if meta.get("uid"):
            names[str(meta["uid"])] = PodName(str(meta.get("namespace", "")), str(meta["name"]))
    return names


AGENT_KEY = web.AppKey("agent", Agent)


def _agent(request: web.Request) -> Agent:
    return request.app[AGENT_KEY]


async def _healthz(_: web.Request) -> web.Response:
    return web.Response(text="ok\n")


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(_agent(request).registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _capability(request: web.Request) -> web.Response:
    agent = _agent(request)
    capability = await agent.capabilities.get(refresh=request.query.get("refresh") == "1")
    agent.state.capable = capability.ok
    return web.json_response({"node": agent.settings.node, **capability.to_json()})


def _error(status: int, message: str, **extra: Any) -> web.Response:
    return web.json_response({"error": message, **extra}, status=status)


async def _guarded(
    request: web.Request, work: Callable[[dict[str, Any]], Awaitable[Run]]
) -> web.Response:
    """Authenticate, check capability, parse, run; map every outcome to a status."""
    agent = _agent(request)
    token = agent.settings.token
    if token is None:
        return _error(503, "checkpoint endpoints are disabled: start the agent with --token-file")
    offered = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
    if not hmac.compare_digest(offered.encode(), token.encode()):
        return _error(401, "a valid bearer token is required")
    capability = await agent.capabilities.get()
    if not capability.ok:
        return _error(503, capability.explain(), reasons=list(capability.reasons))
    try:
        body = await request.json()
    except ValueError:
        return _error(400, "the body must be a JSON object")
    if not isinstance(body, dict):
        return _error(400, "the body must be a JSON object")
    try:
        run = await work(body)
    except DriverUnavailable as error:
        return _error(503, str(error), reasons=[str(error)])
    except Busy as error:
        return _error(409, str(error))
    except LookupError as error:
        return _error(404, str(error).strip("'\""))
    except ValueError as error:
        return _error(400, str(error))
    agent.count(run)
    return web.json_response(run.to_json(), status=200 if run.ok else 500)


async def _checkpoint(request: web.Request) -> web.Response:
    checkpointer = _agent(request).checkpointer

    async def work(body: dict[str, Any]) -> Run:
        return await checkpointer.checkpoint(CheckpointRequest.from_json(body))

    return await _guarded(request, work)


async def _restore(request: web.Request) -> web.Response:
    checkpointer = _agent(request).checkpointer

    async def work(body: dict[str, Any]) -> Run:
        return await checkpointer.restore(RestoreRequest.from_json(body))

    return await _guarded(request, work)


def build_app(agent: Agent) -> web.Application:
    """Return the agent's aiohttp application."""
    app = web.Application(client_max_size=1 << 20)
    app[AGENT_KEY] = agent
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/capability", _capability)
    app.router.add_post("/checkpoint", _checkpoint)
    app.router.add_post("/restore", _restore)
    return app


async def serve(agent: Agent, stop: asyncio.Event | None = None) -> None:
    """Serve until ``stop`` is set (or the task is cancelled)."""
    settings = agent.settings
    stop = stop or asyncio.Event()
    runner = web.AppRunner(build_app(agent), access_log=None)
    await runner.setup()
    try:
        async with agent.running():
            site = web.TCPSite(runner, settings.host, settings.port, reuse_address=True)
            await site.start()
            log.info(
                "node agent for %s serving on http://%s:%d (checkpoint endpoints %s)",
                settings.node,
                settings.host,
                settings.port,
                "enabled" if settings.token else "disabled: no --token-file",
            )
            await stop.wait()
    finally:
        await runner.cleanup()


__all__ = [
    "AGENT_KEY",
    "Agent",
    "AgentSettings",
    "CapabilityCache",
    "build_app",
    "pod_names",
    "serve",
]
