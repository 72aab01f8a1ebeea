"""Agent traces whose prompts are chains of KV block hashes: Claude Code and Mooncake.

Two public formats record, for each request, the hashes of its prompt's KV blocks, so
that a replay gets its cache hits from the blocks themselves rather than from a model:

- **Claude Code traces** (the format AIPerf replays as "Weka agentic coding traces"):
  one JSON object per conversation, ``block_size`` (64) and ``requests``, each request
  with ``t`` (seconds from the start of the conversation), ``in`` and ``out`` (tokens),
  ``hash_ids`` (one per 64-token block of the prompt), ``input_types`` and
  ``output_types``; an entry of ``type`` ``subagent`` holds a sub-agent's own
  ``requests``, replayed as a session of its own on the same clock.
- **Mooncake traces**: JSON lines with ``timestamp`` (milliseconds), ``input_length``,
  ``output_length`` and ``hash_ids`` of 512-token blocks, optionally ``session_id``.

Both load into :class:`TraceRequest` records in time order;
:func:`trace_sessions` turns them into agent sessions for drivers that send real prompts
(the demo driver, ``demo/run.py --trace``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from sessionfleet.workload import Session, TraceFormatError

CLAUDE_CODE_BLOCK = 64
MOONCAKE_BLOCK = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: when, whose, how long, and its prompt's block hashes."""

    at: float
    session: str
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Trace:
    """A loaded trace: its requests in time order and the block size of its hashes."""

    requests: tuple[TraceRequest, ...]
    block_size: int
    source: str

    @property
    def sessions(self) -> int:
        """Return how many sessions (conversations and sub-agents) the trace holds."""
        return len({r.session for r in self.requests})

    def recorded_hit_rate(self) -> float:
        """Share of prompt tokens whose blocks the trace had seen before, anywhere.

        What one worker with an unbounded cache would hit: each request's leading run
        of block hashes seen in any earlier request, short of the prompt's last token
        (which an engine always computes).
        """
        seen: set[int] = set()
        hit = total = 0
        for request in self.requests:
            hit += cached_prefix(request, seen.__contains__, self.block_size)
            total += request.input_tokens
            seen.update(request.hash_ids)
        return hit / total if total else 0.0


def cached_prefix(request: TraceRequest, holds: object, block_size: int) -> int:
    """Return the tokens of the request's prompt held, block by block from the first."""
    contains = holds  # a callable: block hash -> bool
    limit = (request.input_tokens - 1) // block_size
    blocks = 0
    for block in request.hash_ids[:limit]:
        if not contains(block):  # type: ignore[operator]
            break
        blocks += 1
    return blocks * block_size


def load_trace(
    paths: Sequence[str | Path], *, rate: float = 0.1, seed: int = 1, time_scale: float = 1.0
) -> Trace:
    """Load Claude Code JSON files (or folders of them) or one Mooncake JSONL file.

    Claude Code conversations carry only times relative to their own start: they start
    one after another as a Poisson process of ``rate`` per second (seeded). Mooncake
    requests keep their recorded timestamps. ``time_scale`` multiplies every time (0.5
    replays twice as fast).
    """
    files: list[Path] = []
    for path in map(Path, paths):
        files.extend(sorted(path.glob("*.json*")) if path.is_dir() else [path])
    if not files:
        raise TraceFormatError(f"no trace files in {', '.join(map(str, paths))}")
    if time_scale <= 0:
        raise ValueError("time_scale must be positive")
    if all(f.suffix == ".jsonl" for f in files):
        requests = [r for f in files for r in _mooncake(f)]
        block = MOONCAKE_BLOCK
    else:
        rng = random.Random(seed)
        start = 0.0
        requests = []
        block = CLAUDE_CODE_BLOCK
        for f in files:
            document = _json(f)
            block = int(str(document.get("block_size", CLAUDE_CODE_BLOCK)))
            requests.extend(_claude_code(document, f.stem, start))
            start += rng.expovariate(rate)
    requests.sort(key=lambda r: r.at)
    scaled = tuple(
        TraceRequest(r.at * time_scale, r.session, r.input_tokens, r.output_tokens, r.hash_ids)
        for r in requests
    )
    return Trace(scaled, block, ", ".join(str(f) for f in files[:3]))


def _json(path: Path) -> dict[str, object]:
    try:
        document = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(document, dict) or not isinstance(document.get("requests"), list):
        raise TraceFormatError(f"{path}: a Claude Code trace is an object with 'requests'")
    return document


def _claude_code(document: dict[str, object], name: str, start: float) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    subagents = 0

    def walk(entries: Iterable[object], session: str) -> None:
        nonlocal subagents
        for index, entry in enumerate(entries):
            if not isinstance(entry, dict):
                raise TraceFormatError(f"{name}: request {index} of {session} is not an object")
            if entry.get("type") == "subagent":
                subagents += 1
                walk(entry.get("requests") or [], f"{name}::s{subagents}")
                continue
            try:
                out.append(
                    TraceRequest(
                        start + float(entry["t"]),
                        session,
                        int(entry["in"]),
                        int(entry["out"]),
                        tuple(int(h) for h in entry["hash_ids"]),
                    )
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise TraceFormatError(
                    f"{name}: request {index} of {session} needs t, in, out and hash_ids ({exc})"
                ) from None

    walk(document["requests"], name)  # type: ignore[arg-type]
    return out


def _mooncake(path: Path) -> list[TraceRequest]:
    out = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            out.append(
                TraceRequest(
                    float(entry["timestamp"]) / 1000.0,
                    str(entry.get("session_id", f"{path.stem}:{number}")),
                    int(entry["input_length"]),
                    int(entry["output_length"]),
                    tuple(int(h) for h in entry["hash_ids"]),
                )
            )
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise TraceFormatError(
                f"{path}:{number}: a Mooncake line needs timestamp, input_length, "
                f"output_length and hash_ids ({exc})"
            ) from None
    return out


def trace_sessions(
    trace: Trace, *, model: str = "agent-model", decode_seconds_per_token: float = 0.025
) -> list[Session]:
    """Turn a trace's requests into agent sessions, for drivers that send real prompts.

    Requests of one session become its turns. A turn whose blocks extend the previous
    turn's full blocks appends to the conversation; any other is a compaction (the
    context restarts from the system prompt). The system prompt is the run of leading
    blocks that the session's first request shares with every other session starting
    with the same block (its prefix group). A tool pause is the recorded gap between two
    requests less the answer's decoding at ``decode_seconds_per_token``. Sub-agents
    become sessions of their own (their tie to the parent is not kept).
    """
    block = trace.block_size
    by_session: dict[str, list[TraceRequest]] = {}
    for request in trace.requests:
        by_session.setdefault(request.session, []).append(request)
    firsts = {name: requests[0].hash_ids for name, requests in by_session.items()}
    shared_by_group: dict[int, tuple[int, ...]] = {}
    for chain in firsts.values():
        if chain:
            known = shared_by_group.get(chain[0])
            shared_by_group[chain[0]] = chain if known is None else _common(known, chain)
    sessions = []
    for name, requests in by_session.items():
        head = firsts[name]
        group = head[0] if head else None
        members = sum(1 for chain in firsts.values() if chain and chain[0] == group)
        shared = len(shared_by_group[group]) if group is not None and members > 1 else 0
        system = min(shared * block, max(requests[0].input_tokens - 1, 0))
        new_tokens, compactions = [], []
        previous: TraceRequest | None = None
        for k, request in enumerate(requests):
            if previous is None:
                new_tokens.append(max(1, request.input_tokens))  # the system prompt included
            elif (
                _extends(previous, request, block) and request.input_tokens > previous.input_tokens
            ):
                new_tokens.append(request.input_tokens - previous.input_tokens)
            else:
                compactions.append(k)
                new_tokens.append(max(1, request.input_tokens - system))
            previous = request
        pauses = [
            max(0.0, after.at - before.at - before.output_tokens * decode_seconds_per_token)
            for before, after in zip(requests, requests[1:], strict=False)
        ]
        sessions.append(
            Session(
                session_id=name,
                arrival=requests[0].at,
                new_tokens=tuple(new_tokens),
                output_tokens=tuple(max(1, r.output_tokens) for r in requests),
                pauses=(*pauses, 0.0),
                system_prompt_tokens=system,
                model=model,
                prefix_group=f"trace-{group}" if shared else name,
                compactions=tuple(compactions),
            )
        )
    sessions.sort(key=lambda session: session.arrival)
    return sessions


def _common(first: tuple[int, ...], second: tuple[int, ...]) -> tuple[int, ...]:
    length = 0
    for a, b in zip(first, second, strict=False):
        if a != b:
            break
        length += 1
    return first[:length]


def _extends(previous: TraceRequest, request: TraceRequest, block: int) -> bool:
    """Whether ``request`` keeps every full block of ``previous`` as its prefix."""
    full = previous.input_tokens // block
    return request.hash_ids[:full] == previous.hash_ids[:full]
