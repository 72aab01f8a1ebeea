"""The node agent's HTTPS server: telemetry on ``/metrics``, the ``criu`` driver's endpoint.

- ``GET /metrics``: GPU telemetry (:mod:`.telemetry`) in Prometheus text format; its
  labels name pods, so it needs a caller the agent trusts (the operator, or a
  ``--metrics-reader``) whenever the agent authenticates at all;
- ``GET /capability``: whether this node can checkpoint GPU processes, and every reason
  it cannot, from a cache; ``?refresh=1`` probes again (``criu check`` and more). The
  operator's only: it tells an attacker which nodes can act on processes;
- ``POST /checkpoint`` and ``POST /restore``: run the ``criu`` driver's state machine
  on a pod's engine process (:class:`sessionfleet.agent.criu.NodeCheckpointer`).
  The operator's only: they pause, lock and, after a fatal failure, kill other pods'
  processes. The images directory of a request must lie strictly inside
  ``<storage root>/<namespace>/`` and is opened without following any link below the
  root (:func:`sessionfleet.checkpoint.paths.open_confined`);
- ``GET /healthz``: the process answers; ``GET /readyz``: and every background loop
  (sampling, capability, pod names) still runs: a loop that died makes it 503, naming
  the loop, and the process exits non-zero (:mod:`sessionfleet.supervise`).

Callers present ``Authorization: Bearer <token>``: a token of the operator's
ServiceAccount for this node's audience, checked with a TokenReview, or the static
``--token-file`` (:mod:`.auth`); without either the endpoints that need one answer 503.

Answers to the POST endpoints: 200 with the run's record when it succeeded; 500 with
the record when it failed (``phase`` ``Failed``: undone, the engine serves as before;
``Fatal``: the process was killed); 503 with ``reasons`` when the node cannot
checkpoint; 400 for a malformed request (not a JSON object, a wrong type, a number out
of bounds, a path outside the storage root); 401 without the token; 404 when the pod's
process or the checkpoint is not on this node; 409 while the same process is busy; 413
for a body over :data:`MAX_BODY_BYTES`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import httpx
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from sessionfleet.agent.auth import (
    TOKEN_REQUIRED,
    Access,
    Authenticator,
    StaticToken,
    TokenReviewer,
)
from sessionfleet.agent.capability import Capability, detect
from sessionfleet.agent.cgroups import PodRef, find_container_pid, pod_of_cgroup
from sessionfleet.agent.criu import (
    Busy,
    CheckpointRequest,
    CriuCli,
    CudaControl,
    HttpEngine,
    NodeCheckpointer,
    RestoreRequest,
    Run,
)
from sessionfleet.agent.cuda import LIBCUDA, CudaCheckpointApi
from sessionfleet.agent.telemetry import (
    AgentCollector,
    AgentState,
    NvmlSampler,
    PodName,
    Snapshot,
)
from sessionfleet.agent.tls import server_context
from sessionfleet.checkpoint.driver import DriverUnavailable
from sessionfleet.checkpoint.paths import DEFAULT_STORAGE_ROOT, confined_parts, open_confined
from sessionfleet.kube import PODS, Kube, KubeError
from sessionfleet.supervise import EXIT_TASK_FAILED, Supervisor

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
    """The static shared secret (``--token-file``), when the agent cannot review tokens."""
    operators: frozenset[str] = frozenset()
    """User names whose tokens for this node may operate (``--operator``): TokenReview."""
    metrics_readers: frozenset[str] = frozenset()
    """User names whose ordinary ServiceAccount tokens may read ``/metrics``."""
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    """A certificate and key (a mounted Secret); neither: a self-signed one made at start."""
    plain_http: bool = False
    """Serve without TLS (a loopback test only: the token would travel in clear text)."""
    addresses: tuple[str, ...] = ()
    """This node's addresses, named in a self-signed certificate."""
    storage_root: Path = DEFAULT_STORAGE_ROOT
    """The only directory tree checkpoint images are written to and restored from."""
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
        authenticator: Authenticator | None = None,
    ) -> None:
        # The agent owns ``kube`` from here on and closes it when it stops.
        self.settings = settings
        self.authenticator = authenticator or authenticator_for(settings, kube)
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
        self.supervisor = Supervisor(log)

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
    async def running(self) -> AsyncIterator[Supervisor]:
        """Run the background loops, supervised, for the duration of the block."""
        try:
            async with self.supervisor:
                self.supervisor.start("sampling", self._sampling())
                self.supervisor.start("capability", self._capability())
                if self.kube is not None:
                    self.supervisor.start("pod-names", self._pod_names())
                yield self.supervisor
        finally:
            await self.http.aclose()
            if self.kube is not None:
                await self.kube.aclose()

    def count(self, run: Run) -> None:
        """Count a finished run for the operations metric."""
        key = (run.operation.value, run.phase.value)
        self.state.operations[key] = self.state.operations.get(key, 0) + 1


def authenticator_for(settings: AgentSettings, kube: Kube | None) -> Authenticator | None:
    """Return how the agent authenticates callers; ``None``: nobody may operate."""
    if settings.operators:
        if kube is None:
            raise ValueError(
                "--operator needs access to the API server for TokenReviews "
                "(in-cluster, or --kubeconfig)"
            )
        return TokenReviewer(kube, settings.node, settings.operators, settings.metrics_readers)
    if settings.token:
        return StaticToken(settings.token)
    return None


def pod_names(items: list[dict[str, Any]]) -> dict[str, PodName]:
    """Return pod UID → namespace and name from a pod list's items."""
    names = {}
    for item in items:
        meta = item.get("metadata") or {}
        if meta.get("uid"):
            names[str(meta["uid"])] = PodName(str(meta.get("namespace", "")), str(meta["name"]))
    return names


AGENT_KEY = web.AppKey("agent", Agent)
MAX_BODY_BYTES = 64 << 10
"""The largest request body read: a checkpoint or restore request is a few hundred bytes."""

_Request = TypeVar("_Request", CheckpointRequest, RestoreRequest)


def _agent(request: web.Request) -> Agent:
    return request.app[AGENT_KEY]


def _error(status: int, message: str, **extra: Any) -> web.Response:
    return web.json_response({"error": message, **extra}, status=status)


async def _refused(request: web.Request, access: Access = Access.OPERATE) -> web.Response | None:
    """Return the answer to a caller without ``access``, or ``None`` when it has it."""
    authenticator = _agent(request).authenticator
    if authenticator is None:
        return _error(
            503, "this endpoint is disabled: start the agent with --operator or --token-file"
        )
    scheme, _, offered = request.headers.get("Authorization", "").partition(" ")
    reason = (
        TOKEN_REQUIRED
        if scheme.lower() != "bearer"
        else await authenticator.refusal(offered.strip(), access)
    )
    if reason is not None:
        log.info("refused %s %s: %s", request.method, request.path, reason)
        return web.json_response(
            {"error": reason if reason == TOKEN_REQUIRED else f"{TOKEN_REQUIRED}: {reason}"},
            status=401,
            headers={"WWW-Authenticate": "Bearer"},
        )
    return None


async def _healthz(_: web.Request) -> web.Response:
    return web.Response(text="ok\n")


async def _readyz(request: web.Request) -> web.Response:
    supervisor = _agent(request).supervisor
    if supervisor.failure is not None:
        return _error(503, str(supervisor.failure), task=supervisor.failure.task)
    return web.json_response({"ready": True, "tasks": supervisor.names})


async def _metrics(request: web.Request) -> web.Response:
    # Open only on an agent that authenticates nobody (telemetry alone, no criu driver):
    # docs/checkpoints.md asks for a NetworkPolicy there.
    if _agent(request).authenticator is not None and (
        refused := await _refused(request, Access.READ_METRICS)
    ):
        return refused
    body = generate_latest(_agent(request).registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def wants_refresh(query: Mapping[str, str]) -> bool:
    """Whether ``GET /capability`` asks for a new probe: ``?refresh``, unless ``0`` or ``false``."""
    return "refresh" in query and query["refresh"].lower() not in ("0", "false")


async def _capability(request: web.Request) -> web.Response:
    agent = _agent(request)
    refresh = wants_refresh(request.query)
    # Which nodes can pause, dump and kill processes is the operator's to know; a probe
    # runs `criu check` and loads libcuda.
    if (refused := await _refused(request)) is not None:
        return refused
    capability = await agent.capabilities.get(refresh=refresh)
    agent.state.capable = capability.ok
    return web.json_response({"node": agent.settings.node, **capability.to_json()})


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_body(raw: bytes) -> dict[str, Any]:
    """Return a request body's JSON object; :class:`ValueError` says what is wrong."""
    try:
        body = json.loads(raw, parse_constant=_no_constants)
    except RecursionError:
        raise ValueError("the body is nested too deeply") from None
    except ValueError as error:  # not JSON, not UTF-8, NaN, an integer of 5,000 digits
        raise ValueError(f"the body must be a JSON object: {error}") from None
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    return body


async def _guarded(
    request: web.Request,
    parse: Callable[[Mapping[str, Any]], _Request],
    work: Callable[[_Request], Awaitable[Run]],
) -> web.Response:
    """Authenticate, parse, confine, check capability, run; map every outcome to a status."""
    agent = _agent(request)
    if (refused := await _refused(request)) is not None:
        return refused
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return _error(413, f"the body is larger than {MAX_BODY_BYTES} bytes")
    root = agent.settings.storage_root
    try:
        parsed = parse(parse_body(raw))
        confined_parts(str(parsed.images_dir), root, parsed.namespace)
    except ValueError as error:
        return _error(400, str(error))
    capability = await agent.capabilities.get()
    if not capability.ok:
        return _error(503, capability.explain(), reasons=list(capability.reasons))
    try:
        # Opened once, component by component without following links; the run then
        # names the directory only through the held descriptor.
        held = await asyncio.to_thread(
            open_confined,
            str(parsed.images_dir),
            root,
            parsed.namespace,
            create=isinstance(parsed, CheckpointRequest),
        )
    except ValueError as error:
        return _error(400, str(error))
    except LookupError as error:
        return _error(404, str(error).strip("'\""))
    try:
        run = await work(replace(parsed, images_dir=held.handle))
    except DriverUnavailable as error:
        return _error(503, str(error), reasons=[str(error)])
    except Busy as error:
        return _error(409, str(error))
    except LookupError as error:
        return _error(404, str(error).strip("'\"").replace(str(held.handle), str(held.path)))
    except ValueError as error:
        return _error(400, str(error).replace(str(held.handle), str(held.path)))
    finally:
        held.close()
    run.images = held.path
    run.error = run.error.replace(str(held.handle), str(held.path))
    agent.count(run)
    return web.json_response(run.to_json(), status=200 if run.ok else 500)


async def _checkpoint(request: web.Request) -> web.Response:
    checkpointer = _agent(request).checkpointer
    return await _guarded(request, CheckpointRequest.from_json, checkpointer.checkpoint)


async def _restore(request: web.Request) -> web.Response:
    checkpointer = _agent(request).checkpointer
    return await _guarded(request, RestoreRequest.from_json, checkpointer.restore)


def build_app(agent: Agent) -> web.Application:
    """Return the agent's aiohttp application."""
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[AGENT_KEY] = agent
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/capability", _capability)
    app.router.add_post("/checkpoint", _checkpoint)
    app.router.add_post("/restore", _restore)
    return app


async def serve(agent: Agent, stop: asyncio.Event | None = None) -> int:
    """Serve until ``stop`` is set or a background loop dies; return the exit status.

    0 after ``stop``; :data:`~sessionfleet.supervise.EXIT_TASK_FAILED` when a loop died,
    so that Kubernetes restarts the agent instead of leaving it half working.
    """
    settings = agent.settings
    tls = None
    if not settings.plain_http:
        tls = await asyncio.to_thread(
            server_context,
            settings.node,
            settings.tls_cert_file,
            settings.tls_key_file,
            settings.addresses,
        )
    runner = web.AppRunner(build_app(agent), access_log=None)
    await runner.setup()
    try:
        async with agent.running() as supervisor:
            site = web.TCPSite(
                runner, settings.host, settings.port, reuse_address=True, ssl_context=tls
            )
            await site.start()
            log.info(
                "node agent for %s serving on %s://%s:%d (%s; callers: %s; storage root %s)",
                settings.node,
                "http" if tls is None else "https",
                settings.host,
                settings.port,
                "no TLS"
                if tls is None
                else "TLS with "
                + ("the given certificate" if settings.tls_cert_file else "a self-signed one"),
                describe_callers(settings),
                settings.storage_root,
            )
            failure = await supervisor.wait(stop)
    finally:
        await runner.cleanup()
    if failure is not None:
        log.error("stopping the agent: %s", failure)
        return EXIT_TASK_FAILED
    return 0


def describe_callers(settings: AgentSettings) -> str:
    """Return who may operate the agent, for its start line."""
    if settings.operators:
        return "TokenReview for " + ", ".join(sorted(settings.operators))
    if settings.token:
        return "the static --token-file"
    return "nobody (checkpoint endpoints disabled; /metrics open)"


__all__ = [
    "AGENT_KEY",
    "MAX_BODY_BYTES",
    "Agent",
    "AgentSettings",
    "authenticator_for",
    "describe_callers",
    "CapabilityCache",
    "build_app",
    "parse_body",
    "pod_names",
    "serve",
    "wants_refresh",
]
