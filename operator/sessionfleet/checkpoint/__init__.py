"""Checkpoint drivers: one small interface, several ways of saving a worker's state.

- ``engine`` (:mod:`.engine`): the engine exports its KV state to shared storage and a
  restored engine imports it; the simulated engine does this end to end, vLLM through
  LMCache's shared remote store;
- ``criu`` (:mod:`.criu`): the node agent freezes the GPU process (CUDA checkpoint API)
  and dumps it with CRIU, where the node can;
- ``kubelet`` (:mod:`.kubelet`): the kubelet checkpoint API through the API server's node
  proxy, where the container runtime supports it.
"""

from sessionfleet.checkpoint.driver import (
    CheckpointOutcome,
    CheckpointTarget,
    Driver,
    DriverError,
    DriverUnavailable,
)

__all__ = [
    "CheckpointOutcome",
    "CheckpointTarget",
    "Driver",
    "DriverError",
    "DriverUnavailable",
]
