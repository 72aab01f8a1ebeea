"""Placement: pins, hints, parent affinity, load balance and the reasons for none."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from sessionfleet.api import Reason
from sessionfleet.policy.placement import RANK, PlacementRequest, WorkerLoad, place

M = "qwen"


def w(name: str, pinned: int = 0, cap: int = 10, **kw: object) -> WorkerLoad:
    defaults: dict[str, object] = {"model": M, "ready": True}
    defaults.update(kw)
    return WorkerLoad(name=name, pinned_sessions=pinned, max_sessions=cap, **defaults)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("request_", "workers", "worker", "reason"),
    [
        # least loaded wins
        (PlacementRequest(M), [w("a", 5), w("b", 2), w("c", 7)], "b", Reason.BOUND),
        # load is relative to capacity
        (PlacementRequest(M), [w("a", 5, cap=100), w("b", 2, cap=4)], "a", Reason.BOUND),
        # KV usage counts as load
        (PlacementRequest(M), [w("a", 1, kv_usage=0.9), w("b", 3)], "b", Reason.BOUND),
        # KV tokens against capacity count as load
        (
            PlacementRequest(M),
            [w("a", 1, kv_tokens_capacity=100, kv_tokens_pinned=90), w("b", 3)],
            "b",
            Reason.BOUND,
        ),
        # ties break by name, deterministically
        (PlacementRequest(M), [w("b", 1), w("a", 1)], "a", Reason.BOUND),
        # only Ready workers of the model
        (
            PlacementRequest(M),
            [w("a", 0, ready=False), w("b", 0, model="other"), w("c", 9)],
            "c",
            Reason.BOUND,
        ),
        # hint honoured when it has room, even if busier
        (PlacementRequest(M, hint="a"), [w("a", 8), w("b", 0)], "a", Reason.BOUND),
        # hint ignored when full
        (PlacementRequest(M, hint="a"), [w("a", 10), w("b", 4)], "b", Reason.BOUND),
        # parent's worker for a child
        (PlacementRequest(M, parent_worker="a"), [w("a", 6), w("b", 0)], "a", Reason.BOUND),
        # parent's worker full: least loaded
        (PlacementRequest(M, parent_worker="a"), [w("a", 10), w("b", 5)], "b", Reason.BOUND),
        # a pin is honoured
        (PlacementRequest(M, pin="a"), [w("a", 9), w("b", 0)], "a", Reason.BOUND),
        # a pin never falls back
        (
            PlacementRequest(M, pin="a"),
            [w("a", 10), w("b", 0)],
            None,
            Reason.PINNED_WORKER_UNAVAILABLE,
        ),
        (PlacementRequest(M, pin="zz"), [w("b", 0)], None, Reason.PINNED_WORKER_UNAVAILABLE),
        # excluded workers (being drained) are never chosen, even as hint
        (
            PlacementRequest(M, hint="a", exclude=frozenset({"a"})),
            [w("a", 0), w("b", 5)],
            "b",
            Reason.BOUND,
        ),
        # nothing Ready
        (PlacementRequest(M), [w("a", 0, ready=False)], None, Reason.NO_READY_WORKER),
        (PlacementRequest(M), [], None, Reason.NO_READY_WORKER),
        # everything full
        (PlacementRequest(M), [w("a", 10), w("b", 10)], None, Reason.NO_CAPACITY),
        # a long context does not fit the KV left
        (
            PlacementRequest(M, expected_tokens=50),
            [w("a", 0, kv_tokens_capacity=100, kv_tokens_pinned=60)],
            None,
            Reason.NO_CAPACITY,
        ),
    ],
)
def test_place(
    request_: PlacementRequest, workers: list[WorkerLoad], worker: str | None, reason: Reason
) -> None:
    placement = place(request_, workers)
    assert (placement.worker, placement.reason) == (worker, reason), placement.message
    assert placement.placed is (worker is not None)
    assert placement.message


def test_repeated_placement_balances_sessions() -> None:
    workers = {name: w(name, 0, cap=100) for name in "abcd"}
    for _ in range(40):
        chosen = place(PlacementRequest(M), workers.values()).worker
        assert chosen is not None
        workers[chosen] = replace(
            workers[chosen], pinned_sessions=workers[chosen].pinned_sessions + 1
        )
    assert {x.pinned_sessions for x in workers.values()} == {10}


def test_a_workers_load_is_its_most_constrained_resource_and_follows_a_replace() -> None:
    assert w("a", 5).load == 0.5
    assert w("a", 1, kv_usage=0.7).load == 0.7
    assert w("a", 1, kv_tokens_capacity=100, kv_tokens_pinned=90).load == 0.9
    assert w("a", 0, cap=0).load == 1.0  # no capacity: full
    moved = replace(w("a", 5), pinned_sessions=8)
    assert moved.load == 0.8  # worked out again, not copied
    assert moved == w("a", 8) and "load" not in repr(moved)


def test_placing_from_workers_in_rank_order_chooses_as_looking_at_every_worker() -> None:
    rng = random.Random(11)
    for case in range(2000):
        workers = [
            WorkerLoad(
                name=f"w{i}",
                model=rng.choice([M, "other"]),
                ready=rng.random() < 0.8,
                pinned_sessions=rng.randrange(6),
                max_sessions=rng.randrange(6),
                kv_tokens_capacity=rng.choice([0, 1000]),
                kv_tokens_pinned=rng.randrange(1000),
                kv_usage=rng.choice([0.0, rng.random(), 1.0]),
            )
            for i in range(rng.randrange(8))
        ]
        names = [x.name for x in workers] or ["w0"]
        request = PlacementRequest(
            M,
            pin=rng.choice([None] * 6 + names),
            hint=rng.choice([None] * 3 + names),
            parent_worker=rng.choice([None] * 3 + names),
            expected_tokens=rng.randrange(400),
            exclude=frozenset(rng.sample(names, rng.randrange(2))),
        )
        shuffled = rng.sample(workers, len(workers))
        ranked = place(request, sorted(workers, key=RANK), ranked=True)
        assert ranked == place(request, shuffled), f"case {case}: {request} {workers}"
