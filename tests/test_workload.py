"""The synthetic workload: reproducible, and calibrated to the published Codex figures."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest

from sessionfleet.api import SessionClient
from sessionfleet.workload import (
    PARENT_AWARE_CLIENTS,
    Session,
    WorkloadConfig,
    count_tokens,
    generate,
    lognormal_sigma,
    session_headers,
    tokenize,
)


@pytest.fixture(scope="module")
def sessions() -> list[Session]:
    return list(generate(WorkloadConfig(sessions=4000), seed=7))


def test_same_seed_same_workload() -> None:
    config = WorkloadConfig(sessions=50)
    assert list(generate(config, seed=3)) == list(generate(config, seed=3))
    assert list(generate(config, seed=3)) != list(generate(config, seed=4))


def test_generation_is_lazy() -> None:
    # A billion sessions would never fit: taking a few must not generate them all.
    first = list(itertools.islice(generate(WorkloadConfig(sessions=10**9), seed=1), 3))
    assert len(first) == 3


def test_session_count_includes_children(sessions: list[Session]) -> None:
    assert len(sessions) == 4000


def test_turns_median_33_with_a_spread(sessions: list[Session]) -> None:
    turns = [s.turn_count for s in sessions if s.parent_id is None]
    assert statistics.median(turns) == pytest.approx(33, abs=2)
    deciles = statistics.quantiles(turns, n=10)
    assert deciles[0] < 22 and deciles[-1] > 50  # a realistic spread, not all 33


def test_new_tokens_per_turn_average_2242(sessions: list[Session]) -> None:
    growth = [n for s in sessions for n in s.new_tokens[1:]]
    assert statistics.fmean(growth) == pytest.approx(2242, rel=0.06)
    # Heavy-tailed within sessions: most turns add less than the mean.
    assert statistics.median(growth) < 0.8 * statistics.fmean(growth)


def test_context_grows_from_12k_to_80k_with_a_long_tail(sessions: list[Session]) -> None:
    roots = [s for s in sessions if s.parent_id is None]
    first = [s.prompt_tokens()[0] for s in roots]
    assert statistics.median(first) == pytest.approx(12_000, rel=0.08)
    at_30 = [s.prompt_tokens()[29] for s in roots if s.turn_count >= 30]
    assert 65_000 < statistics.median(at_30) < 90_000
    longest = [max(s.prompt_tokens()) for s in sessions]
    beyond = sum(tokens > 180_000 for tokens in longest) / len(longest)
    assert 0.01 < beyond < 0.2


def test_input_output_ratio_131(sessions: list[Session]) -> None:
    prompt = sum(s.input_tokens for s in sessions)
    output = sum(s.total_output_tokens for s in sessions)
    assert prompt / output == pytest.approx(131, rel=0.06)


def test_system_prompt_is_the_published_miss_rate_of_the_input(sessions: list[Session]) -> None:
    # Published: 1.7% hit rate when only the system prompt stayed cached.
    system = sum(s.system_prompt_tokens * s.turn_count for s in sessions)
    assert system / sum(s.input_tokens for s in sessions) == pytest.approx(0.017, abs=0.003)


def test_tool_pauses_5_2s_median_81_4s_p99(sessions: list[Session]) -> None:
    pauses = [p for s in sessions for p in s.pauses[:-1]]
    assert all(s.pauses[-1] == 0.0 for s in sessions)
    assert statistics.median(pauses) == pytest.approx(5.2, rel=0.05)
    assert statistics.quantiles(pauses, n=100)[98] == pytest.approx(81.4, rel=0.12)


def test_lognormal_sigma_fits_two_quantiles() -> None:
    sigma = lognormal_sigma(5.2, 81.4)
    p99 = 5.2 * math.exp(sigma * statistics.NormalDist().inv_cdf(0.99))
    assert p99 == pytest.approx(81.4)
    with pytest.raises(ValueError):
        lognormal_sigma(10, 5)


def test_poisson_arrivals(sessions: list[Session]) -> None:
    roots = [s.arrival for s in sessions if s.parent_id is None]
    assert roots == sorted(roots)
    gaps = [b - a for a, b in itertools.pairwise(roots)]
    assert statistics.fmean(gaps) == pytest.approx(1 / 0.5, rel=0.08)
    # Exponential gaps: the standard deviation equals the mean.
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.1)


def test_children_follow_their_parent_and_share_its_context(sessions: list[Session]) -> None:
    children = [s for s in sessions if s.parent_id is not None]
    assert len(children) / len(sessions) == pytest.approx(0.1, abs=0.025)
    by_id = {s.session_id: s for s in sessions}
    position = {s.session_id: i for i, s in enumerate(sessions)}
    forks = 0
    for child in children:
        parent = by_id[child.parent_id]  # type: ignore[index]
        assert position[parent.session_id] < position[child.session_id]
        assert parent.client in PARENT_AWARE_CLIENTS and child.client == parent.client
        assert 1 <= child.spawn_after_turn < parent.turn_count
        if child.parent_prefix_tokens:
            forks += 1
            # A fork starts with the parent's whole prompt at the spawn turn.
            assert child.parent_prefix_tokens == parent.prompt_tokens()[child.spawn_after_turn - 1]
            assert child.new_tokens[0] > child.parent_prefix_tokens
    assert 0.3 < forks / len(children) < 0.7


def test_client_mix_and_system_prompt_groups(sessions: list[Session]) -> None:
    clients = {client: sum(s.client is client for s in sessions) for client in SessionClient}
    assert clients[SessionClient.CODEX] > 0.3 * len(sessions)
    assert clients[SessionClient.API] == 0
    assert all(s.prefix_group == s.client.value for s in sessions)
    assert all(s.new_tokens[0] > s.system_prompt_tokens for s in sessions)


def test_compaction_restarts_the_context(sessions: list[Session]) -> None:
    compacted = [s for s in sessions if s.compactions]
    assert compacted, "the long tail should reach the compaction threshold"
    for session in compacted:
        prompts = session.prompt_tokens()
        for k in session.compactions:
            assert prompts[k] < prompts[k - 1]
            assert prompts[k] == session.system_prompt_tokens + session.new_tokens[k]
    assert max(max(s.prompt_tokens()) for s in sessions) <= 256_000 + 120_000


def test_back_of_envelope_workload_is_exact() -> None:
    sessions = list(generate(WorkloadConfig.back_of_envelope(20), seed=1))
    for session in sessions:
        assert session.turn_count == 33
        assert session.new_tokens == (12_000,) + (2_242,) * 32
        assert session.parent_id is None and not session.compactions
    prompts = sessions[0].prompt_tokens()
    assert prompts[-1] == 12_000 + 32 * 2_242
    uncached = 12_000 + 32 * 2_242
    assert 1 - uncached / sum(prompts) == pytest.approx(0.947, abs=0.0005)


def test_turn_rows_match_the_columns() -> None:
    session = next(iter(generate(WorkloadConfig(sessions=1), seed=2)))
    rows = session.turns
    assert [t.prompt_tokens for t in rows] == session.prompt_tokens()
    assert [t.output_tokens for t in rows] == list(session.output_tokens)
    assert rows[-1].pause_after == 0.0 and rows[0].index == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"new_tokens": ()}, "no turns"),
        ({"pauses": (1.0,)}, "one entry per turn"),
        ({"system_prompt_tokens": 500}, "shorter than the system prompt"),
        ({"parent_prefix_tokens": 50}, "without a parent"),
        ({"compactions": (0,)}, "compaction outside"),
    ],
)
def test_session_validation(kwargs: dict[str, object], message: str) -> None:
    fields: dict[str, object] = {
        "session_id": "s",
        "arrival": 0.0,
        "new_tokens": (100, 20),
        "output_tokens": (5, 5),
        "pauses": (1.0, 0.0),
        "system_prompt_tokens": 10,
    }
    fields.update(kwargs)
    with pytest.raises(ValueError, match=message):
        Session(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("client", "parent", "expected"),
    [
        (SessionClient.CLAUDE_CODE, None, {"x-claude-code-session-id": "c"}),
        (
            SessionClient.CLAUDE_CODE,
            "p",
            {"x-claude-code-agent-id": "c", "x-claude-code-parent-agent-id": "p"},
        ),
        (SessionClient.CODEX, None, {"session-id": "c"}),
        (SessionClient.OPENCODE, "p", {"x-session-id": "c", "x-parent-session-id": "p"}),
        (SessionClient.HEADER, None, {"X-Session-Id": "c"}),
    ],
)
def test_session_headers(
    client: SessionClient, parent: str | None, expected: dict[str, str]
) -> None:
    session = Session(
        session_id="c",
        arrival=0.0,
        new_tokens=(100,),
        output_tokens=(5,),
        pauses=(0.0,),
        system_prompt_tokens=10,
        client=client,
        parent_id=parent,
    )
    assert session_headers(session) == expected


def test_tokenizer_counts_and_is_prefix_stable() -> None:
    assert count_tokens("") == 0 and tokenize("") == []
    assert count_tokens("abcd") == 1 and count_tokens("abcde") == 2
    text = "def main():\n    return 42  # the answer\n" * 5
    pieces = tokenize(text)
    assert len(pieces) == count_tokens(text) and "".join(pieces) == text
    longer = tokenize(text + "more text appended by the next turn")
    whole = len(text) // 4
    assert longer[:whole] == pieces[:whole]
