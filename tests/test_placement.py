"""Placement: pins, parent affinity, load balance, the reasons for none; admitting a hint."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from sessionfleet.api import Reason
from sessionfleet.policy.placement import (
    RANK,
    PlacementRequest,
    WorkerLoad,
    admit_or_place,
    place,
)

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
        # excluded workers (being drained) are never chosen
        (PlacementRequest(M, exclude=frozenset({"a"})), [w("a", 0), w("b", 5)], "b", Reason.BOUND),
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
            parent_worker=rng.choice([None] * 3 + names),
            expected_tokens=rng.randrange(400),
            exclude=frozenset(rng.sample(names, rng.randrange(2))),
        )
        hint = rng.choice([None] * 3 + names)
        shuffled = rng.sample(workers, len(workers))
        in_rank_order = sorted(workers, key=RANK)
        ranked = place(request, in_rank_order, ranked=True)
        assert ranked == place(request, shuffled), f"case {case}: {request} {workers}"
        admitted = admit_or_place(request, in_rank_order, hint=hint, ranked=True)
        assert admitted == admit_or_place(request, shuffled, hint=hint), f"case {case}: {hint}"


HINT_REFUSALS = [
    # (the hinted worker as the operator counts it, why it is refused)
    (None, "is no valid InferenceWorker of the session's namespace"),
    (w("a", 0, model="other"), "serves other, not qwen"),
    (w("a", 0, ready=False), "takes no new sessions (not Ready, or asked to drain)"),
    (w("a", 10), "is full (10 of 10 sessions)"),
    (
        w("a", 1, kv_tokens_capacity=100, kv_tokens_pinned=90),
        "is full (90 of 100 KV tokens held, 20 more expected)",
    ),
    (w("a", 1, kv_usage=1.0), "is full (its KV cache is in full use)"),
]


@pytest.mark.parametrize(("hinted", "why"), HINT_REFUSALS)
def test_a_refused_hint_is_placed_again_and_says_why(hinted: WorkerLoad | None, why: str) -> None:
    """kubectl describe says why a session is not bound where its first turn went."""
    workers = [w("b", 6), w("c", 2)] + ([hinted] if hinted is not None else [])
    placement = admit_or_place(PlacementRequest(M, expected_tokens=20), workers, hint="a")
    assert (placement.worker, placement.reason) == ("c", Reason.BOUND)
    assert placement.message == (
        f"placed on the least-loaded worker c; the hinted worker a was not admitted: it {why}"
    )


def test_a_hint_with_room_is_admitted_though_the_operator_would_rank_another_first() -> None:
    """The front placed the first turn there and its KV cache is there: no second ranking."""
    workers = [w("a", 8), w("b", 0)]
    assert place(PlacementRequest(M), workers).worker == "b"
    placement = admit_or_place(PlacementRequest(M, parent_worker="b"), workers, hint="a")
    assert (placement.worker, placement.reason) == ("a", Reason.BOUND)
    assert placement.message == "admitted to the hinted worker a, where its first turn went"


def test_a_refused_hint_falls_back_to_the_parents_worker_then_the_least_loaded() -> None:
    workers = [w("a", 10), w("b", 6), w("c", 2)]
    child = admit_or_place(PlacementRequest(M, parent_worker="b"), workers, hint="a")
    assert child.worker == "b" and child.message.startswith("placed on the parent's worker b;")
    excluded = PlacementRequest(M, exclude=frozenset({"a"}))
    assert admit_or_place(excluded, [w("a", 0), w("c", 2)], hint="a").message.endswith(
        "the hinted worker a was not admitted: it is excluded"
    )


def test_a_pin_wins_over_a_hint_and_no_room_anywhere_keeps_the_refusal() -> None:
    workers = [w("a", 0), w("b", 0)]
    pinned = admit_or_place(PlacementRequest(M, pin="b"), workers, hint="a")
    assert (pinned.worker, pinned.message) == ("b", "pinned to worker b")
    full = [w("a", 10), w("b", 10)]
    waits = admit_or_place(PlacementRequest(M), full, hint="a", ranked=True)
    assert (waits.worker, waits.reason) == (None, Reason.NO_CAPACITY)
    assert waits.message == (
        "all 2 Ready qwen workers are at capacity; "
        "the hinted worker a was not admitted: it is full (10 of 10 sessions)"
    )


def test_without_a_hint_the_operator_places_exactly_as_the_front() -> None:
    workers = [w("a", 5), w("b", 2), w("c", 7)]
    for request in (PlacementRequest(M), PlacementRequest(M, parent_worker="c")):
        assert admit_or_place(request, workers, hint=None) == place(request, workers)
