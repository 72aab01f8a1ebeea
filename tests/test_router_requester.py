"""Who a new session counts against: API key, a trusted proxy's X-Forwarded-For, the peer."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessionfleet.fronts.admission import NewSessionLimiter, SessionRates
from sessionfleet.fronts.requester import (
    FAIRNESS_HEADER,
    MAX_HOPS,
    MAX_KEY_CHARS,
    TrustedProxies,
    client_address,
    fairness_key,
    parse_networks,
    requester_key,
)
from sessionfleet.router.cli import add_parser, settings_from_args

GATEWAYS = TrustedProxies(parse_networks(["10.0.0.0/8", "fd00::/8"]))


@pytest.mark.parametrize(
    ("peer", "forwarded", "client"),
    [
        # A trusted gateway forwarded the client's address.
        ("10.1.2.3", ["203.0.113.7"], "203.0.113.7"),
        # Through two trusted hops; what the client put first (a forgery) is not read.
        ("10.1.2.3", ["1.1.1.1, 203.0.113.7, 10.4.4.4"], "203.0.113.7"),
        # The same, over two header lines.
        ("10.1.2.3", ["1.1.1.1, 203.0.113.7", "10.4.4.4"], "203.0.113.7"),
        # A peer that is not a trusted proxy: its header is ignored, whatever it says.
        ("192.0.2.1", ["203.0.113.7"], "192.0.2.1"),
        ("192.0.2.1", ["10.0.0.1"], "192.0.2.1"),
        # Garbage ends what can be believed: the last good hop counts.
        ("10.1.2.3", ["203.0.113.7, bogus, 10.4.4.4"], "10.4.4.4"),
        ("10.1.2.3", ["not-an-address"], "10.1.2.3"),
        ("10.1.2.3", [], "10.1.2.3"),
        # Every hop a trusted proxy (the client inside the cluster): the first one.
        ("10.1.2.3", ["10.7.7.7, 10.4.4.4"], "10.7.7.7"),
        # Ports and IPv6, as some proxies write them.
        ("10.1.2.3", ["203.0.113.7:4711"], "203.0.113.7"),
        ("fd00::1", ["[2001:db8::5]:443"], "2001:db8::5"),
        ("fd00::1", ["2001:db8::5"], "2001:db8::5"),
        # No usable peer address (a Unix socket).
        (None, ["203.0.113.7"], "unknown"),
    ],
)
def test_client_address(peer: str | None, forwarded: list[str], client: str) -> None:
    assert client_address(peer, forwarded, GATEWAYS) == client


def test_no_trusted_proxy_by_default() -> None:
    assert client_address("10.1.2.3", ["203.0.113.7"], TrustedProxies()) == "10.1.2.3"


def test_the_api_key_comes_first_then_the_forwarded_client_then_the_peer() -> None:
    assert requester_key("alice", "10.1.2.3", ["203.0.113.7"], GATEWAYS) == "client:alice"
    assert requester_key(None, "10.1.2.3", ["203.0.113.7"], GATEWAYS) == "address:203.0.113.7"
    assert requester_key(None, "192.0.2.1", ["203.0.113.7"], GATEWAYS) == "address:192.0.2.1"
    # A client named like an address never shares a bucket with that address.
    assert requester_key("192.0.2.1", None, [], GATEWAYS) != requester_key(
        None, "192.0.2.1", [], GATEWAYS
    )


def test_fairness_key() -> None:
    assert fairness_key({FAIRNESS_HEADER: "tenant-a"}) == "fairness:tenant-a"
    assert fairness_key({FAIRNESS_HEADER: "  "}) == fairness_key({}) == ""
    long = fairness_key({FAIRNESS_HEADER: "x" * 8000})
    assert long.startswith("sha256:") and len(long) <= MAX_KEY_CHARS
    assert long != fairness_key({FAIRNESS_HEADER: "x" * 7999})


def test_networks_parse_or_say_what_is_wrong() -> None:
    assert parse_networks(["10.0.0.0/8,192.168.1.1", " fd00::/8 "]) == (
        ipaddress.ip_network("10.0.0.0/8"),
        ipaddress.ip_network("192.168.1.1/32"),
        ipaddress.ip_network("fd00::/8"),
    )
    with pytest.raises(ValueError, match="not a network: '10.0.0.300/8'"):
        parse_networks(["10.0.0.300/8"])


def test_the_router_flag() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["router", "--trusted-proxy=10.0.0.0/8", "--trusted-proxy", "192.168.0.0/16,fd00::/8"]
    )
    proxies = settings_from_args(args).config.trusted_proxies
    assert [str(n) for n in proxies.networks] == ["10.0.0.0/8", "192.168.0.0/16", "fd00::/8"]
    bad = parser.parse_args(["router", "--trusted-proxy=nonsense"])
    with pytest.raises(ValueError, match="not a network"):
        settings_from_args(bad)


def test_the_tracked_clients_are_bounded() -> None:
    limiter = NewSessionLimiter(SessionRates(1, 1, 0, 0), max_clients=100)
    for n in range(1000):
        limiter.admit(f"fairness:{n}", 0.0)
    assert limiter.tracked == 100


addresses = st.one_of(
    st.ip_addresses().map(str),
    st.text(max_size=30),
    st.sampled_from(["10.0.0.1", "10.255.0.9", "fd00::7", "[fd00::7]:80", "1.2.3.4:5"]),
)
headers = st.lists(st.lists(addresses, max_size=8).map(", ".join), max_size=4)


@settings(max_examples=500, deadline=None)
@given(st.ip_addresses().map(str), headers)
def test_forwarded_for_fuzz(peer: str, forwarded: list[str]) -> None:
    client = client_address(peer, forwarded, GATEWAYS)
    if not GATEWAYS.trusts(ipaddress.ip_address(peer)):
        # Spoofing from an untrusted peer never moves it to another bucket.
        assert client == str(ipaddress.ip_address(peer))
        return
    # From a trusted peer: the peer, or an address written in the header.
    written = {a for value in forwarded for hop in value.split(",") for a in _readings(hop)}
    assert client == str(ipaddress.ip_address(peer)) or client in written
    assert ipaddress.ip_address(client)


def _readings(hop: str) -> set[str]:
    """Every address a hop could be read as: bare, ``[v6]:port`` or ``v4:port``."""
    hop = hop.strip()
    found = set()
    for text in (hop, hop.strip("[").split("]")[0], hop.rsplit(":", 1)[0]):
        try:
            found.add(str(ipaddress.ip_address(text)))
        except ValueError:
            pass
    return found


def test_a_header_of_many_hops_costs_a_bounded_walk() -> None:
    hops = ", ".join(["10.0.0.1"] * 100_000 + ["10.0.0.2"] * (MAX_HOPS - 1))
    assert client_address("10.9.9.9", [hops], GATEWAYS) == "10.0.0.1"
