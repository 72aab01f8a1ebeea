"""Agentic workloads: synthetic sessions calibrated to published traces, and trace files.

The fleet simulator, the demo and the benchmarks all drive the system with these
sessions. A :class:`Session` holds its turns column-wise (new prompt tokens, output
tokens and the tool pause after each turn), its parent for subagents, its arrival
time and the client flavour whose headers identify it::

    from sessionfleet.workload import WorkloadConfig, generate

    for session in generate(WorkloadConfig(sessions=100), seed=1):
        print(session.session_id, session.turn_count, session.prompt_tokens()[-1])

Token counts use :func:`count_tokens`, a deterministic approximation (four
characters per token) that every component shares.
"""

from sessionfleet.workload._session import Session, Turn, session_headers
from sessionfleet.workload._sharegpt import (
    TraceFormatError,
    load_sharegpt,
    read_rows,
    sessions_from_rows,
)
from sessionfleet.workload._synthetic import (
    PARENT_AWARE_CLIENTS,
    WorkloadConfig,
    generate,
    lognormal_sigma,
)
from sessionfleet.workload._tokens import CHARS_PER_TOKEN, count_tokens, tokenize

__all__ = [
    "CHARS_PER_TOKEN",
    "PARENT_AWARE_CLIENTS",
    "Session",
    "TraceFormatError",
    "Turn",
    "WorkloadConfig",
    "count_tokens",
    "generate",
    "load_sharegpt",
    "lognormal_sigma",
    "read_rows",
    "session_headers",
    "sessions_from_rows",
    "tokenize",
]
