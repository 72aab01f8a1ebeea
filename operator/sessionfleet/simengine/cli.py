"""``sessionfleet sim-engine``: run one simulated vLLM-compatible engine."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sessionfleet.cliargs import non_negative_float, positive_int
from sessionfleet.simengine.cost import FREE, REALISTIC, CostModel

if TYPE_CHECKING:
    from sessionfleet.simengine.engine import EngineConfig

DESCRIPTION = """\
SIMULATOR - not a model. Serves vLLM's OpenAI-compatible API (/v1/chat/completions,
/v1/completions, /v1/models, /health, /metrics with vLLM's metric names, /pause,
/resume, /is_paused) and generates filler text. It simulates a block-level prefix cache
(usage.prompt_tokens_details.cached_tokens), prefill and decode time, and cache
export/import (/sim/cache/export, /sim/cache/import) for tests, benchmarks and sandboxes.
"""


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """Add the ``sim-engine`` subcommand to ``commands`` (an argparse subparsers object)."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "sim-engine",
        help="run a SIMULATED vLLM-compatible engine (tests, benchmarks, sandboxes)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    parser.add_argument(
        "--model",
        "--served-model-name",
        dest="model",
        required=True,
        help="the served model name clients send in the request's model field",
    )
    parser.add_argument(
        "--kv-tokens",
        type=positive_int,
        default=1 << 20,
        help="prefix cache capacity in tokens (default: 1048576)",
    )
    parser.add_argument(
        "--block-size", type=positive_int, default=16, help="tokens per KV block (default: 16)"
    )
    parser.add_argument(
        "--max-num-seqs",
        type=positive_int,
        default=256,
        help="requests running at once; more wait (default: 256)",
    )
    parser.add_argument(
        "--max-model-len",
        type=positive_int,
        default=1 << 18,
        help="the longest prompt plus completion, in tokens (default: 262144)",
    )
    parser.add_argument(
        "--default-max-tokens",
        type=positive_int,
        default=16,
        help="tokens generated when a request sets no max_tokens (default: 16)",
    )
    cost = parser.add_argument_group(
        "cost model", "simulated time; all zero by default so tests measure the data path"
    )
    cost.add_argument(
        "--realistic",
        action="store_true",
        help=(
            "one modern GPU: 50 us prefill per uncached token, 20 ms per generated token, "
            "5 ms per request (the flags below override single values)"
        ),
    )
    cost.add_argument(
        "--prefill-us-per-token",
        type=non_negative_float,
        default=None,
        help="microseconds of prefill per prompt token not served from cache",
    )
    cost.add_argument(
        "--decode-ms-per-token",
        type=non_negative_float,
        default=None,
        help="milliseconds per generated token",
    )
    cost.add_argument(
        "--request-overhead-ms",
        type=non_negative_float,
        default=None,
        help="fixed milliseconds before the first token",
    )
    usage = parser.add_argument_group("usage reporting (as vLLM's flags)")
    usage.add_argument(
        "--enable-prompt-tokens-details",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="report usage.prompt_tokens_details.cached_tokens (default: on)",
    )
    usage.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="end every stream with a usage chunk, even without stream_options.include_usage",
    )
    parser.add_argument(
        "--session-header",
        default="X-Session-Id",
        help=(
            "header naming a request's session when the router's X-Sessionfleet-Session-Id "
            "is absent (default: X-Session-Id)"
        ),
    )
    parser.add_argument(
        "--import-cache",
        metavar="DIR",
        type=Path,
        default=None,
        help="load a cache snapshot (from /sim/cache/export) before serving",
    )
    parser.add_argument(
        "--fault-metrics",
        choices=("nan", "inf", "-inf"),
        default=None,
        help="fault injection: report this value for vllm:kv_cache_usage_perc and "
        "vllm:num_requests_running, as a broken engine might",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    parser.set_defaults(func=run)
    return parser


def cost_model(args: argparse.Namespace) -> CostModel:
    """Return the cost model the flags ask for."""
    base = REALISTIC if args.realistic else FREE
    return CostModel(
        prefill_seconds_per_token=(
            base.prefill_seconds_per_token
            if args.prefill_us_per_token is None
            else args.prefill_us_per_token * 1e-6
        ),
        decode_seconds_per_token=(
            base.decode_seconds_per_token
            if args.decode_ms_per_token is None
            else args.decode_ms_per_token * 1e-3
        ),
        request_overhead_seconds=(
            base.request_overhead_seconds
            if args.request_overhead_ms is None
            else args.request_overhead_ms * 1e-3
        ),
    )


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Return the engine configuration the flags describe."""
    from sessionfleet.simengine.engine import EngineConfig

    if args.kv_tokens < args.block_size:
        raise SystemExit("sim-engine: --kv-tokens must hold at least one block")
    return EngineConfig(
        model=args.model,
        kv_tokens=args.kv_tokens,
        block_size=args.block_size,
        cost=cost_model(args),
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        default_max_tokens=args.default_max_tokens,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        force_include_usage=args.enable_force_include_usage,
        session_header=args.session_header,
        metrics_fault=float(args.fault_metrics) if args.fault_metrics else None,
    )


def run(args: argparse.Namespace) -> int:
    """Run the ``sim-engine`` subcommand; return the exit status."""
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # The server (aiohttp, prometheus_client) is imported only when it runs, so that
    # every other subcommand starts without it.
    from sessionfleet.simengine.cache import SnapshotError
    from sessionfleet.simengine.server import serve

    config = config_from_args(args)
    try:
        asyncio.run(serve(config, args.host, args.port, args.import_cache))
    except SnapshotError as error:
        print(f"sim-engine: cannot import the cache: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"sim-engine: cannot serve on {args.host}:{args.port}: {error}", file=sys.stderr)
        return 1
    return 0
