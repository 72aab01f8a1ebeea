"""The checkpoint interface every driver implements, and what its two sides share.

The drivers themselves live with the process that runs them:

- ``engine`` (:mod:`sessionfleet.operator.drivers.engine`): the engine exports its KV
  state to shared storage and a restored engine imports it; the simulated engine does
  this end to end, vLLM through its KV store;
- ``criu``: the operator's half (:mod:`sessionfleet.operator.drivers.criu`) asks the node
  agent, whose half (:mod:`sessionfleet.agent.criu`) freezes the GPU process (CUDA
  checkpoint API) and dumps it with CRIU, where the node can;
- ``kubelet`` (:mod:`sessionfleet.operator.drivers.kubelet`): the kubelet checkpoint API
  through the API server's node proxy, where the container runtime supports it.

Here: the interface (:mod:`.driver`), where images lie (:mod:`.paths`), what the
operator and the agent agree on (:mod:`.agent_api`, :mod:`.agent_tokens`).
"""

from sessionfleet.checkpoint.driver import (
    CheckpointOutcome,
    CheckpointTarget,
    Driver,
    DriverError,
    DriverUnavailable,
    KVStoreControl,
)

__all__ = [
    "CheckpointOutcome",
    "CheckpointTarget",
    "Driver",
    "DriverError",
    "DriverUnavailable",
    "KVStoreControl",
]
