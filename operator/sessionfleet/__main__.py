"""``python -m sessionfleet``: the same as the ``sessionfleet`` command."""

from sessionfleet.cli import main

raise SystemExit(main())
