"""The operator's liveness (``/healthz``) and readiness (``/readyz``) endpoints.

- **Live** unless a background task died (the process is then on its way out) or, on
  the leader, the fleet loop has not finished a pass for ``stall_after`` seconds: a
  wedged loop answers probes but decides nothing, and a restart hands the lead over.
- **Ready** once the indexes hold the initial lists and the process can play its
  part: the leader, or a standby that reached the Lease within one lease duration
  (one that cannot reach it could not take over). A standby is ready on purpose: if
  readiness meant leadership, a PodDisruptionBudget with ``minAvailable: 1`` would
  count one healthy pod of two and never let the leader's node drain.

Both answer JSON naming the role, the Lease and its holder, so ``curl`` says who leads.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from sessionfleet.controllers.fleet import Fleet
from sessionfleet.supervise import Supervisor


@dataclass(frozen=True, slots=True)
class Health:
    """The answers of both probes, and why."""

    live: bool
    ready: bool
    detail: dict[str, Any]


def stall_after(resync_seconds: float) -> float:
    """How long a leader's loop may go without finishing a pass before it counts as stuck.

    Generous: a pass waits on the API server, which may be down or slow for a while
    (etcd paused, an API server restarting) without anything being wrong here.
    """
    return max(120.0, 60 * resync_seconds)


def assess(fleet: Fleet, supervisor: Supervisor, now: float) -> Health:
    """Judge the process from its supervisor, indexes, leadership and loop."""
    leadership = fleet.leadership
    leading = leadership.leading
    detail: dict[str, Any] = {
        "role": "leader" if leading else "standby",
        "identity": leadership.identity,
        "lease": leadership.lease,
        "holder": leadership.holder,
        "indexed": fleet.indexed.is_set(),
    }
    problems = []
    if supervisor.failure is not None:
        problems.append(str(supervisor.failure))
    stalled = False
    if leading and fleet.loop_marks.pass_at is not None:
        since = now - fleet.loop_marks.pass_at
        detail["secondsSinceLastPass"] = round(since, 1)
        if since > stall_after(fleet.config.resync_seconds):
            stalled = True
            problems.append(f"the fleet loop has not finished a pass for {since:.0f} s")
    live = supervisor.failure is None and not stalled
    ready = live and fleet.indexed.is_set() and (leading or leadership.in_touch)
    if not fleet.indexed.is_set():
        problems.append("the indexes are not populated yet")
    elif not (leading or leadership.in_touch):
        problems.append(f"the Lease {leadership.lease} has not been reached lately")
    if problems:
        detail["problems"] = problems
    return Health(live, ready, detail)


def health_app(
    fleet: Fleet, supervisor: Supervisor, clock: Callable[[], float] = time.monotonic
) -> web.Application:
    """Return the aiohttp application serving both probes."""

    async def healthz(_: web.Request) -> web.Response:
        health = assess(fleet, supervisor, clock())
        return web.json_response(health.detail, status=200 if health.live else 500)

    async def readyz(_: web.Request) -> web.Response:
        health = assess(fleet, supervisor, clock())
        return web.json_response(health.detail, status=200 if health.ready else 503)

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


async def serve_health(
    fleet: Fleet, supervisor: Supervisor, port: int, host: str = "0.0.0.0"
) -> web.AppRunner:
    """Start serving the probes on ``host:port``; clean up the returned runner to stop."""
    runner = web.AppRunner(health_app(fleet, supervisor), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
