"""Who may use the router, and how fast a client may open new sessions.

**Client authentication** is optional. When ``--api-keys-dir`` names a folder (a
Kubernetes Secret mounted as files), each file is one client: the file name is the
client's name, its content the client's key. A request must then carry a key, as
``Authorization: Bearer <key>`` (OpenAI SDKs) or ``x-api-key: <key>`` (Anthropic
SDKs); a request without a known key is refused with 401 before any other work. The
keys are re-read when the folder changes, so a rotated Secret takes effect without a
restart. Keys are compared by their SHA-256, so a lookup takes the same time whatever
part of a key matches.

**New sessions are rate limited** per client (the authenticated name, else the address
a trusted proxy forwarded, else the peer address: :mod:`.requester`) and globally, with
token buckets, in each replica: a turn that would create an AgentSession
beyond the rate is answered 429 with ``Retry-After``. Turns of sessions that exist are
never limited, so a flood of new ids cannot slow down established sessions' turns.

Pure apart from reading the key folder: time is passed in.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from sessionfleet.policy.rates import TokenBucket

logger = logging.getLogger("sessionfleet.router")

MAX_KEY_BYTES: Final = 4096
_MAX_CLIENT_BUCKETS: Final = 65536
"""Per-client buckets kept at most; the least recently used are forgotten first."""


class AuthError(ValueError):
    """A request without a valid key; the message is for the client."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def _offered_key(headers: Mapping[str, str]) -> str | None:
    authorization = headers.get("Authorization")
    if authorization is not None:
        scheme, _, credential = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and credential.strip():
            return credential.strip()
    key = headers.get("x-api-key")
    return key.strip() if key and key.strip() else None


class ApiKeys:
    """The clients' keys, loaded from a folder with one file per client."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._clients: dict[bytes, str] = {}
        self._stamp: tuple[float, ...] | None = None
        self.reload()

    def __len__(self) -> int:
        return len(self._clients)

    def _files(self) -> list[Path]:
        # A mounted Secret has ..data and timestamped folders beside the key links.
        return sorted(p for p in self.folder.iterdir() if not p.name.startswith("."))

    def _current_stamp(self) -> tuple[float, ...]:
        files = self._files()
        return (self.folder.stat().st_mtime, *(p.stat().st_mtime for p in files))

    def reload(self) -> bool:
        """Read the folder again if it changed; return whether the keys were replaced.

        Raises :class:`OSError` when the folder cannot be read, and :class:`ValueError`
        when it holds no key (a router that requires keys but knows none would refuse
        everyone, which is never what was meant).
        """
        stamp = self._current_stamp()
        if stamp == self._stamp:
            return False
        clients: dict[bytes, str] = {}
        for path in self._files():
            if not path.is_file():
                continue
            key = path.read_bytes()[:MAX_KEY_BYTES].decode("utf-8", "replace").strip()
            if key:
                clients[_digest(key)] = path.name
        if not clients:
            raise ValueError(f"{self.folder} holds no API key")
        self._clients, self._stamp = clients, stamp
        logger.info("loaded %d API keys from %s", len(clients), self.folder)
        return True

    def client_of(self, headers: Mapping[str, str]) -> str:
        """Return the name of the client whose key the request carries; raise :class:`AuthError`."""
        key = _offered_key(headers)
        if key is None:
            raise AuthError("an API key is required: send Authorization: Bearer <key>")
        client = self._clients.get(_digest(key))
        if client is None:
            raise AuthError("the API key is not valid")
        return client


@dataclass(frozen=True, slots=True)
class SessionRates:
    """New sessions a second, per client and for the whole router; 0 turns a limit off."""

    per_client: float = 20.0
    per_client_burst: float = 40.0
    total: float = 200.0
    total_burst: float = 400.0

    def __post_init__(self) -> None:
        for name in ("per_client", "per_client_burst", "total", "total_burst"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")


class NewSessionLimiter:
    """Token buckets for new sessions, one per client and one for everyone."""

    def __init__(
        self, rates: SessionRates, now: float = 0.0, *, max_clients: int = _MAX_CLIENT_BUCKETS
    ) -> None:
        self.rates = rates
        self._max_clients = max_clients
        self._total = (
            TokenBucket.full(rates.total, max(1.0, rates.total_burst), now) if rates.total else None
        )
        self._clients: OrderedDict[str, TokenBucket] = OrderedDict()

    def _client(self, client: str, now: float) -> TokenBucket | None:
        if not self.rates.per_client:
            return None
        bucket = self._clients.get(client)
        if bucket is None:
            burst = max(1.0, self.rates.per_client_burst)
            bucket = self._clients[client] = TokenBucket.full(self.rates.per_client, burst, now)
            if len(self._clients) > self._max_clients:
                self._clients.popitem(last=False)
        else:
            self._clients.move_to_end(client)
        return bucket

    @property
    def tracked(self) -> int:
        """Clients with a bucket of their own now (at most ``max_clients``)."""
        return len(self._clients)

    def admit(self, client: str, now: float) -> int:
        """Take a token for a new session of ``client``; return 0, or seconds to wait.

        Nothing is taken when the answer is to wait.
        """
        buckets = [b for b in (self._client(client, now), self._total) if b is not None]
        wait = max((b.wait(now) for b in buckets), default=0.0)
        if wait > 0:
            return max(1, math.ceil(wait))
        for bucket in buckets:
            bucket.take()
        return 0
