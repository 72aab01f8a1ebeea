"""The ``sessionfleet`` command line: one entry point for every component.

Only subcommands that work are listed; later components add theirs here.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from pathlib import Path

from sessionfleet._version import __version__
from sessionfleet.agent import cli as agent_cli
from sessionfleet.api.crd import render_crds
from sessionfleet.api.crd_templates import render_chart_crds
from sessionfleet.epp import cli as epp_cli
from sessionfleet.fleetsim import cli as fleetsim_cli
from sessionfleet.operator import main as operator_cli
from sessionfleet.router import cli as router_cli
from sessionfleet.simengine import cli as sim_engine_cli


def _cmd_version(_: argparse.Namespace) -> int:
    print(f"sessionfleet {__version__}")
    return 0


def _cmd_crds(args: argparse.Namespace) -> int:
    targets = [(Path(args.output_dir), render_crds())]
    if args.chart_dir:
        targets.append((Path(args.chart_dir), render_chart_crds()))
    if args.check:
        return max([_check_crds(out_dir, rendered) for out_dir, rendered in targets])
    for out_dir, rendered in targets:
        out_dir.mkdir(parents=True, exist_ok=True)
        for name, text in rendered.items():
            (out_dir / name).write_text(text)
            print(f"wrote {out_dir / name}")
    return 0


def _check_crds(out_dir: Path, rendered: dict[str, str]) -> int:
    """Compare committed CRDs with the models; print a diff of each drifted file."""
    drifted = 0
    for name, text in rendered.items():
        path = out_dir / name
        committed = path.read_text() if path.exists() else ""
        if committed != text:
            drifted += 1
            diff = difflib.unified_diff(
                committed.splitlines(keepends=True),
                text.splitlines(keepends=True),
                fromfile=f"{path} (committed)",
                tofile=f"{path} (from the models)",
            )
            sys.stdout.writelines(diff)
    expected = set(rendered)
    for path in sorted(out_dir.glob("*.sessionfleet.dev.yaml")):
        if path.name not in expected:
            drifted += 1
            print(f"{path}: no model generates this file; delete it")
    if drifted:
        print(f"{drifted} CRD file(s) drift from the models: run `make crds` and commit.")
        return 1
    print(f"{len(rendered)} CRDs match the models.")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser with every working subcommand."""
    parser = argparse.ArgumentParser(
        prog="sessionfleet",
        description="Session-aware GPU inference fleets on Kubernetes.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    version = commands.add_parser("version", help="print the version")
    version.set_defaults(func=_cmd_version)

    crds = commands.add_parser("crds", help="write the CRDs generated from the API models")
    crds.add_argument(
        "--output-dir", default="crds", help="directory for the YAML files (default: crds)"
    )
    crds.add_argument(
        "--chart-dir",
        help="also write the Helm chart's CRD templates here (charts/sessionfleet/templates/crds)",
    )
    crds.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 with a diff when the files drift from the models",
    )
    crds.set_defaults(func=_cmd_crds)

    sim_engine_cli.add_parser(commands)
    fleetsim_cli.add_parser(commands)
    router_cli.add_parser(commands)
    epp_cli.add_parser(commands)
    operator_cli.add_parser(commands)
    agent_cli.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the process exit status."""
    args = build_parser().parse_args(argv)
    status: int = args.func(args)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
