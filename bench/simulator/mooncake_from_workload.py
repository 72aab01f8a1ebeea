"""Write the synthetic agentic workload as a Mooncake trace (JSONL), for replays elsewhere.

Used to put the same trace through ``sessionfleet simulate --replay`` and through other
simulators (Dynamo's mocker replay, bench/README.md). Root sessions only. Each request's
``hash_ids`` are its prompt's 512-token blocks: the system prompt's blocks are shared by
its prefix group, a session's own blocks are its own, and the last, partial block is new
in every request (its content changes). Times are open loop: a turn is sent its tool
pause after the previous answer would have ended at ``--decode-ms`` per output token.

    python bench/simulator/mooncake_from_workload.py --sessions 200 --rate 0.5 > t.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

from sessionfleet.workload import WorkloadConfig, generate

BLOCK = 512


def main() -> None:
    """Write the trace to stdout."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--rate", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--decode-ms", type=float, default=25.0)
    args = parser.parse_args()
    ids = itertools.count(1)
    groups: dict[str, list[int]] = {}
    config = WorkloadConfig(sessions=args.sessions, arrival_rate=args.rate)
    lines = []
    for session in generate(config, args.seed):
        if session.parent_id is not None:
            continue
        shared_blocks = session.system_prompt_tokens // BLOCK
        group = groups.setdefault(session.prefix_group, [next(ids) for _ in range(shared_blocks)])
        own: list[int] = []
        prompt = session.system_prompt_tokens
        at = session.arrival
        for k, new in enumerate(session.new_tokens):
            if k in session.compactions:
                prompt = session.system_prompt_tokens
                own = []
            prompt += new
            full = prompt // BLOCK
            while shared_blocks + len(own) < full:
                own.append(next(ids))
            hashes = group[:full] + own[: max(0, full - shared_blocks)]
            if prompt % BLOCK:
                hashes.append(next(ids))
            lines.append(
                {
                    "timestamp": round(at * 1000),
                    "input_length": prompt,
                    "output_length": session.output_tokens[k],
                    "hash_ids": hashes,
                    "session_id": session.session_id,
                }
            )
            at += session.output_tokens[k] * args.decode_ms / 1000 + session.pauses[k]
    lines.sort(key=lambda line: line["timestamp"])
    for line in lines:
        sys.stdout.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
