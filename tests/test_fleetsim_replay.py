"""Replaying block-hash traces: Claude Code JSON and Mooncake JSONL (tests/fixtures/traces)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from sessionfleet.fleetsim import FleetConfig
from sessionfleet.fleetsim._replay import REPLAY_STRATEGIES, replay
from sessionfleet.fleetsim._traces import load_trace, trace_sessions
from sessionfleet.workload import TraceFormatError

TRACES = Path(__file__).parent / "fixtures" / "traces"


def test_claude_code_trace_loads_conversations_and_subagents() -> None:
    """Two conversations, one with a sub-agent: three sessions, 64-token blocks."""
    trace = load_trace([TRACES / "claude-code"])
    assert trace.block_size == 64
    assert trace.sessions == 3
    assert len(trace.requests) == 11
    assert [r.at for r in trace.requests] == sorted(r.at for r in trace.requests)


def test_mooncake_trace_keeps_timestamps_and_512_token_blocks() -> None:
    """Timestamps are milliseconds; the block size is Mooncake's."""
    trace = load_trace([TRACES / "mooncake.jsonl"])
    assert trace.block_size == 512
    assert trace.requests[1].at == 0.5
    assert trace.sessions == 3


def test_recorded_hit_rate_counts_blocks_seen_before() -> None:
    """Hand-checked on a two-request trace: the second reuses 2 of its 3 blocks."""
    trace_file = TRACES / "mooncake.jsonl"
    trace = load_trace([trace_file])
    first = trace.requests[0]
    assert first.hash_ids[:2] == (7, 8)
    assert 0 < trace.recorded_hit_rate() < 1


@pytest.mark.parametrize("path", ["claude-code", "mooncake.jsonl"])
def test_no_strategy_beats_the_traces_own_hit_rate(path: str) -> None:
    """The trace's recorded rate is one unbounded cache: no fleet can hit more."""
    trace = load_trace([TRACES / path])
    recorded = trace.recorded_hit_rate()
    fleet = FleetConfig(workers=2, kv_tokens=100_000)
    rates = {name: replay(trace, name, fleet).hit_rate for name in REPLAY_STRATEGIES}
    assert all(rate <= recorded + 1e-9 for rate in rates.values())
    assert rates["affinity"] > rates["round-robin"]


def test_a_small_cache_evicts_blocks() -> None:
    """With room for a handful of blocks, hits fall below what a big cache gets."""
    trace = load_trace([TRACES / "mooncake.jsonl"])
    big = replay(trace, "affinity", FleetConfig(workers=2, kv_tokens=100_000))
    small = replay(trace, "affinity", FleetConfig(workers=2, kv_tokens=2_048))
    assert small.hit_rate < big.hit_rate


def test_a_bad_trace_line_is_a_clear_error(tmp_path: Path) -> None:
    """A Mooncake line without hash_ids names the file, the line and the fields."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1}) + "\n")
    with pytest.raises(TraceFormatError, match=r"bad.jsonl:1: .*hash_ids"):
        load_trace([bad])


def test_trace_sessions_rebuild_every_prompt_length() -> None:
    """Each session's prompts, rebuilt from new tokens, are the trace's own ``in``."""
    trace = load_trace([TRACES / "claude-code"])
    sessions = {s.session_id: s for s in trace_sessions(trace, model="m")}
    assert set(sessions) == {"conv-a", "conv-b", "conv-a::s1"}
    for name, session in sessions.items():
        recorded = [r.input_tokens for r in trace.requests if r.session == name]
        assert session.prompt_tokens() == recorded
        assert session.model == "m"
    # Every conversation starts with the same three 64-token blocks: the system prompt.
    assert {s.system_prompt_tokens for s in sessions.values()} == {192}


def test_a_broken_block_chain_is_a_compaction(tmp_path: Path) -> None:
    """A request that does not keep the previous one's blocks restarts the context."""
    lines = [
        {"timestamp": 0, "input_length": 1500, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 9000, "input_length": 2000, "output_length": 5, "hash_ids": [1, 2, 3, 4]},
        {"timestamp": 20000, "input_length": 700, "output_length": 5, "hash_ids": [9, 10]},
    ]
    path = tmp_path / "compacted.jsonl"
    path.write_text("".join(json.dumps({**line, "session_id": "c"}) + "\n" for line in lines))
    (session,) = trace_sessions(load_trace([path]))
    assert session.compactions == (2,)
    assert session.prompt_tokens() == [1500, 2000, 700]
    assert session.pauses[0] == pytest.approx(9.0 - 5 * 0.025)


def test_the_demo_driver_replays_a_trace() -> None:
    """demo/run.py --trace drives the sessions the trace holds, under the demo's model."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from demo.driver import replay_workload

    sessions = replay_workload([str(TRACES / "mooncake.jsonl")], model="demo-model")
    assert [s.session_id for s in sessions] == ["x", "y", "z"]
    assert all(s.model == "demo-model" and s.turn_count == 4 for s in sessions)
