"""The engines' interfaces: what every process must know of the engines it talks to.

:mod:`sessionfleet.engines.vllm` holds what every component needs to know about the
production engine (metric names, the shape of ``usage``), so the router, the operator's
scrapers and the simulated engine agree on one definition; :mod:`.anthropic` the
Messages API both the router and the simulated engine speak; :mod:`.kvstore_wire` the
names the operator and the KV store inside vLLM share. The simulated engine itself is a
process of its own, :mod:`sessionfleet.simengine` (``sessionfleet sim-engine``).
"""

FORWARDED_SESSION_HEADER = "X-Sessionfleet-Session-Id"
"""The header the router adds to every turn it forwards: the session id it recognised.

Whatever convention the client used (Claude Code, Codex, OpenCode or the configured
header), the engine sees the session under this one name. vLLM ignores it; the
simulated engine uses it to know which blocks belong to which session (per-session
cache export).
"""
