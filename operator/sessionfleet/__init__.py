"""sessionfleet: session-aware GPU inference fleets on Kubernetes.

The operator, router, node agent, simulated engine and fleet simulator share this
one distribution. The public API lives in :mod:`sessionfleet.api`.
"""

from sessionfleet._version import __version__

__all__ = ["__version__"]
