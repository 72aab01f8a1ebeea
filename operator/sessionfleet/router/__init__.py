"""The session-aware router: an OpenAI-compatible reverse proxy in front of the workers.

Each turn goes to the worker its session is bound to; a new session is placed with the
shared placement function and recorded as an AgentSession; usage is aggregated per
session and written to the session's status in coalesced patches. See docs/router.md.
"""
