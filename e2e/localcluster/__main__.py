"""Run the local cluster's command line: ``python e2e/localcluster up|down|status|run``.

Run it by path from the repository root. ``python -m e2e.localcluster`` works only
where the repository root is not the first entry of ``sys.path``: there, the
project's ``operator/`` package hides the standard library's ``operator`` module.
"""

import sys
from pathlib import Path

if not __package__:
    # Run by path: make `e2e` importable, appending the repository root so that it
    # comes after the standard library.
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from e2e.localcluster._cli import main

if __name__ == "__main__":
    sys.exit(main())
