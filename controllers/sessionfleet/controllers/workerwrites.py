"""What the worker controller (:mod:`.workers`) remembers of its own writes.

Each is kept between passes of the fleet loop so that a pass neither writes again what
the watch has not yet reported back nor writes a worker's counters more often than the
coalescing interval allows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sessionfleet.controllers.records import Key
from sessionfleet.policy.recovery import NodeRecoveryGate


@dataclass
class WorkerWrites:
    """The worker controller's bookkeeping; each field names the module that writes it."""

    holds: dict[tuple[str, Key], float] = field(default_factory=dict)
    """Hold changes written but not yet seen in the indexes: (what, object) to when
    (monotonic), so a pass does not write them again while the watch catches up.
    Written by :mod:`.workers` only."""
    status_written_at: dict[Key, float] = field(default_factory=dict)
    """When each worker's status was last written (monotonic), to coalesce counters.
    Written by :mod:`.workers` only."""
    node_moves: dict[Key, float] = field(default_factory=dict)
    """Workers this process moved off a NotReady node (monotonic time of the write),
    until the index shows them Recovering: the node gate counts them meanwhile. Added
    by :mod:`.workers`, forgotten by :mod:`.loop` once the index shows the move."""
    node_gate: NodeRecoveryGate = field(default_factory=lambda: NodeRecoveryGate(0))
    """This pass's budget for moving workers off NotReady nodes: set by :mod:`.loop` at
    the start of each pass, spent by :mod:`.workers`."""
