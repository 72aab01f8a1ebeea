"""The operator's credentials for the node agents: a token per node, and how TLS is checked.

The operator asks the API server (TokenRequest) for a token of its own ServiceAccount
whose audience is ``sessionfleet-agent:<node>``: the agent on that node accepts it
after a TokenReview for that audience (:mod:`sessionfleet.agent.auth`), every other
node refuses it, and it expires after :data:`TOKEN_SECONDS`. A token is reused for
half its life, so a checkpoint costs a TokenRequest at most every few minutes per node.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from typing import Any

from sessionfleet.kube import Kube, KubeError

AUDIENCE_PREFIX = "sessionfleet-agent:"
TOKEN_SECONDS = 600
"""A token's life: the shortest the API server grants (``expirationSeconds`` ≥ 600)."""


def node_audience(node: str) -> str:
    """Return the audience of the tokens that the agent on ``node`` accepts."""
    return f"{AUDIENCE_PREFIX}{node}"


def token_request(audience: str, seconds: int = TOKEN_SECONDS) -> dict[str, Any]:
    """Return the TokenRequest body for a token of ``audience`` living ``seconds``."""
    return {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {"audiences": [audience], "expirationSeconds": seconds},
    }


class AgentTokens:
    """Tokens of one ServiceAccount for the agents, one per node, requested as needed."""

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        service_account: str,
        *,
        seconds: int = TOKEN_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kube = kube
        self.path = f"/api/v1/namespaces/{namespace}/serviceaccounts/{service_account}/token"
        self.seconds = seconds
        self.clock = clock
        self._tokens: dict[str, tuple[str, float]] = {}
        self._lock = asyncio.Lock()

    async def for_node(self, node: str) -> str:
        """Return a token the agent on ``node`` accepts; :class:`KubeError` if none is given."""
        async with self._lock:
            held = self._tokens.get(node)
            if held is not None and held[1] > self.clock():
                return held[0]
            answer = await self.kube.request(
                "POST", self.path, body=token_request(node_audience(node), self.seconds)
            )
            token = str((answer.get("status") or {}).get("token") or "")
            if not token:
                raise KubeError(0, f"POST {self.path}: the answer holds no token")
            granted = (answer.get("spec") or {}).get("expirationSeconds") or self.seconds
            self._tokens[node] = (token, self.clock() + float(granted) / 2)
            return token


def agent_ssl_context(ca_file: str | None) -> ssl.SSLContext:
    """Return how the operator checks the agents' certificates.

    With ``ca_file``: the chain must lead to that CA (any agent certificate it signed;
    the host name is not checked, since agents are called at their node's address).
    Without: encrypted but unverified, for the certificate each agent makes at start.
    """
    if ca_file:
        context = ssl.create_default_context(cafile=ca_file)
        context.check_hostname = False
        return context
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


__all__ = [
    "AUDIENCE_PREFIX",
    "TOKEN_SECONDS",
    "AgentTokens",
    "agent_ssl_context",
    "node_audience",
    "token_request",
]
