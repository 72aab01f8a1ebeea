"""Who may call the node agent: a token valid for this node only, or the static token.

Two ways, one per agent (``sessionfleet agent --operator`` or ``--token-file``):

- **TokenReview** (the chart's way): the operator asks the API server for a short-lived
  token of its own ServiceAccount with the audience ``sessionfleet-agent:<node>``
  (:mod:`sessionfleet.checkpoint.agent_tokens`) and presents it to that node's agent; the
  agent asks the API server whether the token is valid *for that audience*
  (a TokenReview) and whether it names one of the identities it was told to trust. A
  token one node saw is refused by every other node, and it expires within minutes.
  Metrics scrapers (``--metrics-reader``) present their ordinary ServiceAccount token
  (the API server's own audience, as the kubelet's ``/metrics`` takes it) and may read
  ``/metrics`` only.
- **A static token** (``--token-file``), for an agent that cannot reach the API server:
  one secret for every node, compared in constant time. A token stolen from one node
  opens them all; prefer TokenReview wherever the agent can reach the API server.

The decision over a TokenReview's answer is the pure :func:`review_verdict`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

from sessionfleet.checkpoint.agent_tokens import node_audience
from sessionfleet.kube import Kube, KubeError

TOKEN_REVIEWS_PATH = "/apis/authentication.k8s.io/v1/tokenreviews"
REVIEW_CACHE_SECONDS = 60.0
"""How long a token the API server accepted is trusted without asking again."""
MAX_CACHED_TOKENS = 256
TOKEN_REQUIRED = "a valid bearer token is required"
MAX_CONCURRENT_REVIEWS = 4
"""TokenReviews in flight at once: a flood of made-up tokens must not flood the API server."""


class Access(Enum):
    """What a request wants to do."""

    OPERATE = "operate"
    """Checkpoint, restore, probe, read the capability: the operator only."""
    READ_METRICS = "read-metrics"
    """Read ``/metrics``: the operator or a metrics reader."""


class Authenticator(Protocol):
    """Decides whether a bearer token may do something on this agent."""

    async def refusal(self, token: str, access: Access) -> str | None:
        """Return why ``token`` may not have ``access``, or ``None`` when it may."""
        ...


class StaticToken:
    """One shared secret for every node (``--token-file``)."""

    def __init__(self, token: str) -> None:
        self.token = token

    async def refusal(self, token: str, access: Access) -> str | None:
        """Compare in constant time, so the answer's timing does not reveal a prefix."""
        # surrogatepass: a header that is not valid UTF-8 must be refused, not crash.
        if hmac.compare_digest(token.encode("utf-8", "surrogatepass"), self.token.encode()):
            return None
        return TOKEN_REQUIRED


def review_verdict(
    status: Mapping[str, Any], audience: str | None, allowed: frozenset[str]
) -> str | None:
    """Return why a TokenReview's ``status`` does not admit its caller, or ``None``.

    ``audience``: the audience the token must carry (``None``: the API server's own,
    for metrics readers); ``allowed``: the user names that may call.
    """
    if status.get("error"):
        return f"the token was not accepted: {str(status['error'])[:200]}"
    if status.get("authenticated") is not True:
        return "the token was not accepted"
    if audience is not None and audience not in (status.get("audiences") or []):
        return f"the token is not for this node's agent (audience {audience})"
    username = str((status.get("user") or {}).get("username") or "")
    if username not in allowed:
        return f"{username or 'an anonymous caller'} may not do this on the node agent"
    return None


def token_review(token: str, audience: str | None) -> dict[str, Any]:
    """Return the TokenReview that asks about ``token`` for ``audience``."""
    spec: dict[str, Any] = {"token": token}
    if audience is not None:
        spec["audiences"] = [audience]
    return {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": spec}


@dataclass(frozen=True, slots=True)
class _Accepted:
    username: str
    until: float


class TokenReviewer:
    """Accepts tokens the API server vouches for, for this node's audience, from known callers."""

    def __init__(
        self,
        kube: Kube,
        node: str,
        operators: frozenset[str],
        metrics_readers: frozenset[str] = frozenset(),
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not operators:
            raise ValueError("TokenReview needs at least one operator identity")
        self.kube = kube
        self.audience = node_audience(node)
        self.operators = operators
        self.metrics_readers = metrics_readers
        self.clock = clock
        self._accepted: dict[str, _Accepted] = {}
        self._reviews = asyncio.Semaphore(MAX_CONCURRENT_REVIEWS)

    async def refusal(self, token: str, access: Access) -> str | None:
        """Return why ``token`` may not have ``access`` (asking the API server), or ``None``."""
        if not token:
            return TOKEN_REQUIRED
        # A scraper's token first for /metrics: it is the one read every few seconds.
        if access is Access.READ_METRICS and self.metrics_readers:
            if await self._check(token, None, self.metrics_readers) is None:
                return None
        return await self._check(token, self.audience, self.operators)

    async def _check(self, token: str, audience: str | None, allowed: frozenset[str]) -> str | None:
        key = hashlib.sha256(f"{audience}\0{token}".encode("utf-8", "surrogatepass")).hexdigest()
        cached = self._accepted.get(key)
        if cached is not None and cached.until > self.clock():
            return None if cached.username in allowed else f"{cached.username} may not do this"
        async with self._reviews:
            try:
                answer = await self.kube.request(
                    "POST", TOKEN_REVIEWS_PATH, body=token_review(token, audience)
                )
            except KubeError as error:
                return f"the API server could not review the token: {error}"
        status = answer.get("status") or {}
        refused = review_verdict(status, audience, allowed)
        if refused is None:
            if len(self._accepted) >= MAX_CACHED_TOKENS:
                self._accepted.clear()
            username = str((status.get("user") or {}).get("username"))
            self._accepted[key] = _Accepted(username, self.clock() + REVIEW_CACHE_SECONDS)
        return refused


__all__ = [
    "REVIEW_CACHE_SECONDS",
    "Access",
    "Authenticator",
    "TOKEN_REQUIRED",
    "StaticToken",
    "TokenReviewer",
    "review_verdict",
    "token_review",
]
