"""``sessionfleet simulate``: compare routing strategies on an agentic workload.

The parser and the command live here so that ``sessionfleet.cli`` only calls
:func:`add_parser`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TextIO

from pydantic import ValidationError

from sessionfleet.api import CheckpointDriver, DeadlineAction, DrainMode, DrainPolicySpec
from sessionfleet.api import parse_duration as _parse_duration
from sessionfleet.cliargs import positive_float, positive_int
from sessionfleet.fleetsim._config import (
    CostModel,
    Disruption,
    Drain,
    Failure,
    FleetConfig,
    OperatorSettings,
)
from sessionfleet.fleetsim._results import SimResult, format_fair_table, format_table
from sessionfleet.fleetsim._sim import Simulation, make_strategy
from sessionfleet.fleetsim._strategies import STRATEGIES
from sessionfleet.workload import (
    Session,
    TraceFormatError,
    WorkloadConfig,
    generate,
    load_sharegpt,
)

WORKLOADS = ("agentic", "published")
_FLEET = FleetConfig()
_HALVINGS = 7
_COST = CostModel()


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """Add the ``simulate`` subcommand to ``commands`` (an argparse subparsers object)."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "simulate",
        help="compare routing strategies on a simulated fleet (no cluster needed)",
        description=(
            "Replay an agentic workload (synthetic, calibrated to published Codex traces, "
            "or a ShareGPT trace file) against a fleet of simulated workers and print, for "
            "each routing strategy, the prefix-cache hit rate, the recomputed prefill, the "
            "time to first token, drain durations and the sessions that lost their cache. "
            "The 'operator' strategy runs sessionfleet's own placement, drain and recovery "
            "policies."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    work = parser.add_argument_group("workload")
    work.add_argument(
        "--sessions",
        type=positive_int,
        default=2000,
        help="sessions to simulate (a trace file gives its own)",
    )
    work.add_argument("--seed", type=int, default=1, help="random seed of the workload")
    work.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="agentic",
        help="agentic: the calibrated distributions; published: every session exactly "
        "33 turns of 2,242 new tokens from 12K (the back-of-envelope workload)",
    )
    work.add_argument(
        "--rate", type=positive_float, default=0.5, help="new sessions per second (Poisson)"
    )
    work.add_argument(
        "--replay",
        nargs="+",
        metavar="PATH",
        help="replay a block-hash trace instead: Claude Code JSON files (or a folder of "
        "them; conversations start at --rate per second) or one Mooncake JSONL file; "
        "prints each strategy's hit rate next to the trace's own",
    )
    work.add_argument(
        "--time-scale",
        type=positive_float,
        default=1.0,
        help="with --replay: multiply the trace's times (0.5: twice as fast)",
    )
    work.add_argument(
        "--trace",
        metavar="FILE",
        help="replay a ShareGPT-style JSON/JSONL trace file instead (e.g. a local copy of "
        "Inferact/codex_swebenchpro_traces)",
    )

    fleet = parser.add_argument_group("fleet")
    fleet.add_argument("--workers", type=positive_int, default=16, help="workers in the fleet")
    fleet.add_argument(
        "--kv-tokens",
        type=positive_int,
        default=_FLEET.kv_tokens,
        help="KV cache capacity of each worker, in tokens",
    )
    fleet.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    fleet.add_argument(
        "--max-sessions",
        type=positive_int,
        default=_FLEET.max_sessions,
        help="InferenceWorker capacity.maxSessions (operator placement)",
    )
    fleet.add_argument(
        "--capacity-kv-tokens",
        type=int,
        default=0,
        help="InferenceWorker capacity.kvTokens for placement (0: unknown)",
    )
    fleet.add_argument(
        "--prefill-tokens-per-second",
        type=positive_float,
        default=1 / _COST.prefill_seconds_per_token,
        help="prefill throughput of one worker",
    )
    fleet.add_argument(
        "--decode-ms-per-token",
        type=positive_float,
        default=_COST.decode_seconds_per_token * 1000,
        help="time per output token",
    )
    fleet.add_argument(
        "--restart",
        type=_duration,
        default=_FLEET.restart_seconds,
        help="seconds (or a duration such as 2m) for a new pod to become Ready",
    )

    fair = parser.add_argument_group(
        "fair comparison (the same gateway in front of every strategy; docs/simulator.md)"
    )
    fair.add_argument(
        "--admission-cap",
        type=int,
        default=0,
        help="gateway flow control: at most this many live sessions; new ones queue FIFO (0: none)",
    )
    fair.add_argument(
        "--client-timeout",
        type=_duration,
        default=0.0,
        help="a client gives up on a turn without a first token after this long (admission "
        "wait included) and its session fails (0: never)",
    )
    fair.add_argument(
        "--ttft-target",
        type=positive_float,
        default=_FLEET.ttft_target_seconds,
        help="time to first token that counts as goodput (and that --sweep must hold at p99)",
    )
    fair.add_argument(
        "--steady",
        action="store_true",
        help="measure only the steady state: skip the first --warmup of arrivals and stop "
        "measuring when arrivals stop; prints the steady-state table",
    )
    fair.add_argument(
        "--warmup",
        type=float,
        default=0.2,
        help="with --steady: the share of the arrival span not measured",
    )
    fair.add_argument(
        "--sweep",
        metavar="LOW:HIGH",
        help="find, per strategy, the highest --rate in LOW:HIGH whose steady state keeps "
        "p99 TTFT and p99 admission wait within --ttft-target with under 1%% of sessions "
        "failed (bisection: LOW, then 7 halvings)",
    )

    runs = parser.add_argument_group("strategies")
    runs.add_argument(
        "--strategies",
        type=_strategies,
        default=list(STRATEGIES),
        help=f"comma-separated, from: {', '.join(STRATEGIES)}",
    )
    runs.add_argument(
        "--drain-mode",
        type=_drain_modes,
        default=[DrainMode.WAIT_THEN_MIGRATE],
        help="the operator's DrainPolicy mode: Wait, Migrate, WaitThenMigrate, a "
        "comma-separated list or 'all' (one operator row each)",
    )
    runs.add_argument("--grace", default="2m", help="DrainPolicy gracePeriod")
    runs.add_argument("--deadline", default="10m", help="DrainPolicy deadline")
    runs.add_argument(
        "--on-deadline",
        choices=[a.value for a in DeadlineAction],
        default=DeadlineAction.RELEASE.value,
        help="DrainPolicy onDeadline",
    )
    runs.add_argument(
        "--checkpoint",
        choices=("on", "off", "both"),
        default="on",
        help="checkpoints for the operator: drained sessions carry their KV, a failed "
        "worker restores its last periodic checkpoint ('both': one row each)",
    )
    runs.add_argument(
        "--checkpoint-interval",
        type=_duration,
        default=300.0,
        help="periodic checkpoint interval (seconds or a duration; 0: none)",
    )

    faults = parser.add_argument_group("drains and failures")
    faults.add_argument(
        "--drains", type=int, default=None, help="drains spread over the run (default 2)"
    )
    faults.add_argument(
        "--failures", type=int, default=None, help="worker failures spread over the run (default 1)"
    )
    faults.add_argument(
        "--drain",
        action="append",
        default=[],
        type=_disruption(node_allowed=False),
        metavar="AT:WORKER",
        help="drain worker WORKER (an index) at AT (seconds or 25m); repeatable",
    )
    faults.add_argument(
        "--fail",
        action="append",
        default=[],
        type=_disruption(node_allowed=True),
        metavar="AT:WORKER[:node]",
        help="fail worker WORKER's pod (or with :node its node) at AT; repeatable",
    )

    out = parser.add_argument_group("output")
    out.add_argument(
        "--plot", metavar="PATH", help="write a PNG of the comparison (needs matplotlib)"
    )
    out.add_argument("--json", metavar="PATH", help="write the results as JSON ('-': stdout)")
    progress = out.add_mutually_exclusive_group()
    progress.add_argument(
        "--progress",
        dest="progress",
        action="store_true",
        default=None,
        help="show a progress bar on stderr (default: when stderr is a terminal)",
    )
    progress.add_argument("--no-progress", dest="progress", action="store_false")
    parser.set_defaults(func=run)
    return parser


# --- argument types -------------------------------------------------------------------


def _duration(text: str) -> float:
    """Seconds, as a number or a duration such as ``90s``, ``25m`` or ``1h30m``."""
    try:
        value = float(text)
    except ValueError:
        try:
            return _parse_duration(text).total_seconds()
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {text}")
    return value


def _strategies(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in STRATEGIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown strategy {', '.join(unknown) or '(none)'}; "
            f"choose from {', '.join(STRATEGIES)}"
        )
    return names


def _drain_modes(text: str) -> list[DrainMode]:
    if text == "all":
        return list(DrainMode)
    modes = []
    for name in text.split(","):
        try:
            modes.append(DrainMode(name.strip()))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"unknown drain mode {name!r}; choose from {', '.join(DrainMode)} or all"
            ) from None
    return modes


def _disruption(node_allowed: bool) -> Callable[[str], tuple[float, int, bool]]:
    def parse(text: str) -> tuple[float, int, bool]:
        parts = text.split(":")
        node = node_allowed and len(parts) == 3 and parts[2] == "node"
        if len(parts) != 2 and not node:
            form = "AT:WORKER[:node]" if node_allowed else "AT:WORKER"
            raise argparse.ArgumentTypeError(f"expected {form}, got {text!r}")
        try:
            worker = int(parts[1])
        except ValueError:
            raise argparse.ArgumentTypeError(f"WORKER must be an index, got {parts[1]!r}") from None
        return _duration(parts[0]), worker, node

    return parse


# --- the command ----------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """Run the comparison the arguments describe; return the exit status."""
    if args.replay:
        return _replay(args)
    try:
        plan = _plan(args)
    except (ValueError, ValidationError, OSError, TraceFormatError) as exc:
        print(f"sessionfleet simulate: {_first_line(exc)}", file=sys.stderr)
        return 2
    sessions_factory, expected, workload_text, fleet, operator_runs, disruptions = plan
    print(workload_text)
    print(
        f"fleet: {fleet.workers} workers, {fleet.kv_tokens:,} KV tokens each, "
        f"prefill {1 / fleet.cost.prefill_seconds_per_token:,.0f} tokens/s, "
        f"decode {fleet.cost.decode_seconds_per_token * 1000:g} ms/token"
    )
    for disruption in disruptions:
        what = "drain" if isinstance(disruption, Drain) else "failure"
        if isinstance(disruption, Failure) and disruption.node:
            what = "node failure"
        print(f"  {what} of {fleet.worker_name(disruption.worker)} at {disruption.at:.0f}s")
    print()

    if args.sweep:
        return _sweep(args, operator_runs)
    show_progress = sys.stderr.isatty() if args.progress is None else args.progress
    results: list[SimResult] = []
    started = time.perf_counter()
    for name in args.strategies:
        settings_list = operator_runs if name == "operator" else [None]
        for settings in settings_list:
            strategy = make_strategy(name, settings)
            bar = _ProgressBar(strategy.label, sys.stderr) if show_progress else None
            simulation = Simulation(
                sessions_factory(),
                strategy,
                fleet,
                settings,
                disruptions,
                expected_sessions=expected,
                progress=bar.update if bar is not None else None,
            )
            results.append(simulation.run())
            if bar is not None:
                bar.close()
    elapsed = time.perf_counter() - started

    print(format_table(results))
    if args.steady or args.admission_cap or args.client_timeout:
        print(
            f"\nsteady state: turns sent in [{fleet.warmup_seconds:.0f}s, "
            f"{fleet.measure_until_seconds:.0f}s); admission cap "
            f"{args.admission_cap or 'none'}, client timeout "
            f"{f'{args.client_timeout:g}s' if args.client_timeout else 'none'}\n"
        )
        print(format_fair_table(results, fleet.ttft_target_seconds))
    turns = results[0].turns if results else 0
    print(
        f"\n{turns:,} turns per strategy; {len(results)} run(s) in {elapsed:.1f}s. "
        "Hit rate: prompt tokens served from the prefix cache. Recomputed: context "
        "tokens computed before that had to be prefilled again. Lost cache: sessions "
        "that recomputed over half their context at some turn."
    )
    if args.json:
        document = json.dumps([r.as_dict() for r in results], indent=2)
        if args.json == "-":
            print(document)
        else:
            Path(args.json).write_text(document + "\n")
            print(f"wrote {args.json}")
    if args.plot:
        from sessionfleet.fleetsim._plot import PlotUnavailable, plot_results

        try:
            plot_results(results, args.plot, title=workload_text)
        except PlotUnavailable as exc:
            print(f"sessionfleet simulate: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {args.plot}")
    return 0


def _sweep(args: argparse.Namespace, operator_runs: list[OperatorSettings]) -> int:
    """Bisect, per strategy, for the highest sustained rate; print one row each."""
    try:
        low, high = (float(part) for part in args.sweep.split(":"))
    except ValueError:
        print(f"sessionfleet simulate: --sweep wants LOW:HIGH, got {args.sweep!r}", file=sys.stderr)
        return 2
    if not 0 < low < high:
        print("sessionfleet simulate: --sweep wants 0 < LOW < HIGH", file=sys.stderr)
        return 2
    target = args.ttft_target
    print(
        f"sweep: {args.sessions:,} {args.workload} sessions per run, {args.workers} workers, "
        f"admission cap {args.admission_cap or 'none'}, client timeout "
        f"{args.client_timeout or 'none'}; sustained = p99 TTFT and p99 admission wait "
        f"<= {target:g}s, < 1% failed, steady state only\n"
    )
    rows: list[tuple[str, float | None, SimResult | None]] = []
    for name in args.strategies:
        for settings in operator_runs if name == "operator" else [None]:
            label = make_strategy(name, settings).label
            result = _run_at(args, name, settings, low)
            if not _sustains(result, target):
                rows.append((label, None, None))
                continue
            best: float = low
            at_best: SimResult = result
            lo, hi = low, high
            for _ in range(_HALVINGS):
                rate = (lo + hi) / 2
                result = _run_at(args, name, settings, rate)
                if _sustains(result, target):
                    best, at_best, lo = rate, result, rate
                else:
                    hi = rate
            rows.append((label, best, at_best))
    print(
        f"{'strategy':<44} {'sustained rate':>15} {'hit rate':>9} {'TTFT p99':>9} {'admit p99':>10}"
    )
    for label, sustained, at in rows:
        if sustained is None or at is None:
            print(f"{label:<44} {'< ' + format(low, 'g') + '/s':>15}")
            continue
        print(
            f"{label:<44} {sustained:>13.3f}/s {at.hit_rate:>9.1%} "
            f"{at.ttft_quantile(0.99):>8.2f}s {at.admission_quantile(0.99):>9.2f}s"
        )
    return 0


def _replay(args: argparse.Namespace) -> int:
    """Replay a block-hash trace with each strategy that has a replay router."""
    from sessionfleet.fleetsim._replay import REPLAY_STRATEGIES, replay
    from sessionfleet.fleetsim._traces import load_trace

    try:
        trace = load_trace(args.replay, rate=args.rate, seed=args.seed, time_scale=args.time_scale)
    except (ValueError, OSError, TraceFormatError) as exc:
        print(f"sessionfleet simulate: {_first_line(exc)}", file=sys.stderr)
        return 2
    fleet = FleetConfig(
        workers=args.workers,
        kv_tokens=args.kv_tokens,
        cost=CostModel(
            prefill_seconds_per_token=1 / args.prefill_tokens_per_second,
            decode_seconds_per_token=args.decode_ms_per_token / 1000,
        ),
    )
    print(
        f"replay: {len(trace.requests):,} requests of {trace.sessions} sessions from "
        f"{trace.source}, {trace.block_size}-token blocks; {fleet.workers} workers, "
        f"{fleet.kv_tokens:,} KV tokens each\n"
    )
    print(f"{'strategy':<14} {'hit rate':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'TTFT max':>9}")
    chosen = [name for name in args.strategies if name in REPLAY_STRATEGIES]
    documents = []
    for name in chosen or REPLAY_STRATEGIES:
        result = replay(trace, name, fleet)
        print(
            f"{name:<14} {result.hit_rate:>9.1%} {result.ttft_quantile(0.5):>8.2f}s "
            f"{result.ttft_quantile(0.99):>8.2f}s {result.ttft_max:>8.2f}s"
        )
        documents.append({"strategy": name, "hit_rate": round(result.hit_rate, 5)})
    recorded = trace.recorded_hit_rate()
    print(f"{'(recorded)':<14} {recorded:>9.1%}   blocks seen before anywhere in the trace")
    if args.json:
        text = json.dumps({"recorded_hit_rate": round(recorded, 5), "results": documents})
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 0


def _sustains(result: SimResult, target: float) -> bool:
    """Whether a steady-state run held the TTFT target (the sweep's criterion)."""
    return (
        result.turns > 0
        and result.ttft_quantile(0.99) <= target
        and result.admission_quantile(0.99) <= target
        and result.failed_share < 0.01
    )


def _run_at(
    args: argparse.Namespace, name: str, settings: OperatorSettings | None, rate: float
) -> SimResult:
    """Run one strategy at one rate, steady state, as the arguments say otherwise."""
    sweep_args = argparse.Namespace(**vars(args))
    sweep_args.rate = rate
    factory, _, _, fleet, _, _ = _plan(sweep_args)
    # No drains or failures: the sweep measures the capacity of a healthy fleet.
    return Simulation(factory(), make_strategy(name, settings), fleet, settings).run()


def _first_line(exc: BaseException) -> str:
    if isinstance(exc, ValidationError):
        errors = exc.errors()
        return "; ".join(str(e.get("msg", "")) for e in errors) or str(exc)
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _plan(
    args: argparse.Namespace,
) -> tuple[
    Callable[[], Iterable[Session]],
    int,
    str,
    FleetConfig,
    list[OperatorSettings],
    list[Disruption],
]:
    """Turn the arguments into a workload, a fleet, operator settings and disruptions."""
    sessions_factory: Callable[[], Iterable[Session]]
    if args.trace:
        trace = load_sharegpt(args.trace, seed=args.seed, arrival_rate=args.rate)
        if not trace:
            raise ValueError(f"{args.trace}: no conversation with an assistant message")
        expected = len(trace)
        span = trace[-1].arrival
        workload_text = f"workload: {expected} sessions from {args.trace}"

        def sessions_factory() -> Iterable[Session]:
            return trace

    else:
        if args.workload == "published":
            config = WorkloadConfig.back_of_envelope(args.sessions, arrival_rate=args.rate)
        else:
            config = WorkloadConfig(sessions=args.sessions, arrival_rate=args.rate)
        expected = config.sessions
        span = expected * (1 - config.child_share) / config.arrival_rate
        workload_text = (
            f"workload: {expected:,} {args.workload} sessions (seed {args.seed}), "
            f"{config.arrival_rate:g} new per second"
        )

        def sessions_factory() -> Iterable[Session]:
            return generate(config, args.seed)

    cost = CostModel(
        prefill_seconds_per_token=1 / args.prefill_tokens_per_second,
        decode_seconds_per_token=args.decode_ms_per_token / 1000,
    )
    steady = {}
    if args.steady or args.sweep:
        if not 0 <= args.warmup < 1:
            raise ValueError("--warmup is a share of the arrival span, from 0 to below 1")
        steady = {"warmup_seconds": span * args.warmup, "measure_until_seconds": span}
    fleet = FleetConfig(
        admission_cap=args.admission_cap,
        client_timeout_seconds=args.client_timeout,
        ttft_target_seconds=args.ttft_target,
        **steady,
        workers=args.workers,
        kv_tokens=args.kv_tokens,
        block_size=args.block_size,
        max_sessions=args.max_sessions,
        capacity_kv_tokens=args.capacity_kv_tokens,
        cost=cost,
        restart_seconds=args.restart,
    )

    checkpoint_choices = {"on": [True], "off": [False], "both": [True, False]}[args.checkpoint]
    operator_runs = []
    for mode in args.drain_mode:
        for checkpoint in checkpoint_choices:
            policy = DrainPolicySpec(
                mode=mode,
                grace_period=args.grace,
                deadline=args.deadline,
                on_deadline=DeadlineAction(args.on_deadline),
                checkpoint=checkpoint,
            )
            operator_runs.append(
                OperatorSettings(
                    drain_policy=policy,
                    checkpoint_driver=CheckpointDriver.ENGINE
                    if checkpoint
                    else CheckpointDriver.NONE,
                    checkpoint_interval=(args.checkpoint_interval or None) if checkpoint else None,
                )
            )

    disruptions = _disruptions(args, span, fleet)
    return sessions_factory, expected, workload_text, fleet, operator_runs, disruptions


def _disruptions(args: argparse.Namespace, span: float, fleet: FleetConfig) -> list[Disruption]:
    """Explicit drains and failures, or a few spread over the busy part of the run."""
    explicit = bool(args.drain or args.fail)
    drains = args.drains if args.drains is not None else (0 if explicit else 2)
    failures = args.failures if args.failures is not None else (0 if explicit else 1)
    out: list[Disruption] = [Drain(at, worker) for at, worker, _ in args.drain]
    out += [Failure(at, worker, node) for at, worker, node in args.fail]
    # Spread the generated ones over the middle of the arrivals, when the fleet is
    # busy, alternating drains and failures, each on a different worker.
    kinds = _interleave(["drain"] * drains, ["failure"] * failures)
    for number, kind in enumerate(kinds):
        at = span * (number + 1) / (len(kinds) + 1)
        worker = (number + 1) * fleet.workers // (len(kinds) + 1) % fleet.workers
        out.append(Drain(at, worker) if kind == "drain" else Failure(at, worker))
    for disruption in out:
        if not 0 <= disruption.worker < fleet.workers:
            raise ValueError(f"worker {disruption.worker} does not exist (0-{fleet.workers - 1})")
    return sorted(out, key=lambda d: d.at)


def _interleave(first: Sequence[str], second: Sequence[str]) -> list[str]:
    out: list[str] = []
    for index in range(max(len(first), len(second))):
        out.extend(first[index : index + 1])
        out.extend(second[index : index + 1])
    return out


class _ProgressBar:
    """A one-line progress bar on a stream, redrawn at most ten times a second."""

    def __init__(self, label: str, stream: TextIO, width: int = 30) -> None:
        self.label = label
        self.stream = stream
        self.width = width
        self.started = time.perf_counter()
        self.drawn = 0.0

    def update(self, done: int, total: int | None) -> None:
        """Redraw with ``done`` of ``total`` sessions finished."""
        now = time.perf_counter()
        if now - self.drawn < 0.1 and (total is None or done < total):
            return
        self.drawn = now
        if total:
            filled = min(self.width, self.width * done // total)
            bar = "#" * filled + "." * (self.width - filled)
            text = f"{self.label:<44} [{bar}] {done:,}/{total:,} sessions"
        else:
            text = f"{self.label:<44} {done:,} sessions"
        self.stream.write(f"\r{text} {now - self.started:5.1f}s")
        self.stream.flush()

    def close(self) -> None:
        """Clear the line."""
        self.stream.write("\r\033[K")
        self.stream.flush()


__all__ = ["add_parser", "run"]
