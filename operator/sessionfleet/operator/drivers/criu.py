"""The operator half of the ``criu`` driver: ask the node agent to checkpoint a worker.

:class:`CriuDriver` implements the driver interface (:mod:`sessionfleet.checkpoint`)
by asking the agent on the worker's node (``POST /checkpoint``, ``POST /restore``),
which runs the node half (:mod:`sessionfleet.agent.criu`): the CUDA API and CRIU on
the engine's process. :class:`AgentAccess` turns the operator's flags into the way it
authenticates to the agents.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from sessionfleet.api import CheckpointDriver, EngineType
from sessionfleet.checkpoint.agent_api import (
    AGENT_PORT,
    DEFAULT_LOCK_TIMEOUT_MS,
    ENGINE_CONTAINER,
    FATAL_PHASE,
    NAMESPACE_NAME,
)
from sessionfleet.checkpoint.agent_tokens import AgentTokens, agent_ssl_context
from sessionfleet.checkpoint.driver import (
    CheckpointOutcome,
    CheckpointTarget,
    DriverError,
    DriverUnavailable,
    WriteGate,
    check_gate,
)
from sessionfleet.kube import NODES, PODS, Kube, KubeError

log = logging.getLogger(__name__)

# --- the operator side: the driver ------------------------------------------------

AgentLocator = Callable[[str], Awaitable[str]]
"""Node name to the base URL of the agent on that node."""


def node_address_locator(kube: Kube, port: int = AGENT_PORT, scheme: str = "https") -> AgentLocator:
    """Locate agents at their node's InternalIP (the agent's DaemonSet uses a hostPort)."""

    async def locate(node: str) -> str:
        try:
            body = await kube.get(NODES, node)
        except KubeError as error:
            raise DriverError(f"cannot read node {node}: {error}") from error
        for address in (body.get("status") or {}).get("addresses") or []:
            if address.get("type") == "InternalIP" and address.get("address"):
                host = str(address["address"])
                return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
        raise DriverError(f"node {node} has no InternalIP to reach its agent at")

    return locate


def container_id_of(pod: Mapping[str, Any], container: str) -> str:
    """Return a container's runtime ID (``containerd://…``) from a pod's status, or ``""``."""
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == container:
            return str(status.get("containerID") or "")
    return ""


class CriuDriver:
    """Checkpoints a worker's whole engine process through the agent on its node.

    The agent acts on other pods' processes and answers only callers it trusts: with
    ``tokens``, the driver presents a token of the operator's ServiceAccount valid for
    that one node (:class:`~sessionfleet.checkpoint.agent_tokens.AgentTokens`); else
    ``token``, the agents' shared secret (their ``--token-file``). ``http`` should
    check the agents' certificates as
    :func:`~sessionfleet.checkpoint.agent_tokens.agent_ssl_context` says.
    """

    name = CheckpointDriver.CRIU

    def __init__(
        self,
        http: httpx.AsyncClient,
        kube: Kube,
        *,
        locate: AgentLocator | None = None,
        container: str = ENGINE_CONTAINER,
        leave_running: bool = True,
        lock_timeout_seconds: float = DEFAULT_LOCK_TIMEOUT_MS / 1000,
        timeout: float = 900.0,
        token: str | None = None,
        tokens: AgentTokens | None = None,
        write_gate: WriteGate | None = None,
    ) -> None:
        self.http = http
        self.kube = kube
        self.write_gate = write_gate
        """Asked before every call to an agent.

        See :func:`sessionfleet.checkpoint.driver.check_gate`.
        """
        self.token = token
        self.tokens = tokens
        self.locate = locate or node_address_locator(kube)
        self.container = container
        self.leave_running = leave_running
        self.lock_timeout_seconds = lock_timeout_seconds
        self.timeout = timeout

    async def _post(self, node: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        base = await self.locate(node)
        token = self.token
        if self.tokens is not None:
            try:
                token = await self.tokens.for_node(node)
            except KubeError as error:
                raise DriverError(f"no token for the node agent on {node}: {error}") from error
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        check_gate(self.write_gate, f"node agent on {node}: {path}")
        try:
            response = await self.http.post(
                f"{base}{path}", json=body, headers=headers, timeout=self.timeout
            )
        except httpx.HTTPError as error:
            raise DriverError(f"node agent on {node} unreachable at {base}: {error!r}") from error
        try:
            answer = response.json()
        except ValueError:
            answer = {"error": response.text[:300]}
        if not isinstance(answer, dict):
            answer = {"error": str(answer)[:300]}
        if response.status_code == 503:
            raise DriverUnavailable(f"node {node}: {answer.get('error') or response.text[:300]}")
        if response.is_error:
            phase = answer.get("phase")
            said = answer.get("error") or response.text[:300]
            if phase == FATAL_PHASE:
                said = f"{said} (the process was killed: recover with a cold start)"
            raise DriverError(
                f"node agent on {node}: {path} failed ({phase or response.status_code}): {said}"
            )
        return answer

    def _where(self, target: CheckpointTarget) -> str:
        if not target.node:
            raise DriverError(f"worker {target.worker} has no node to checkpoint on")
        return target.node

    async def save(self, target: CheckpointTarget) -> CheckpointOutcome:
        """Checkpoint the worker's engine process into ``target.location``."""
        if target.sessions:
            raise DriverUnavailable(
                "the criu driver checkpoints a whole process, not single sessions: "
                "per-session migration needs the engine driver"
            )
        node = self._where(target)
        if not target.pod:
            raise DriverError(f"worker {target.worker} has no pod to checkpoint")
        try:
            pod = await self.kube.get(PODS, target.pod, target.namespace)
        except KubeError as error:
            raise DriverError(
                f"cannot read pod {target.namespace}/{target.pod}: {error}"
            ) from error
        uid = str((pod.get("metadata") or {}).get("uid") or "")
        container_id = container_id_of(pod, self.container)
        if not uid or not container_id:
            raise DriverError(
                f"pod {target.namespace}/{target.pod} has no running {self.container} container"
            )
        answer = await self._post(
            node,
            "/checkpoint",
            {
                "podUID": uid,
                "containerID": container_id,
                "endpoint": target.endpoint,
                "imagesDir": target.location,
                "namespace": target.namespace,
                "leaveRunning": self.leave_running,
                "lockTimeoutSeconds": self.lock_timeout_seconds,
            },
        )
        return CheckpointOutcome(
            location=target.location,
            seconds=float(answer.get("seconds", 0.0)),
            size_bytes=int(answer.get("sizeBytes", 0)),
        )

    async def load(self, target: CheckpointTarget) -> CheckpointOutcome:
        """Restore the process saved at ``target.location`` on the target's node."""
        node = self._where(target)
        answer = await self._post(
            node,
            "/restore",
            {
                "imagesDir": target.location,
                "namespace": target.namespace,
                "endpoint": target.endpoint,
            },
        )
        return CheckpointOutcome(
            location=target.location, seconds=float(answer.get("seconds", 0.0))
        )

    def restore_args(self, engine: EngineType, location: str) -> list[str]:
        """Nothing: a CRIU restore recreates the process instead of starting an engine."""
        return []


def service_account_ref(text: str) -> tuple[str, str]:
    """Return ``(namespace, name)`` of ``NAMESPACE/NAME``; :class:`ValueError` if malformed."""
    namespace, _, name = text.partition("/")
    if not NAMESPACE_NAME.match(namespace) or not re.fullmatch(
        r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", name
    ):
        raise ValueError(f"not NAMESPACE/NAME of a ServiceAccount: {text!r}")
    return namespace, name


@dataclass(frozen=True, slots=True)
class AgentAccess:
    """How the operator reaches and authenticates to the node agents (its ``--agent-*`` flags)."""

    port: int = AGENT_PORT
    token_file: str | None = None
    """The agents' static shared secret (agents started with ``--token-file``)."""
    service_account: str | None = None
    """``NAMESPACE/NAME`` of the operator's ServiceAccount: a token per node (TokenRequest)."""
    ca_file: str | None = None
    """The CA that signed the agents' certificates; ``None``: encrypted, unverified."""

    def driver(self, kube: Kube, write_gate: WriteGate | None = None) -> CriuDriver | None:
        """Return the criu driver, or ``None`` when the operator has no way to authenticate."""
        token, tokens = None, None
        if self.service_account:
            namespace, name = service_account_ref(self.service_account)
            tokens = AgentTokens(kube, namespace, name)
        elif self.token_file:
            token = Path(self.token_file).read_text().strip()
        else:
            return None
        http = httpx.AsyncClient(verify=agent_ssl_context(self.ca_file))
        locate = node_address_locator(kube, self.port)
        return CriuDriver(
            http, kube, locate=locate, token=token, tokens=tokens, write_gate=write_gate
        )
