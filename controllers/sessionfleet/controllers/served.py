"""Every kind the operator's kopf handlers need: found when kopf starts, watched for good.

Kopf learns which resources exist from the API server's discovery once, when it
starts, and looks again only when a CustomResourceDefinition changes. An operator
that starts while the API server is itself starting (a restart, an upgrade, a control
plane brought back) can meet discovery without the custom resources' group yet (a
503 "the request has been made before all known HTTP paths have been installed", or a
404 for ``/apis/sessionfleet.dev/v1alpha1``). Kopf then logs "Unresolved resources
cannot be served" and never watches InferenceWorkers for the life of the process,
while its node events tell the fleet its indexes are filled: a leader that sees no
worker at all. The chaos suite met exactly this (a replica restarted 2 s into an API
server's start bound no session for the minute it was given).

And kopf retries a failed request a fixed number of times, then gives the error to
the caller; for a watch that is the end of the watcher task: an API server away
longer than the retries last leaves that kind unwatched, again silently.

So, as client-go's reflectors do, the operator never gives up on a watch:

- :func:`wait_until_served`: before kopf starts, wait until discovery lists every kind
  a handler indexes or watches;
- :func:`check_kopf_scan`: after kopf's own scan, check it found them all; if it
  missed one (the API server restarted in between), wait until discovery serves it
  and fail, so the process exits and starts again (a pod is restarted by the kubelet);
- :class:`RetryForever`: kopf's request backoffs, endless, capped at 30 s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from itertools import repeat

from sessionfleet.controllers.kopfcompat import Insights, OperatorRegistry, registered_handlers
from sessionfleet.kube import Kube, KubeError, NotFound

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, order=True)
class WatchedKind:
    """A resource by group, version and plural, as discovery lists it."""

    group: str
    version: str
    plural: str

    @property
    def group_version(self) -> tuple[str, str]:
        """The kind's group and version, as discovery groups them."""
        return (self.group, self.version)

    def __str__(self) -> str:
        return f"{self.plural}.{self.group}/{self.version}" if self.group else self.plural


class KindsNotWatched(RuntimeError):
    """Kopf's scan of the API missed kinds its handlers need; a new start finds them."""


class RetryForever:
    """Kopf's ``error_backoffs``: the given delays, then ``then`` seconds, without end.

    Kopf walks the delays once per request and gives up after the last; iterating
    this never ends, so a request (a watch, the initial scan) retries until the API
    server answers. Each request gets a fresh iterator.
    """

    def __init__(self, delays: Iterable[float] = (1, 2, 5, 10), then: float = 30) -> None:
        self.delays = tuple(delays)
        self.then = then

    def __iter__(self) -> Iterator[float]:
        yield from self.delays
        yield from repeat(self.then)


def watched_kinds(registry: OperatorRegistry) -> frozenset[WatchedKind]:
    """Return every kind a handler in ``registry`` indexes or watches.

    Raises:
        ValueError: a handler's selector names no exact group, version and plural,
            which this check (and discovery) could not match.

    """
    kinds = set()
    for handler in registered_handlers(registry):
        selector = handler.selector
        if selector is None:
            raise ValueError(f"handler {handler.id}: it watches no resource")
        name = selector.plural or selector.any_name
        if selector.group is None or not selector.version or not isinstance(name, str):
            raise ValueError(f"handler {handler.id}: its selector {selector} is not exact")
        kinds.add(WatchedKind(selector.group, selector.version, name))
    return frozenset(kinds)


def discovery_path(group: str, version: str) -> str:
    """Where the API server lists a group version's resources."""
    return f"/api/{version}" if not group else f"/apis/{group}/{version}"


def missing(
    kinds: Collection[WatchedKind], served: Mapping[tuple[str, str], Collection[str]]
) -> list[WatchedKind]:
    """Return the kinds that ``served`` (plurals by group version) does not list, sorted."""
    return sorted(k for k in kinds if k.plural not in served.get(k.group_version, ()))


async def discover(
    kube: Kube, group_versions: Iterable[tuple[str, str]]
) -> dict[tuple[str, str], frozenset[str]]:
    """Return the plurals each group version serves now (none where it is not found).

    Raises:
        KubeError: the API server did not answer (down, starting: 503).

    """
    served = {}
    for group, version in group_versions:
        try:
            answer = await kube.request("GET", discovery_path(group, version))
        except NotFound:
            answer = {}
        names = (str(r.get("name", "")) for r in answer.get("resources") or ())
        served[(group, version)] = frozenset(n for n in names if "/" not in n)
    return served


async def wait_until_served(
    kube: Kube,
    kinds: Collection[WatchedKind],
    *,
    interval: float = 1.0,
    say_every: float = 30.0,
) -> None:
    """Return once discovery lists every kind; say what is missing now and then."""
    group_versions = sorted({k.group_version for k in kinds})
    said_at: float | None = None
    while True:
        try:
            absent = missing(kinds, await discover(kube, group_versions))
            why = "not in discovery: " + ", ".join(map(str, absent))
        except KubeError as error:
            absent, why = list(kinds), f"discovery failed: {error}"
        if not absent:
            if said_at is not None:
                log.info("the API server serves every kind the operator watches")
            return
        if said_at is None or time.monotonic() - said_at >= say_every:
            log.warning("waiting for the API server to serve what the operator watches (%s)", why)
            said_at = time.monotonic()
        await asyncio.sleep(interval)


async def check_kopf_scan(insights: Insights, kinds: Collection[WatchedKind], kube: Kube) -> None:
    """Once kopf's scan is done, check it watches every kind; fail once they are served.

    Raises:
        KindsNotWatched: kopf's scan missed some kind (discovery lacked it then); raised
            only once discovery lists it again, so that the next start finds it.

    """
    await insights.ready_resources.wait()
    resources = insights.watched_resources | insights.indexed_resources
    found = {WatchedKind(r.group, r.version, r.plural) for r in resources}
    absent = sorted(set(kinds) - found)
    if not absent:
        return
    names = ", ".join(map(str, absent))
    log.error("kopf's scan of the API found no %s; the operator starts again once it can", names)
    await wait_until_served(kube, absent)
    raise KindsNotWatched(f"kopf watches no {names}: its scan ran before the API served them")


__all__ = [
    "KindsNotWatched",
    "RetryForever",
    "WatchedKind",
    "check_kopf_scan",
    "discover",
    "missing",
    "wait_until_served",
    "watched_kinds",
]
