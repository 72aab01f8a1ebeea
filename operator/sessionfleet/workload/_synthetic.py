"""A synthetic agentic workload calibrated to the published Codex traces.

Every figure comes from the vLLM x Mooncake post on Codex + GPT-5.4 running
SWE-bench Pro (610 traces; docs/background.md, "Agentic workloads"):

- a median of 33 turns per session: the turn count is lognormal around 33;
- about 2,242 new prompt tokens per turn on average, heavy-tailed within a session
  (most tool results are short, a few file reads are long) and varying between
  sessions (some agents read far more than others);
- a first prompt of ~12K tokens, so the context grows to ~80K by turn 30, with a
  tail beyond 180K from long sessions;
- input:output tokens 131:1;
- tool pauses of 5.2 s median and 81.4 s at p99: a lognormal fitted to those two
  quantiles;
- Poisson session arrivals.

Two mechanisms are not in the post but shape real agent traffic: child sessions
(subagents, which share their parent's system prompt and, when forked, its whole
context) and context compaction (an agent near its context window replaces the
history with a summary, so the next prompt shares only the system prompt).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from itertools import accumulate

from sessionfleet.api import SessionClient
from sessionfleet.workload._session import Session

# The standard normal quantile at 0.99: a lognormal with median m and p99 q has
# sigma = ln(q / m) / Z99.
Z99 = 2.3263478740408408

# Clients whose headers can say "this session is a child of that one"
# (docs/background.md, "Session identity"):
# Codex sends a session id only.
PARENT_AWARE_CLIENTS = frozenset(
    {SessionClient.CLAUDE_CODE, SessionClient.OPENCODE, SessionClient.HEADER}
)


def lognormal_sigma(median: float, p99: float) -> float:
    """Return the sigma of the lognormal with this median and 99th percentile."""
    if not 0 < median <= p99:
        raise ValueError(f"need 0 < median <= p99, got {median}, {p99}")
    return math.log(p99 / median) / Z99


def _default_clients() -> dict[SessionClient, float]:
    return {
        SessionClient.CODEX: 0.4,
        SessionClient.CLAUDE_CODE: 0.4,
        SessionClient.OPENCODE: 0.1,
        SessionClient.HEADER: 0.1,
    }


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """The distributions of a synthetic workload; defaults follow docs/background.md."""

    sessions: int = 1000
    """Sessions to generate, children included."""
    arrival_rate: float = 0.5
    """Root sessions per second (Poisson arrivals)."""
    turns_median: float = 33.0
    turns_sigma: float = 0.5
    """Lognormal spread of turns per session: 0.5 puts the 5th-95th percentiles at 15-75."""
    turns_max: int = 400
    first_prompt_median: float = 12_000.0
    first_prompt_sigma: float = 0.35
    new_tokens_mean: float = 2_242.0
    new_tokens_sigma: float = 1.0
    """Spread of one turn's growth within a session (tool results are heavy-tailed)."""
    session_rate_sigma: float = 0.3
    """Spread of the mean growth per turn between sessions."""
    system_prompt_tokens: int = 1_100
    """Shared by every session of a client. With the other defaults this is 1.7% of the
    input tokens: the hit rate of the published miss case, where only it stayed cached."""
    input_output_ratio: float = 131.0
    output_sigma: float = 0.8
    pause_median: float = 5.2
    pause_p99: float = 81.4
    pause_max: float = 3_600.0
    compact_above: int = 256_000
    """A prompt that would grow beyond this is compacted; 0 never compacts."""
    child_share: float = 0.1
    """Expected share of all sessions that are children (subagents)."""
    child_fork_share: float = 0.5
    """Share of children that start from their parent's whole prompt (a fork) rather
    than from the system prompt and a task description."""
    child_turns_median: float = 12.0
    child_task_tokens: float = 2_000.0
    clients: Mapping[SessionClient, float] = field(default_factory=_default_clients)
    """Relative weights of the client flavours; each has its own system prompt."""
    model: str = "agent-model"
    nominal_turn_seconds: float = 8.0
    """Only for a child's estimated ``arrival``: the parent's time per turn outside pauses."""
    id_prefix: str = "s"

    def __post_init__(self) -> None:
        if self.sessions < 0:
            raise ValueError("sessions must not be negative")
        if self.arrival_rate <= 0:
            raise ValueError("arrival_rate must be positive")
        if not 0 <= self.child_share < 1:
            raise ValueError("child_share must be in [0, 1)")
        if not self.clients or min(self.clients.values()) < 0:
            raise ValueError("clients needs at least one non-negative weight")
        if self.turns_median < 1 or self.first_prompt_median <= self.system_prompt_tokens:
            raise ValueError("need turns_median >= 1 and a first prompt beyond the system prompt")

    @classmethod
    def back_of_envelope(cls, sessions: int = 1000, **overrides: object) -> WorkloadConfig:
        """Every session exactly as the published per-turn figures describe it.

        33 turns, a 12,000-token first prompt, exactly 2,242 new tokens per turn, no
        children and no compaction: the workload behind the back-of-envelope hit rate
        ``1 - (12,000 + 32 * 2,242) / (33 * 12,000 + 2,242 * 528)`` = 94.7%.
        """
        base = cls(
            sessions=sessions,
            turns_sigma=0.0,
            first_prompt_sigma=0.0,
            new_tokens_sigma=0.0,
            session_rate_sigma=0.0,
            output_sigma=0.0,
            child_share=0.0,
            compact_above=0,
        )
        return replace(base, **overrides)  # type: ignore[arg-type]


class _Draw:
    """Seeded draws: lognormals by their median (or mean) and spread."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def median(self, median: float, sigma: float) -> float:
        """Draw from the lognormal with this median."""
        if sigma == 0.0:
            return median
        return median * math.exp(sigma * self.rng.gauss(0.0, 1.0))

    def mean(self, mean: float, sigma: float) -> float:
        """Draw from the lognormal with this mean (its median is lower by exp(sigma^2 / 2))."""
        if sigma == 0.0:
            return mean
        return mean * math.exp(sigma * self.rng.gauss(0.0, 1.0) - 0.5 * sigma * sigma)

    def poisson(self, mean: float) -> int:
        """Draw from a Poisson distribution (Knuth's method: the means here are small)."""
        limit, count, product = math.exp(-mean), 0, self.rng.random()
        while product > limit:
            count += 1
            product *= self.rng.random()
        return count


def generate(config: WorkloadConfig | None = None, seed: int = 0) -> Iterator[Session]:
    """Yield the sessions of a synthetic workload, reproducibly for a given seed.

    Root sessions come in arrival order; each root's children follow it at once (a
    child starts when its parent finishes turn ``spawn_after_turn``; its ``arrival``
    is only an estimate of that moment). Sessions are generated lazily, so a
    simulation of 100,000 sessions holds only the live ones in memory.
    """
    cfg = config or WorkloadConfig()
    draw = _Draw(seed)
    rng = draw.rng
    clients = list(cfg.clients)
    weights = list(accumulate(cfg.clients[c] for c in clients))
    parent_aware_weight = sum(w for c, w in cfg.clients.items() if c in PARENT_AWARE_CLIENTS)
    parent_aware_share = parent_aware_weight / weights[-1]
    # Children per parent-aware root so that children make up child_share of all sessions.
    children_per_root = (
        cfg.child_share / (parent_aware_share * (1.0 - cfg.child_share))
        if cfg.child_share and parent_aware_share
        else 0.0
    )
    pause_mu = math.log(cfg.pause_median)
    pause_sigma = lognormal_sigma(cfg.pause_median, cfg.pause_p99)

    made = 0
    root_number = 0
    clock = 0.0
    while made < cfg.sessions:
        clock += rng.expovariate(cfg.arrival_rate)
        client = rng.choices(clients, cum_weights=weights)[0]
        turns = _turn_count(draw, cfg.turns_median, cfg)
        first = max(
            cfg.system_prompt_tokens + 1,
            round(draw.median(cfg.first_prompt_median, cfg.first_prompt_sigma)),
        )
        root = _session(
            draw,
            cfg,
            f"{cfg.id_prefix}{root_number:06d}",
            clock,
            client,
            turns,
            first,
            pause_mu,
            pause_sigma,
        )
        root_number += 1
        made += 1
        yield root
        if client not in PARENT_AWARE_CLIENTS or root.turn_count < 2 or not children_per_root:
            continue
        for child_number in range(draw.poisson(children_per_root)):
            if made >= cfg.sessions:
                break
            made += 1
            yield _child(draw, cfg, root, child_number, pause_mu, pause_sigma)


def _turn_count(draw: _Draw, median: float, cfg: WorkloadConfig) -> int:
    return min(cfg.turns_max, max(1, round(draw.median(median, cfg.turns_sigma))))


def _session(
    draw: _Draw,
    cfg: WorkloadConfig,
    session_id: str,
    arrival: float,
    client: SessionClient,
    turns: int,
    first_prompt: int,
    pause_mu: float,
    pause_sigma: float,
    parent: Session | None = None,
    spawn_after_turn: int = 0,
    parent_prefix_tokens: int = 0,
) -> Session:
    """Draw one session's turns: growth, compactions, outputs and pauses."""
    gauss = draw.rng.gauss
    system = cfg.system_prompt_tokens
    rate = draw.mean(cfg.new_tokens_mean, cfg.session_rate_sigma)
    sigma = cfg.new_tokens_sigma
    shift = -0.5 * sigma * sigma
    new_tokens = [first_prompt]
    prompts = [first_prompt]
    compactions: list[int] = []
    prompt = first_prompt
    for k in range(1, turns):
        grow = max(
            1, round(rate * math.exp(sigma * gauss(0.0, 1.0) + shift)) if sigma else round(rate)
        )
        if cfg.compact_above and prompt + grow > cfg.compact_above:
            # The agent summarised its history: the prompt restarts from the system
            # prompt, a summary about as long as a first prompt, and this turn's input.
            compactions.append(k)
            summary = round(draw.median(cfg.first_prompt_median, cfg.first_prompt_sigma))
            grow = max(1, summary - system) + grow
            prompt = system + grow
        else:
            prompt += grow
        new_tokens.append(grow)
        prompts.append(prompt)

    # Output per turn: the session's mean prompt over the input:output ratio, so the
    # workload's totals keep the published 131:1 whatever the turn distribution.
    out_mean = sum(prompts) / turns / cfg.input_output_ratio
    out_sigma = cfg.output_sigma
    out_shift = -0.5 * out_sigma * out_sigma
    output_tokens = [
        max(1, round(out_mean * math.exp(out_sigma * gauss(0.0, 1.0) + out_shift)))
        if out_sigma
        else max(1, round(out_mean))
        for _ in range(turns)
    ]

    pause_max = cfg.pause_max
    pauses = [
        min(pause_max, math.exp(pause_mu + pause_sigma * gauss(0.0, 1.0))) for _ in range(turns - 1)
    ]
    pauses.append(0.0)
    return Session(
        session_id=session_id,
        arrival=arrival,
        new_tokens=tuple(new_tokens),
        output_tokens=tuple(output_tokens),
        pauses=tuple(pauses),
        system_prompt_tokens=system,
        client=client,
        model=cfg.model,
        prefix_group=client.value,
        parent_id=parent.session_id if parent is not None else None,
        spawn_after_turn=spawn_after_turn,
        parent_prefix_tokens=parent_prefix_tokens,
        compactions=tuple(compactions),
    )


def _child(
    draw: _Draw,
    cfg: WorkloadConfig,
    parent: Session,
    number: int,
    pause_mu: float,
    pause_sigma: float,
) -> Session:
    """Draw a subagent of ``parent``, started after one of its turns."""
    rng = draw.rng
    spawn = rng.randint(1, parent.turn_count - 1)
    task = max(1, round(draw.median(cfg.child_task_tokens, 0.5)))
    if rng.random() < cfg.child_fork_share:
        # A fork starts from everything the parent had sent so far.
        shared = parent.prompt_tokens()[spawn - 1]
    else:
        # A fresh subagent shares the system prompt only (through its prefix group).
        shared = 0
    first = max(shared, cfg.system_prompt_tokens) + task
    arrival = parent.arrival + sum(parent.pauses[: spawn - 1]) + spawn * cfg.nominal_turn_seconds
    return _session(
        draw,
        cfg,
        f"{parent.session_id}-c{number}",
        arrival,
        parent.client,
        _turn_count(draw, cfg.child_turns_median, cfg),
        first,
        pause_mu,
        pause_sigma,
        parent=parent,
        spawn_after_turn=spawn,
        parent_prefix_tokens=shared,
    )
