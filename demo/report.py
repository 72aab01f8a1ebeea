"""The demo's report: figures computed from what the driver and the cluster recorded.

:func:`build_report` is pure (plain data in, a JSON-able dict out) so that it can be
tested without a cluster; :func:`render_text`, :func:`render_markdown` and
:func:`render_png` present it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from demo.driver import SessionRun, TurnRecord

CACHE_SLACK_TOKENS = 128
"""How far below its prefix a turn's cached tokens may be and still count as served from cache:
one block, since engines cache whole blocks only (vLLM's CPU build 128 tokens, the
simulated engine 64)."""


def _prefix(previous: TurnRecord) -> int:
    """Tokens of a session's context the cache could hold before its next turn."""
    return previous.prompt_tokens


def _first_turns_after(runs: Mapping[str, SessionRun], pick: Any) -> list[dict[str, Any]]:
    """For each session, its first turn for which ``pick(previous, turn)`` is true."""
    out = []
    for sid, run in runs.items():
        for previous, turn in zip(run.turns, run.turns[1:], strict=False):
            if turn.status == 200 and previous.status == 200 and pick(previous, turn):
                prefix = _prefix(previous)
                out.append(
                    {
                        "session": sid,
                        "turn": turn.index,
                        "from": previous.worker,
                        "to": turn.worker,
                        "prefix_tokens": prefix,
                        "cached_tokens": turn.cached_tokens,
                        "recomputed_tokens": max(0, prefix - turn.cached_tokens),
                        "from_cache": turn.cached_tokens >= prefix - CACHE_SLACK_TOKENS,
                    }
                )
                break
    return out


def build_report(
    runs: Mapping[str, SessionRun],
    *,
    drain: Mapping[str, Any],
    failures: Sequence[Mapping[str, Any]],
    simulator: Sequence[Mapping[str, Any]],
    settings: Mapping[str, Any],
) -> dict[str, Any]:
    """Compute the report.

    Args:
        runs: the driver's sessions.
        drain: ``node``, ``workers`` (drained), ``started``/``ended`` (run clock),
            ``held`` (the eviction was refused while sessions were pinned),
            ``pinned_at_start``, ``migrated``, ``released``, ``completed``.
        failures: one per killed engine: ``worker``, ``checkpoints`` (on or off),
            ``killed``/``ready`` (run clock), ``epoch_before``, ``epoch_after``,
            ``restore_count``.
        simulator: one dict per strategy (``SimResult.as_dict()``).
        settings: how the demo ran (sessions, fast, checkpoints, drain mode...).

    """
    sessions: list[dict[str, Any]] = []
    for sid, run in sorted(runs.items()):
        turns = run.turns
        prompt = sum(t.prompt_tokens for t in turns)
        cached = sum(t.cached_tokens for t in turns)
        sessions.append(
            {
                "session": sid,
                "client": str(run.session.client.value),
                "parent": run.session.parent_id or "",
                "turns": sum(1 for t in turns if t.status == 200),
                "planned_turns": run.session.turn_count,
                "retries": sum(t.attempts - 1 for t in turns),
                "prompt_tokens": prompt,
                "cached_tokens": cached,
                "hit_rate": cached / prompt if prompt else 0.0,
                "recomputed_tokens": sum(t.prompt_tokens - t.cached_tokens for t in turns[1:]),
                "workers": sorted({t.worker for t in turns if t.worker}),
                "ok": run.ok,
                "error": run.error,
            }
        )
    prompt_all = sum(s["prompt_tokens"] for s in sessions)
    cached_all = sum(s["cached_tokens"] for s in sessions)
    drained = set(drain.get("workers") or [])
    migrated_turns = _first_turns_after(
        runs, lambda prev, turn: prev.worker in drained and turn.worker != prev.worker
    )
    recoveries = [_recovery(runs, failure) for failure in failures]
    drain_out = dict(drain)
    if drain.get("ended") is not None and drain.get("started") is not None:
        drain_out["duration_seconds"] = round(float(drain["ended"]) - float(drain["started"]), 2)
    drain_out["migrated_turns"] = migrated_turns
    return {
        "settings": dict(settings),
        "totals": {
            "sessions": len(sessions),
            "child_sessions": sum(1 for s in sessions if s["parent"]),
            "sessions_ok": sum(1 for s in sessions if s["ok"]),
            "turns": sum(s["turns"] for s in sessions),
            "planned_turns": sum(s["planned_turns"] for s in sessions),
            "retries": sum(s["retries"] for s in sessions),
            "prompt_tokens": prompt_all,
            "cached_tokens": cached_all,
            "hit_rate": cached_all / prompt_all if prompt_all else 0.0,
            "recomputed_tokens": sum(s["recomputed_tokens"] for s in sessions),
            "clients": _count(s["client"] for s in sessions),
        },
        "sessions": sessions,
        "drain": drain_out,
        "recoveries": recoveries,
        "simulator": list(simulator),
    }


def _recovery(runs: Mapping[str, SessionRun], failure: Mapping[str, Any]) -> dict[str, Any]:
    """Summarise the sessions of a killed worker: their first turn after the kill."""
    worker, killed, ready = failure.get("worker"), failure.get("killed"), failure.get("ready")
    out = dict(failure)
    turns: list[dict[str, Any]] = []
    if worker and killed is not None:
        turns = _first_turns_after(
            runs,
            # The first turn that *started* after the kill, of a session whose turn
            # before it had *finished* before the kill. A turn in flight when the engine
            # died was served by the old process or retried on the new epoch, and then
            # it is the retry that recomputed: the session says nothing either way.
            lambda prev, turn: (
                prev.worker == worker
                and turn.worker == worker
                and prev.finished < float(killed) <= turn.started
            ),
        )
    if ready is not None and killed is not None:
        out["recovery_seconds"] = round(float(ready) - float(killed), 2)
    out["sessions"] = turns
    out["tokens_not_recomputed"] = sum(min(t["cached_tokens"], t["prefix_tokens"]) for t in turns)
    out["tokens_recomputed"] = sum(t["recomputed_tokens"] for t in turns)
    return out


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


def _k(tokens: float) -> str:
    return f"{tokens / 1000:.1f}K" if tokens >= 1000 else f"{tokens:.0f}"


def headline(report: Mapping[str, Any]) -> list[str]:
    """Return the figures that matter, one line each."""
    t, d = report["totals"], report["drain"]
    lines = [
        f"sessions {t['sessions_ok']}/{t['sessions']} finished ({t['child_sessions']} child "
        f"sessions; clients {t['clients']}), turns {t['turns']}/{t['planned_turns']} "
        f"answered 200 ({t['retries']} retries)",
        f"prefix cache hit rate {t['hit_rate']:.1%} of {_k(t['prompt_tokens'])} prompt tokens; "
        f"recomputed {_k(t['recomputed_tokens'])} tokens",
    ]
    migrated = d.get("migrated_turns") or []
    lines.append(
        f"drain of {d.get('node')} ({', '.join(d.get('workers') or [])}): "
        f"{'held' if d.get('held') else 'NOT held'} with {d.get('pinned_at_start', 0)} pinned "
        f"sessions, completed={d.get('completed')} in {d.get('duration_seconds', '?')} s; "
        f"waited {d.get('waited', 0)}, migrated {d.get('migrated', 0)}, released "
        f"{d.get('released', 0)}; next turns from cache "
        f"{sum(1 for m in migrated if m['from_cache'])}/{len(migrated)}"
    )
    for r in report["recoveries"]:
        sessions = r.get("sessions") or []
        lines.append(
            f"engine of {r.get('worker')} (checkpoints {r.get('checkpoints')}) killed: epoch "
            f"{r.get('epoch_before')} -> {r.get('epoch_after')} Ready in "
            f"{r.get('recovery_seconds', '?')} s, restores {r.get('restore_count')}; "
            f"{len(sessions)} sessions resumed there, {_k(r.get('tokens_not_recomputed', 0))} "
            f"tokens not recomputed, {_k(r.get('tokens_recomputed', 0))} recomputed"
        )
    for sim in report["simulator"]:
        lines.append(
            f"simulator, same workload, {sim['strategy']:<12} hit rate {sim['hit_rate']:.1%}, "
            f"recomputed {_k(sim['recomputed_tokens'])}, TTFT mean {sim['ttft_mean_s']:.3f} s"
        )
    return lines


def render_text(report: Mapping[str, Any], top: int = 12) -> str:
    """Render the terminal report: headline, then the busiest sessions."""
    lines = ["", "=== sessionfleet demo report ===", *headline(report), ""]
    lines.append(f"{'session':<22} {'client':<10} {'turns':>5} {'hit':>6} {'recomp':>7} workers")
    rows = sorted(report["sessions"], key=lambda s: -s["prompt_tokens"])
    for s in rows[:top]:
        lines.append(
            f"{s['session']:<22} {s['client']:<10} {s['turns']:>5} {s['hit_rate']:>6.1%} "
            f"{_k(s['recomputed_tokens']):>7} {','.join(s['workers'])}"
        )
    if len(rows) > top:
        lines.append(f"... {len(rows) - top} more in the Markdown report")
    return "\n".join(lines)


def render_markdown(report: Mapping[str, Any], png_name: str = "demo.png") -> str:
    """Render the full report as Markdown."""
    out = ["# sessionfleet demo report", ""]
    out += [f"- {line}" for line in headline(report)]
    out += ["", f"![demo]({png_name})", "", "## Settings", ""]
    out += [f"- {k}: `{v}`" for k, v in report["settings"].items()]
    out += ["", "## Sessions", ""]
    out += [
        "| session | client | parent | turns | retries | prompt | cached | hit rate "
        "| recomputed | workers |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for s in report["sessions"]:
        out.append(
            f"| {s['session']} | {s['client']} | {s['parent']} | {s['turns']}/"
            f"{s['planned_turns']} | {s['retries']} | {s['prompt_tokens']} | "
            f"{s['cached_tokens']} | {s['hit_rate']:.1%} | {s['recomputed_tokens']} | "
            f"{', '.join(s['workers'])} |"
        )
    tables = [
        ("Migrated sessions: first turn on the new worker", report["drain"]["migrated_turns"])
    ]
    for r in report["recoveries"]:
        tables.append(
            (
                f"Sessions of {r['worker']} (checkpoints {r['checkpoints']}): first turn after the "
                "kill",
                r["sessions"],
            )
        )
    for title, rows in tables:
        out += ["", f"## {title}", ""]
        out += [
            "| session | turn | from | to | prefix | cached | recomputed |",
            "| --- | ---: | --- | --- | ---: | ---: | ---: |",
        ]
        for m in rows:
            out.append(
                f"| {m['session']} | {m['turn']} | {m['from']} | {m['to']} | "
                f"{m['prefix_tokens']} | {m['cached_tokens']} | {m['recomputed_tokens']} |"
            )
    out += ["", "## Simulator: the same workload under other strategies", ""]
    out += ["| strategy | hit rate | recomputed tokens | TTFT mean s | TTFT p95 s |"]
    out += ["| --- | ---: | ---: | ---: | ---: |"]
    for sim in report["simulator"]:
        out.append(
            f"| {sim['strategy']} | {sim['hit_rate']:.1%} | {sim['recomputed_tokens']} | "
            f"{sim['ttft_mean_s']} | {sim['ttft_p95_s']} |"
        )
    return "\n".join(out) + "\n"


def render_png(report: Mapping[str, Any], runs: Mapping[str, SessionRun], path: Path) -> bool:
    """Write the PNG: per-turn cache share over time, and the simulator's strategies.

    Returns False (and writes nothing) when matplotlib is not installed.
    """
    try:
        matplotlib = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        plt = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = [t.finished for r in runs.values() for t in r.turns[1:] if t.prompt_tokens]
    ys = [
        t.cached_tokens / t.prompt_tokens
        for r in runs.values()
        for t in r.turns[1:]
        if t.prompt_tokens
    ]
    left.scatter(xs, ys, s=6, alpha=0.6)
    drain = report["drain"]
    if drain.get("started") is not None:
        left.axvline(drain["started"], color="tab:orange", label="drain starts")
    if drain.get("ended") is not None:
        left.axvline(drain["ended"], color="tab:orange", linestyle="--", label="drain done")
    for recovery in report["recoveries"]:
        if recovery.get("killed") is not None:
            left.axvline(recovery["killed"], color="tab:red", label=f"{recovery['worker']} killed")
        if recovery.get("ready") is not None:
            left.axvline(recovery["ready"], color="tab:red", linestyle="--", label="back")
    left.set(xlabel="seconds", ylabel="cached share of prompt", title="Turns after the first")
    left.set_ylim(-0.02, 1.02)
    left.legend(loc="lower left", fontsize=8)
    names = [s["strategy"] for s in report["simulator"]]
    right.bar(names, [s["hit_rate"] for s in report["simulator"]], color="tab:green")
    right.set(ylabel="prefix cache hit rate", title="Simulator, same workload")
    right.set_ylim(0, 1)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
