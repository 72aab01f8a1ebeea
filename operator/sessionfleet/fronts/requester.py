"""Who a new session counts against: the key of the new-session rate limit.

Behind a gateway or a load balancer every request comes from the proxy's address, so a
limit keyed on the peer puts all clients in one bucket and one busy client stops the
others. The key is therefore, in order:

1. the authenticated client (``--api-keys-dir``): its name;
2. the client address a trusted proxy put in ``X-Forwarded-For``, when the peer is in a
   ``--trusted-proxy`` network. The header is read from the right, the way proxies
   append to it: each address that is itself a trusted proxy is skipped, and the first
   that is not is the client. What an untrusted peer sends in the header is ignored, so
   a client cannot pick its own bucket by forging it;
3. the peer address.

EPP requests come from the gateway, which knows the client only as GAIE's fairness id:
:func:`fairness_key` keys them on it.

Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address

FORWARDED_FOR: Final = "X-Forwarded-For"
FAIRNESS_HEADER: Final = "x-gateway-inference-fairness-id"
"""GAIE's fairness id: which client (tenant, user) a request is for, set by the gateway."""
MAX_HOPS: Final = 32
"""Addresses of ``X-Forwarded-For`` read at most, from the right: a header of thousands
of entries costs no more than this."""
MAX_KEY_CHARS: Final = 128
"""Keys longer than this are replaced by their hash: memory per tracked key stays small
however long a header is."""


def parse_networks(values: Iterable[str]) -> tuple[Network, ...]:
    """Parse CIDRs (``10.0.0.0/8``, ``fd00::/8``, a bare address); raise ValueError."""
    networks: list[Network] = []
    for value in values:
        for part in value.split(","):
            if part.strip():
                try:
                    networks.append(ipaddress.ip_network(part.strip(), strict=False))
                except ValueError as error:
                    raise ValueError(f"not a network: {part.strip()!r} ({error})") from None
    return tuple(networks)


@dataclass(frozen=True, slots=True)
class TrustedProxies:
    """The proxies whose ``X-Forwarded-For`` is believed; none by default."""

    networks: tuple[Network, ...] = ()

    def trusts(self, address: Address) -> bool:
        """Return whether ``address`` is one of the trusted proxies."""
        return any(address in network for network in self.networks)


def _address(text: str) -> Address | None:
    text = text.strip()
    if text.startswith("["):  # [v6]:port
        text = text[1:].partition("]")[0]
    elif text.count(":") == 1:  # v4:port
        text = text.partition(":")[0]
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def client_address(peer: str | None, forwarded: Sequence[str], proxies: TrustedProxies) -> str:
    """Return the client's address (see the module).

    From ``forwarded`` (the header's values, in order) when ``peer`` is a trusted proxy,
    else the peer itself.
    """
    peer_address = _address(peer or "")
    if peer_address is None:
        return peer or "unknown"
    if not proxies.trusts(peer_address):
        return str(peer_address)
    hops = [hop for value in forwarded for hop in value.split(",")][-MAX_HOPS:]
    client = peer_address
    for hop in reversed(hops):
        address = _address(hop)
        if address is None:
            break  # garbage: what is left of it cannot be believed
        client = address
        if not proxies.trusts(address):
            break
    return str(client)


def _bounded(key: str) -> str:
    if len(key) <= MAX_KEY_CHARS:
        return key
    return "sha256:" + hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def requester_key(
    owner: str | None,
    peer: str | None,
    forwarded: Sequence[str],
    proxies: TrustedProxies,
) -> str:
    """Return the key a new session of this request counts against (see the module)."""
    if owner is not None:
        return _bounded(f"client:{owner}")
    return "address:" + client_address(peer, forwarded, proxies)


def fairness_key(headers: Mapping[str, str]) -> str:
    """Return the EPP's key: GAIE's fairness id when the request has one, else one shared key."""
    fairness = (headers.get(FAIRNESS_HEADER) or "").strip()
    return _bounded(f"fairness:{fairness}") if fairness else ""
