"""What both fronts share: the router (:mod:`sessionfleet.router`) and the Endpoint Picker.

A front is a process that sees every turn before an engine does, keeps the bindings
table from its watches, creates a new session's AgentSession, holds a turn while its
session moves, counts usage and takes part in the migration handshake. The router
proxies the turn itself; the Endpoint Picker (:mod:`sessionfleet.epp`) only names the
endpoint to a gateway. Neither front imports the other.
"""
