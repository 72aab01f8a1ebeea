"""Usage aggregation and flush coalescing, in virtual time."""

from __future__ import annotations

import pytest

from sessionfleet.engines.vllm import Usage
from sessionfleet.fronts.ledger import (
    Totals,
    UsageLedger,
    rfc3339,
    status_patch,
    turn_totals,
    write_marks,
)

T0 = 1_800_000_000.0


def test_many_turns_within_an_interval_make_one_write() -> None:
    ledger = UsageLedger(interval=10)
    for second in range(30):
        ledger.record("s", turn_totals(Usage(100, 1, 90), started=T0 + second, now=T0 + second))
        for name in ledger.due(T0 + second):
            ledger.take(name, T0 + second)
    # Turns every second for 30 s, interval 10 s: written at 0, 10 and 20 only.
    assert ledger.pending("s") == Totals(9, 900, 810, 9, T0 + 29, T0 + 21, 10)
    assert ledger.due(T0 + 29) == []
    assert ledger.due(T0 + 30) == ["s"]


def test_first_write_is_not_delayed_and_sessions_are_independent() -> None:
    ledger = UsageLedger(interval=10)
    ledger.record("a", Totals(turns=1))
    assert ledger.due(T0) == ["a"]
    ledger.take("a", T0)
    ledger.record("a", Totals(turns=1))
    ledger.record("b", Totals(turns=1))
    assert ledger.due(T0 + 1) == ["b"]


def test_an_unanswered_write_is_settled_by_the_id_the_status_shows() -> None:
    ledger = UsageLedger(interval=10)
    ledger.record("s", Totals(turns=2, prompt_tokens=10))
    first = ledger.take("s", T0)
    assert first is not None and ledger.pending("s") is None
    first_id = ledger.next_write_id(T0)
    ledger.unanswered("s", first_id, first)
    # Nothing new, but the unanswered write must be settled: due after the interval.
    assert ledger.due(T0 + 1) == [] and ledger.due(T0 + 10) == ["s"]
    assert ledger.take("s", T0 + 10) == Totals()
    # A status without this replica's id: the write was not applied, write it again.
    assert ledger.confirm("s", None) == Totals(turns=2, prompt_tokens=10)
    second_id = ledger.next_write_id(T0)  # same millisecond: still a larger id
    assert second_id == first_id + 1
    ledger.record("s", Totals(turns=1, prompt_tokens=5))
    fresh = ledger.take("s", T0 + 20)
    assert fresh is not None
    ledger.unanswered("s", second_id, fresh)
    # The first write was applied (the second then got a 409 nobody heard): only the
    # second's delta is still to write.
    assert ledger.confirm("s", first_id) == Totals(turns=1, prompt_tokens=5)
    # The second was applied: nothing is left, and the session is no longer held.
    assert ledger.confirm("s", second_id) == Totals()
    assert len(ledger) == 0 and ledger.take("s", T0 + 30) is None
    ledger.unanswered("s", ledger.next_write_id(T0), Totals(turns=1))
    ledger.forget("s")
    assert len(ledger) == 0 and ledger.due(T0 + 100) == []


def test_write_ids_grow_past_a_predecessor_of_the_same_name() -> None:
    ledger = UsageLedger(interval=10)
    ahead = int(T0 * 1000) + 60_000  # written by a process whose clock was a minute ahead
    assert ledger.next_write_id(T0, after=ahead) == ahead + 1
    assert ledger.next_write_id(T0) == ahead + 2


def test_write_marks_drop_the_stale_ids_of_other_replicas() -> None:
    now_ms = int(T0 * 1000)
    observed = {"gone": now_ms - 3_600_001, "live": now_ms - 5_000, "me": now_ms - 4_000_000}
    assert write_marks(observed, "me", now_ms) == {"gone": None, "me": now_ms}


def test_prune_keeps_memory_bounded() -> None:
    ledger = UsageLedger(interval=10)
    for n in range(100):
        ledger.record(f"s{n}", Totals(turns=1))
        ledger.take(f"s{n}", T0)
    ledger.prune(T0 + 10)
    ledger.record("s1", Totals(turns=1))
    assert ledger.due(T0 + 10) == ["s1"]
    assert len(ledger._flushed_at) == 0


def test_recomputed_tokens_count_after_the_first_turn_only() -> None:
    first = turn_totals(Usage(1000, 5, 0), started=T0, now=T0 + 1)
    second = turn_totals(Usage(1100, 5, 900), started=T0 + 2, now=T0 + 3)
    third = turn_totals(Usage(1200, 5, None), started=T0 + 4, now=T0 + 5)
    assert first.recomputed_tokens == 0
    # Whatever order they are added in, the earliest turn is the first.
    for order in ((first, second, third), (third, second, first), (second, third, first)):
        total = order[0].add(order[1]).add(order[2])
        assert total.recomputed_tokens == 200 + 1200
        assert (total.first_turn_at, total.first_turn_uncached) == (T0, 1000)
    assert second.add(third).recomputed_tokens == 1200  # second is first among them
    assert turn_totals(None, started=T0, now=T0 + 1) == Totals(
        turns=1, last_activity=T0 + 1, first_turn_at=T0
    )
    # An engine that reports more cached than prompt tokens cannot make it negative.
    assert turn_totals(Usage(10, 1, 50), started=T0, now=T0).cached_tokens == 10


def test_status_patch_adds_the_delta_to_what_was_observed() -> None:
    observed = Totals.from_status(
        {
            "turns": 3,
            "promptTokens": 300,
            "cachedTokens": 200,
            "completionTokens": 6,
            "recomputedTokens": 40,
            "lastActivity": "2027-01-15T08:00:00Z",
            "phase": "Bound",
        }
    )
    patch = status_patch(observed, Totals(2, 100, 100, 2, T0, T0 - 5, 0), "42")
    assert patch == {
        "metadata": {"resourceVersion": "42"},
        "status": {
            "turns": 5,
            "promptTokens": 400,
            "cachedTokens": 300,
            "completionTokens": 8,
            "recomputedTokens": 40,
            "hitRatePercent": 75.0,
            "lastActivity": rfc3339(max(T0, observed.last_activity)),
        },
    }
    # A status written before first turns were recorded: its turns all came first.
    assert observed.first_turn_uncached == 300 - 200 - 40
    written = status_patch(Totals(), Totals(1, 100, 0, 1, T0, T0, 100), "1")["status"]
    assert written["firstTurnUncachedTokens"] == 100
    assert Totals.from_status(written).first_turn_at == T0


def test_status_patch_of_nothing_yet() -> None:
    patch = status_patch(Totals(), Totals(turns=1), "1")
    assert patch["status"]["hitRatePercent"] == 0.0
    assert "lastActivity" not in patch["status"]


def test_rfc3339() -> None:
    assert rfc3339(0) == "1970-01-01T00:00:00Z"
    assert Totals.from_status({"lastActivity": rfc3339(T0)}).last_activity == T0
    assert Totals.from_status({"lastActivity": "garbage", "turns": -3}) == Totals()


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError):
        UsageLedger(interval=0)


def test_due_is_bounded_and_oldest_first() -> None:
    ledger = UsageLedger(interval=10)
    for name in ("a", "b", "c"):
        ledger.record(name, Totals(turns=1))
    assert ledger.due(T0, limit=2) == ["a", "b"]
    ledger.take("a", T0)
    ledger.record("a", Totals(turns=1))  # pending again, now behind b and c
    assert ledger.due(T0 + 10, limit=3) == ["b", "c", "a"]
