"""The usage ledger is exact under every interleaving of turns, flushes, watch events and
restarts of two router replicas.

A model of what the routers and the API server do, with the router's own pure pieces
(:class:`UsageLedger`, :func:`turn_totals`, :func:`status_patch`, :meth:`Totals.from_status`):
the store applies a status merge patch only when its ``resourceVersion`` matches
(else 409), each replica sees the object through a watch that can lag behind, and a
replica that restarts writes what it holds first (as the router does on SIGTERM).
Hypothesis drives the order; the status must equal the sums over the answered turns.
"""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass, field
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from router_fakes import FakeKube

from sessionfleet.engines.vllm import Usage
from sessionfleet.fronts.bindings import BindingTable
from sessionfleet.fronts.kubesync import Flusher
from sessionfleet.fronts.ledger import Totals, UsageLedger, status_patch, turn_totals
from sessionfleet.fronts.metrics import RouterMetrics
from sessionfleet.kube import ApiUnavailable, Resource

T0 = 1_800_000_000.0
NAME = "s"


@dataclass
class Store:
    """One AgentSession's status and its versions, as the API server keeps them."""

    status: dict[str, Any] = field(default_factory=dict)
    version: int = 1
    history: list[tuple[int, dict[str, Any]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.history.append((self.version, copy.deepcopy(self.status)))

    def patch(self, patch: dict[str, Any]) -> bool:
        if patch["metadata"]["resourceVersion"] != str(self.version):
            return False
        self.status.update(patch["status"])
        self.version += 1
        self.history.append((self.version, copy.deepcopy(self.status)))
        return True


@dataclass
class Replica:
    ledger: UsageLedger = field(default_factory=lambda: UsageLedger(interval=10))
    seen: int = 0
    """Index into the store's history that this replica's watch has delivered."""
    view: tuple[Totals, str] = field(default_factory=lambda: (Totals(), "1"))

    def observe(self, store: Store, index: int) -> None:
        version, status = store.history[index]
        self.seen, self.view = index, (Totals.from_status(status), str(version))

    def flush(self, store: Store, now: float) -> None:
        delta = self.ledger.take(NAME, now)
        if delta is None:
            return
        while True:  # the Flusher's loop: conflict -> re-read -> recompute
            observed, version = self.view
            if store.patch(status_patch(observed, delta, version)):
                self.observe(store, len(store.history) - 1)
                return
            self.observe(store, len(store.history) - 1)


usages = st.one_of(
    st.none(),
    st.builds(
        Usage,
        st.integers(0, 5000),
        st.integers(0, 50),
        st.one_of(st.none(), st.integers(0, 5000)),
    ),
)
steps = st.lists(
    st.one_of(
        st.tuples(st.just("turn"), st.integers(0, 1), usages),
        st.tuples(st.just("flush"), st.integers(0, 1)),
        st.tuples(st.just("watch"), st.integers(0, 1)),
        st.tuples(st.just("restart"), st.integers(0, 1)),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=400, deadline=None)
@given(steps)
def test_status_equals_the_sums_over_answered_turns(program: list[tuple[Any, ...]]) -> None:
    store = Store()
    replicas = [Replica(), Replica()]
    now = T0
    answered: list[tuple[float, Usage | None]] = []
    for step in program:
        now += 1.0
        kind, index = step[0], step[1]
        replica = replicas[index]
        if kind == "turn":
            usage = step[2]
            # Turns of one session follow each other: each starts after the last ended.
            replica.ledger.record(NAME, turn_totals(usage, started=now, now=now + 0.5))
            answered.append((now, usage))
        elif kind == "flush":
            replica.flush(store, now)
        elif kind == "watch" and replica.seen + 1 < len(store.history):
            replica.observe(store, replica.seen + 1)  # one event later, in order
        elif kind == "restart":
            replica.flush(store, now)  # SIGTERM: write what is held
            replicas[index] = Replica()
            replicas[index].observe(store, len(store.history) - 1)  # LIST on start
    for replica in replicas:
        replica.flush(store, now + 100)

    status = store.status
    turns = [(t, u) for t, u in answered]
    expected_prompt = sum(u.prompt_tokens for _, u in turns if u)
    expected_cached = sum(min(u.cached_tokens or 0, u.prompt_tokens) for _, u in turns if u)

    def uncached(u: Usage | None) -> int:
        return 0 if u is None else u.prompt_tokens - min(u.cached_tokens or 0, u.prompt_tokens)

    expected_recomputed = sum(uncached(u) for _, u in turns[1:])
    assert status.get("turns", 0) == len(turns)
    assert status.get("promptTokens", 0) == expected_prompt
    assert status.get("cachedTokens", 0) == expected_cached
    assert status.get("recomputedTokens", 0) == expected_recomputed
    if turns:
        assert status["firstTurnUncachedTokens"] == uncached(turns[0][1])


class AnswerLosingKube(FakeKube):
    """The API server, with a network in front that can lose a status PATCH or its answer."""

    def __init__(self) -> None:
        super().__init__()
        self.fault: str | None = None
        """``applied``: the next PATCH lands and its answer is lost; ``dropped``: it never
        arrives. Either way the caller sees what a timeout looks like."""

    async def patch(
        self, resource: Resource, name: str, body: dict[str, Any], *args: Any, **kw: Any
    ) -> dict[str, Any]:
        fault, self.fault = self.fault, None
        if fault == "dropped":
            raise ApiUnavailable(504, "timed out")
        answer = await super().patch(resource, name, body, *args, **kw)
        if fault == "applied":
            raise ApiUnavailable(504, "timed out")
        return answer


@dataclass
class FlushingReplica:
    """One router replica's real ledger, binding table and Flusher."""

    kube: AnswerLosingKube
    name: str
    ledger: UsageLedger = field(default_factory=lambda: UsageLedger(interval=1e-9))
    table: BindingTable = field(default_factory=BindingTable)
    seen: int = 0
    """How many of the API server's events this replica's watch has delivered."""

    def __post_init__(self) -> None:
        self.flusher = Flusher(
            self.kube, "ns", self.table, self.ledger, RouterMetrics(self.table), replica=self.name
        )

    def watch(self, everything: bool = False) -> None:
        while self.seen < len(self.kube.events):
            _revision, _plural, kind, obj = self.kube.events[self.seen]
            self.seen += 1
            if kind != "DELETED":
                self.table.apply_session(obj)
            if not everything:
                return

    async def flush(self) -> None:
        self.flusher.start_due()
        await self.flusher.idle()


lossy_steps = st.lists(
    st.one_of(
        st.tuples(st.just("turn"), st.integers(0, 1), usages),
        st.tuples(st.just("flush"), st.integers(0, 1)),
        st.tuples(st.just("applied"), st.integers(0, 1)),
        st.tuples(st.just("dropped"), st.integers(0, 1)),
        st.tuples(st.just("watch"), st.integers(0, 1)),
        st.tuples(st.just("restart"), st.integers(0, 1)),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(lossy_steps)
def test_a_patch_applied_but_its_answer_lost_is_counted_once(
    program: list[tuple[Any, ...]],
) -> None:
    """The real Flusher, two replicas, and writes that land with no answer or never land."""

    async def run() -> tuple[dict[str, Any], list[Usage | None]]:
        kube = AnswerLosingKube()
        kube.put(
            "agentsessions",
            {"metadata": {"name": NAME}, "spec": {"sessionId": NAME, "model": "m"}, "status": {}},
        )
        replicas = [FlushingReplica(kube, "router-a"), FlushingReplica(kube, "router-b")]
        for replica in replicas:
            replica.watch(everything=True)
        answered: list[Usage | None] = []
        restarts = 0
        now = T0
        for step in program:
            now += 1.0
            kind, index = step[0], step[1]
            replica = replicas[index]
            if kind == "turn":
                replica.ledger.record(NAME, turn_totals(step[2], started=now, now=now + 0.5))
                answered.append(step[2])
            elif kind in ("applied", "dropped"):
                kube.fault = kind
                await replica.flush()
                kube.fault = None  # only that flush's PATCH, if it had one
            elif kind == "flush":
                await replica.flush()
            elif kind == "watch":
                replica.watch()
            elif kind == "restart":
                await replica.flusher.flush_all()  # SIGTERM: write what is held
                restarts += 1
                replicas[index] = FlushingReplica(kube, f"router-{index}-{restarts}")
                replicas[index].watch(everything=True)  # LIST on start
        for replica in replicas:
            await replica.flusher.flush_all()
        return kube.obj("agentsessions", NAME)["status"], answered

    status, answered = asyncio.run(run())
    expected_prompt = sum(u.prompt_tokens for u in answered if u)
    expected_cached = sum(min(u.cached_tokens or 0, u.prompt_tokens) for u in answered if u)

    def uncached(u: Usage | None) -> int:
        return 0 if u is None else u.prompt_tokens - min(u.cached_tokens or 0, u.prompt_tokens)

    assert status.get("turns", 0) == len(answered)
    assert status.get("promptTokens", 0) == expected_prompt
    assert status.get("cachedTokens", 0) == expected_cached
    assert status.get("recomputedTokens", 0) == sum(uncached(u) for u in answered[1:])


def test_an_answered_flush_costs_one_patch_and_no_read() -> None:
    """Settling lost answers adds no API call while writes are answered."""

    class CountingKube(AnswerLosingKube):
        gets = 0

        async def get(self, *args: Any, **kw: Any) -> dict[str, Any]:
            self.gets += 1
            return await super().get(*args, **kw)

    async def run() -> None:
        kube = CountingKube()
        kube.put("agentsessions", {"metadata": {"name": NAME}, "spec": {}, "status": {}})
        replica = FlushingReplica(kube, "router-a")
        replica.watch(everything=True)
        for turn in range(5):
            replica.ledger.record(NAME, turn_totals(None, started=T0 + turn, now=T0 + turn))
            await replica.flush()
        assert (len(kube.patches), kube.gets) == (5, 0)
        status = kube.obj("agentsessions", NAME)["status"]
        assert status["turns"] == 5 and list(status["usageWrites"]) == ["router-a"]
        # A lost answer costs the write again at most (here: the status shows it applied,
        # so the next write carries only the new turn).
        kube.fault = "applied"
        replica.ledger.record(NAME, turn_totals(None, started=T0 + 9, now=T0 + 9))
        await replica.flush()
        replica.ledger.record(NAME, turn_totals(None, started=T0 + 10, now=T0 + 10))
        await replica.flush()
        assert kube.obj("agentsessions", NAME)["status"]["turns"] == 7

    asyncio.run(run())
