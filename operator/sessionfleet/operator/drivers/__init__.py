"""The operator's half of each checkpoint driver: engine, kubelet and CRIU (via the agent).

The interface they implement is :mod:`sessionfleet.checkpoint`; the CRIU driver's node
half runs in the node agent (:mod:`sessionfleet.agent.criu`).
"""
