"""Pure decisions: placement, drain, recovery and checkpoint timing.

Every function here takes models and observations and returns a plan or a reason.
Nothing here performs I/O, so the operator, the router and the fleet simulator share
the very same code, and tests need no cluster.
"""
