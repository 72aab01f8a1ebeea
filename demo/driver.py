"""Drive a synthetic agentic workload through the router over real HTTP.

Sessions come from :mod:`sessionfleet.workload` scaled down to minutes (or seconds in
fast mode). Each turn re-sends the whole conversation, with the client's own session
headers; the last turn carries ``X-Session-Final: true``. Every answer is recorded:
status, prompt and cached tokens, and the worker that served it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from sessionfleet.fleetsim import load_trace, trace_sessions
from sessionfleet.workload import (
    CHARS_PER_TOKEN,
    Session,
    WorkloadConfig,
    generate,
    session_headers,
)

RETRYABLE = frozenset({429, 502, 503, 504})
"""Statuses a turn is retried on (a held session, a worker being replaced)."""


def workload_config(sessions: int, *, fast: bool, model: str) -> WorkloadConfig:
    """Return the demo's workload: the published shape, scaled down to fit minutes on 2 cores."""
    return WorkloadConfig(
        sessions=sessions,
        arrival_rate=2.0 if fast else 0.5,
        turns_median=10.0 if fast else 16.0,
        turns_max=16 if fast else 40,
        first_prompt_median=1_500.0,
        new_tokens_mean=250.0,
        system_prompt_tokens=400,
        pause_median=0.8 if fast else 3.0,
        pause_max=3.0 if fast else 15.0,
        child_share=0.2,
        child_turns_median=4.0,
        child_task_tokens=300.0,
        model=model,
        nominal_turn_seconds=0.2,
        id_prefix="demo",
    )


def make_workload(sessions: int, *, fast: bool, model: str, seed: int) -> list[Session]:
    """Generate the sessions (roots and their children) for one demo run."""
    return list(generate(workload_config(sessions, fast=fast, model=model), seed=seed))


def replay_workload(
    paths: Sequence[str], *, model: str, time_scale: float = 1.0, seed: int = 1
) -> list[Session]:
    """Sessions replayed from Claude Code or Mooncake traces (block-hash prefixes)."""
    trace = load_trace(paths, seed=seed, time_scale=time_scale)
    return trace_sessions(trace, model=model)


def filler(tag: str, tokens: int) -> str:
    """Text of about ``tokens`` tokens, unique to ``tag`` (so caches are per session)."""
    unit = f"{tag} lorem ipsum dolor sit amet; "
    chars = max(tokens, 1) * CHARS_PER_TOKEN
    return (unit * (chars // len(unit) + 1))[:chars]


@dataclass
class TurnRecord:
    """What one turn of one session got back."""

    session_id: str
    index: int
    status: int
    attempts: int
    worker: str
    prompt_tokens: int
    cached_tokens: int
    started: float
    finished: float


@dataclass
class SessionRun:
    """A session as the driver ran it."""

    session: Session
    turns: list[TurnRecord] = field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        """Every turn was answered with a 200."""
        return (
            not self.error
            and len(self.turns) == self.session.turn_count
            and all(t.status == 200 for t in self.turns)
        )


@dataclass
class Driver:
    """Runs sessions concurrently against ``router_url``; ``clock`` is the run's clock."""

    router_url: str
    sessions: Sequence[Session]
    model: str
    clock: Callable[[], float] = time.monotonic
    max_attempts: int = 40
    runs: dict[str, SessionRun] = field(default_factory=dict)
    _spawned: dict[tuple[str, int], asyncio.Event] = field(default_factory=dict)

    @property
    def total_turns(self) -> int:
        """Turns of the whole workload."""
        return sum(s.turn_count for s in self.sessions)

    @property
    def done_turns(self) -> int:
        """Turns answered so far."""
        return sum(len(r.turns) for r in self.runs.values())

    def active(self) -> int:
        """Sessions started and not finished."""
        return sum(1 for r in self.runs.values() if r.turns and len(r.turns) < r.session.turn_count)

    async def run(self) -> dict[str, SessionRun]:
        """Run every session to its end; returns the runs by session id."""
        for s in self.sessions:
            self.runs[s.session_id] = SessionRun(s)
            if s.parent_id is not None:
                self._spawned.setdefault((s.parent_id, s.spawn_after_turn), asyncio.Event())
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=90, limits=limits) as client:
            await asyncio.gather(*(self._session(client, s) for s in self.sessions))
        return self.runs

    async def _session(self, client: httpx.AsyncClient, session: Session) -> None:
        run = self.runs[session.session_id]
        if session.parent_id is not None:
            await self._spawned[(session.parent_id, session.spawn_after_turn)].wait()
        else:
            await asyncio.sleep(max(0.0, session.arrival - self.clock()))
        system = filler(f"system-{session.prefix_group or 'agent'}", session.system_prompt_tokens)
        history: list[dict[str, str]] = [{"role": "system", "content": system}]
        headers = session_headers(session)
        prompts = session.prompt_tokens()
        try:
            for k in range(session.turn_count):
                new = prompts[k] - (prompts[k - 1] if k else session.system_prompt_tokens)
                if k in session.compactions:
                    history = history[:1]
                    new = session.new_tokens[k]
                history.append(
                    {"role": "user", "content": filler(f"{session.session_id}-t{k}", max(new, 8))}
                )
                last = k == session.turn_count - 1
                record, content = await self._turn(
                    client,
                    session,
                    k,
                    history,
                    {**headers, **({"X-Session-Final": "true"} if last else {})},
                )
                run.turns.append(record)
                if record.status != 200:
                    run.error = f"turn {k}: HTTP {record.status}"
                    return
                history.append({"role": "assistant", "content": content})
                event = self._spawned.get((session.session_id, k + 1))
                if event is not None:
                    event.set()
                await asyncio.sleep(session.pauses[k])
        except Exception as error:
            run.error = f"{type(error).__name__}: {error}"
        finally:
            # Children waiting on a turn this session never reached start anyway.
            for (parent, _), event in self._spawned.items():
                if parent == session.session_id:
                    event.set()

    async def _turn(
        self,
        client: httpx.AsyncClient,
        session: Session,
        index: int,
        history: list[dict[str, str]],
        headers: dict[str, str],
    ) -> tuple[TurnRecord, str]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": history,
            "max_tokens": max(1, min(session.output_tokens[index], 32)),
        }
        started = self.clock()
        status, attempts = 0, 0
        answer: dict[str, Any] = {}
        worker = ""
        while attempts < self.max_attempts:
            attempts += 1
            try:
                response = await client.post(
                    f"{self.router_url}/v1/chat/completions", json=body, headers=headers
                )
            except httpx.TransportError:
                status = 0
                await asyncio.sleep(0.5)
                continue
            status = response.status_code
            if status == 200:
                answer = response.json()
                worker = response.headers.get("x-sessionfleet-worker", "")
                break
            if (
                status not in RETRYABLE
                or response.headers.get("x-sessionfleet-reason") == "session_finished"
            ):
                break
            await asyncio.sleep(min(2.0, 0.25 * attempts))
        usage = answer.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        content = ""
        if answer.get("choices"):
            content = str(answer["choices"][0]["message"].get("content") or "")
        record = TurnRecord(
            session_id=session.session_id,
            index=index,
            status=status,
            attempts=attempts,
            worker=worker,
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            cached_tokens=int(details.get("cached_tokens") or 0),
            started=started,
            finished=self.clock(),
        )
        return record, content
