"""List-then-watch, forever: an in-memory view of one resource kept in sync.

The router keeps bindings in memory from this; restarts rebuild from a fresh list.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from sessionfleet.kube.client import Kube
from sessionfleet.kube.errors import ApiUnavailable, Gone, KubeError
from sessionfleet.kube.resources import Resource

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Event:
    """One change: ``SYNC`` carries the complete list (after start or a relist).

    The list's items are what ``reflect``'s ``convert`` made of each object (the object
    itself by default); the other events carry the object.
    """

    type: str
    obj: dict[str, Any] | None = None
    items: tuple[Any, ...] = ()


def _as_is(obj: dict[str, Any]) -> Any:
    return obj


async def reflect(
    kube: Kube,
    resource: Resource,
    namespace: str | None = None,
    *,
    label_selector: str | None = None,
    retry_delay: float = 1.0,
    convert: Callable[[dict[str, Any]], Any] = _as_is,
) -> AsyncIterator[Event]:
    """Yield a SYNC event with every object, then ADDED/MODIFIED/DELETED events.

    A broken connection or a failed request resumes the watch from the last
    resourceVersion seen, as client-go's reflector does: nothing is missed and nothing
    is listed again. Only when that version has expired (410 Gone: after a long
    outage, an API server restart, a compaction) does it list again and yield a fresh
    SYNC, so a consumer that replaces its state on SYNC never drifts.

    The list is read in chunks and each chunk passed through ``convert`` as it comes,
    so a consumer that keeps less than the object (the router's views) never holds the
    whole list of objects at once.
    """
    resource_version = ""
    while True:
        try:
            if not resource_version:
                items: list[Any] = []
                listed = ""
                async for page, last in kube.pages(
                    resource, namespace, label_selector=label_selector
                ):
                    items.extend(convert(obj) for obj in page)
                    listed = last or listed
                resource_version = listed
                yield Event("SYNC", items=tuple(items))
                del items
            async for kind, obj in kube.watch(
                resource,
                namespace,
                resource_version=resource_version,
                label_selector=label_selector,
            ):
                resource_version = obj.get("metadata", {}).get("resourceVersion", resource_version)
                if kind != "BOOKMARK":
                    yield Event(kind, obj)
        except Gone as error:
            # Normal after a long disconnect or an API server restart; worth a line.
            log.info("watch of %s expired (410 Gone: %s); listing again", resource.plural, error)
            resource_version = ""
        except (ApiUnavailable, KubeError) as error:
            log.warning(
                "watch of %s interrupted: %s; resuming from %s",
                resource.plural,
                error,
                resource_version or "a fresh list",
            )
            await asyncio.sleep(retry_delay)
