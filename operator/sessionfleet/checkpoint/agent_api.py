"""What the operator and the node agent agree on: the agent's port, the engine's container.

The node agent (:mod:`sessionfleet.agent`) serves checkpoints of a worker's engine
process; the operator's ``criu`` driver (:mod:`sessionfleet.operator.drivers.criu`) asks
it. Both halves read these names from here, so neither imports the other.
"""

from __future__ import annotations

import re

AGENT_PORT = 9400
"""The node agent's default port (``sessionfleet agent --port``)."""
ENGINE_CONTAINER = "engine"
"""The engine's container name in a worker pod (:mod:`sessionfleet.resources.pods`)."""
METADATA_FILE = "sessionfleet-criu.json"
"""Written next to CRIU's images: the process's GPUs, node and driver, for the restore."""
DEFAULT_LOCK_TIMEOUT_MS = 30_000
"""How long CRIU waits for the network lock by default (``--lock-timeout``, ms)."""
NAMESPACE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
"""A namespace name (RFC 1123 label): what both halves accept in a ``NAMESPACE/NAME``."""
FATAL_PHASE = "Fatal"
"""The phase an agent reports when it had to kill the engine's process: recover, do not retry."""
