"""The operator's checkpoint drivers and the checkpoints this process has in hand."""

from __future__ import annotations

from dataclasses import dataclass, field

from sessionfleet.api import CheckpointDriver
from sessionfleet.checkpoint import Driver
from sessionfleet.controllers.records import Key


@dataclass
class CheckpointWork:
    """Checkpoint drivers and work in flight; each field names the module that writes it."""

    drivers: dict[CheckpointDriver, Driver] = field(default_factory=dict)
    """The drivers available, by kind: set once by :mod:`sessionfleet.operator.main`,
    then only read."""
    running: set[Key] = field(default_factory=set)
    """Workers a checkpoint is being taken of now, written by :mod:`.checkpoints` only."""
    created: set[Key] = field(default_factory=set)
    """WorkerCheckpoints this process created: its own work in flight, written by
    :mod:`.checkpoints` only. Which ones any replica created, the objects show
    themselves (:mod:`.provenance`)."""
    key: bytes | None = None
    """The key that signs and verifies the operator's checkpoints, once read; written by
    :mod:`.provenance` only."""
