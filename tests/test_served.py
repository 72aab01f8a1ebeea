"""What kopf must watch, waited for before it starts and checked after its scan.

The real API server's discovery (a restart's 503s and 404s) is met in
e2e/test_chaos_control_plane.py; here a scripted discovery drives the decisions.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

import kopf
import pytest

from sessionfleet.controllers import handlers  # noqa: F401 - registers the handlers
from sessionfleet.controllers.kopfcompat import Insights, Resource
from sessionfleet.controllers.served import (
    KindsNotWatched,
    RetryForever,
    WatchedKind,
    check_kopf_scan,
    discover,
    missing,
    wait_until_served,
    watched_kinds,
)
from sessionfleet.kube import ApiUnavailable, NotFound

WORKERS = WatchedKind("sessionfleet.dev", "v1alpha1", "inferenceworkers")
PODS = WatchedKind("", "v1", "pods")


class Discovery:
    """Answers discovery requests from a script: one answer (or error) per round."""

    def __init__(self, rounds: list[dict[str, Any] | Exception]) -> None:
        self.rounds = rounds
        self.round = 0
        self.paths: list[str] = []

    async def request(self, method: str, path: str, **_: Any) -> dict[str, Any]:
        assert method == "GET"
        self.paths.append(path)
        answer = self.rounds[min(self.round, len(self.rounds) - 1)]
        if isinstance(answer, Exception):
            raise answer
        if path not in answer:
            raise NotFound(404, f"{path} not found")
        return {"resources": [{"name": name} for name in answer[path]]}

    def next_round(self) -> None:
        self.round += 1


def test_the_handlers_watch_every_kind_the_fleet_reads() -> None:
    kinds = watched_kinds(kopf.get_default_registry())
    assert {k.plural for k in kinds} == {
        "inferenceworkers",
        "drainpolicies",
        "workercheckpoints",
        "pods",
        "nodes",
        "poddisruptionbudgets",
        "networkpolicies",
        "leases",
    }
    assert WORKERS in kinds and PODS in kinds
    assert str(WORKERS) == "inferenceworkers.sessionfleet.dev/v1alpha1" and str(PODS) == "pods"


def test_a_handler_without_an_exact_kind_is_refused() -> None:
    registry = kopf.OperatorRegistry()

    @kopf.on.event("sessionfleet.dev", "v1alpha1", kopf.EVERYTHING, registry=registry)
    def anything(**_: Any) -> None:
        """Watches whatever the group has."""

    with pytest.raises(ValueError, match="not exact"):
        watched_kinds(registry)


def test_missing_names_what_discovery_does_not_list() -> None:
    served = {("", "v1"): {"pods", "pods/log", "nodes"}, ("sessionfleet.dev", "v1alpha1"): set()}
    assert missing([WORKERS, PODS], served) == [WORKERS]
    assert missing([WORKERS], {}) == [WORKERS]
    assert missing([PODS], served) == []


async def test_discover_lists_plurals_without_subresources_and_nothing_for_a_404() -> None:
    discovery = Discovery([{"/api/v1": ["pods", "pods/status"]}])
    served = await discover(discovery, [("", "v1"), ("sessionfleet.dev", "v1alpha1")])  # type: ignore[arg-type]
    assert served == {("", "v1"): {"pods"}, ("sessionfleet.dev", "v1alpha1"): frozenset()}
    assert discovery.paths == ["/api/v1", "/apis/sessionfleet.dev/v1alpha1"]


async def test_the_wait_lasts_through_a_starting_api_server_and_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Down, then 503 while starting, then discovery without the custom group: wait."""
    everything = {"/api/v1": ["pods"], "/apis/sessionfleet.dev/v1alpha1": ["inferenceworkers"]}
    discovery = Discovery(
        [
            ApiUnavailable(0, "ConnectError"),
            ApiUnavailable(503, "before all known HTTP paths have been installed"),
            {"/api/v1": ["pods"]},
            everything,
        ]
    )
    caplog.set_level(logging.INFO, "sessionfleet.controllers.served")

    async def advance() -> None:
        while True:
            await asyncio.sleep(0.01)
            discovery.next_round()

    advancing = asyncio.create_task(advance())
    try:
        await asyncio.wait_for(
            wait_until_served(discovery, [WORKERS, PODS], interval=0.01, say_every=0),  # type: ignore[arg-type]
            timeout=5,
        )
    finally:
        advancing.cancel()
    said = [r.getMessage() for r in caplog.records]
    assert any("discovery failed" in line and "ConnectError" in line for line in said)
    assert any("not in discovery: inferenceworkers.sessionfleet.dev" in line for line in said)
    assert said[-1] == "the API server serves every kind the operator watches"


async def test_no_wait_and_nothing_said_when_everything_is_served(
    caplog: pytest.LogCaptureFixture,
) -> None:
    discovery = Discovery([{"/api/v1": ["pods"]}])
    caplog.set_level(logging.INFO, "sessionfleet.controllers.served")
    await asyncio.wait_for(wait_until_served(discovery, [PODS]), timeout=1)  # type: ignore[arg-type]
    assert discovery.paths == ["/api/v1"] and not caplog.records


def kopf_resource(kind: WatchedKind) -> Resource:
    return Resource(kind.group, kind.version, kind.plural, namespaced=True)


async def test_a_complete_kopf_scan_passes() -> None:
    insights = Insights()
    insights.watched_resources.update({kopf_resource(WORKERS), kopf_resource(PODS)})
    insights.indexed_resources.add(kopf_resource(WORKERS))
    insights.ready_resources.set()
    discovery = Discovery([{}])
    await asyncio.wait_for(check_kopf_scan(insights, [WORKERS, PODS], discovery), timeout=1)  # type: ignore[arg-type]
    assert discovery.paths == []  # nothing to wait for


async def test_a_scan_that_missed_a_kind_fails_once_the_kind_is_served() -> None:
    """Kopf scanned while discovery lacked the custom group: stop, but only once a new
    start would find it (failing at once would restart into the same gap)."""
    insights = Insights()
    insights.watched_resources.add(kopf_resource(PODS))
    discovery = Discovery([{"/api/v1": ["pods"]}])
    check = asyncio.create_task(check_kopf_scan(insights, [WORKERS, PODS], discovery))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    assert not check.done() and discovery.paths == []  # kopf has not scanned yet
    insights.ready_resources.set()
    await asyncio.sleep(1.5)
    assert not check.done() and len(discovery.paths) >= 2  # still not served: waits
    discovery.rounds.append({"/apis/sessionfleet.dev/v1alpha1": ["inferenceworkers"]})
    discovery.next_round()
    with pytest.raises(KindsNotWatched, match="inferenceworkers.sessionfleet.dev/v1alpha1"):
        await asyncio.wait_for(check, timeout=5)


def test_kopf_retries_forever_and_each_request_starts_from_the_first_delay() -> None:
    backoffs = RetryForever((1, 2), then=30)
    assert list(itertools.islice(backoffs, 6)) == [1, 2, 30, 30, 30, 30]
    assert next(iter(backoffs)) == 1
    assert not hasattr(backoffs, "__len__")  # kopf counts attempts only for a sized list
