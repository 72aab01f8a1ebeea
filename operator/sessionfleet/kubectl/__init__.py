"""``kubectl sessionfleet``: a kubectl plugin for sessionfleet fleets.

Installed with the package as the console script ``kubectl-sessionfleet``; kubectl finds
it on PATH and runs it for ``kubectl sessionfleet ...``. The pure builders of what it
shows are in :mod:`sessionfleet.kubectl.views`, the command line and I/O in
:mod:`sessionfleet.kubectl.cli` (docs/kubectl-plugin.md).
"""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run the plugin (the console script's entry point); return the exit status."""
    from sessionfleet.kubectl.cli import main as run

    return run(argv)
