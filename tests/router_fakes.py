"""An in-memory stand-in for the Kubernetes API, for the router's unit tests.

It keeps the semantics the router relies on: create answers 409 when the name exists,
a merge patch carrying ``metadata.resourceVersion`` answers 409 when the object moved
on, the status subresource only changes ``status``, and LIST + WATCH deliver every
change after the listed resourceVersion. The e2e tests run against the real thing.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from typing import Any

from sessionfleet.kube import Conflict, NotFound, Resource


def merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    """RFC 7386 merge patch, in place."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


class FakeKube:
    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.events: list[tuple[int, str, str, dict[str, Any]]] = []
        self.revision = 0
        self.changed = asyncio.Event()
        self.patches: list[tuple[str, dict[str, Any], bool]] = []
        self.creates = 0
        self.deletes = 0

    # --- helpers for tests -----------------------------------------------------------

    def obj(self, plural: str, name: str) -> dict[str, Any]:
        return copy.deepcopy(self.objects[(plural, name)])

    def names(self, plural: str) -> list[str]:
        return sorted(name for kind, name in self.objects if kind == plural)

    def put(self, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Create or replace an object outright (what a test or the operator would do)."""
        key = (plural, obj["metadata"]["name"])
        kind = "MODIFIED" if key in self.objects else "ADDED"
        stored = copy.deepcopy(obj)
        self._store(plural, stored, kind)
        return copy.deepcopy(stored)

    def _store(self, plural: str, obj: dict[str, Any], kind: str) -> None:
        self.revision += 1
        obj["metadata"]["resourceVersion"] = str(self.revision)
        self.objects[(plural, obj["metadata"]["name"])] = obj
        self.events.append((self.revision, plural, kind, copy.deepcopy(obj)))
        self._wake()

    def _wake(self) -> None:
        event, self.changed = self.changed, asyncio.Event()
        event.set()

    # --- the Kube surface the router uses --------------------------------------------

    async def list(
        self, resource: Resource, namespace: str | None = None, **_: Any
    ) -> tuple[list[dict[str, Any]], str]:
        items = [
            copy.deepcopy(o) for (kind, _n), o in self.objects.items() if kind == resource.plural
        ]
        return items, str(self.revision)

    async def pages(
        self, resource: Resource, namespace: str | None = None, **_: Any
    ) -> AsyncIterator[tuple[list[dict[str, Any]], str | None]]:
        # Two pages, as a chunked LIST answers: the resourceVersion comes with the last.
        items, version = await self.list(resource, namespace)
        half = len(items) // 2
        yield items[:half], None
        yield items[half:], version

    async def watch(
        self,
        resource: Resource,
        namespace: str | None = None,
        *,
        resource_version: str = "",
        **_: Any,
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        seen = int(resource_version or 0)
        while True:
            fresh = [e for e in self.events if e[0] > seen and e[1] == resource.plural]
            for revision, _plural, kind, obj in fresh:
                seen = revision
                yield kind, copy.deepcopy(obj)
            if not fresh:
                await self.changed.wait()

    async def create(
        self, resource: Resource, body: dict[str, Any], namespace: str | None = None
    ) -> dict[str, Any]:
        if resource.plural != "leases":
            self.creates += 1
        key = (resource.plural, body["metadata"]["name"])
        if key in self.objects:
            raise Conflict(409, "already exists", {"reason": "AlreadyExists"})
        obj = copy.deepcopy(body)
        obj.setdefault("status", {})
        obj["metadata"]["uid"] = f"uid-{self.revision + 1}"
        self._store(resource.plural, obj, "ADDED")
        return copy.deepcopy(obj)

    async def get(
        self, resource: Resource, name: str, namespace: str | None = None
    ) -> dict[str, Any]:
        try:
            return copy.deepcopy(self.objects[(resource.plural, name)])
        except KeyError:
            raise NotFound(404, f"{name} not found") from None

    async def patch(
        self,
        resource: Resource,
        name: str,
        body: dict[str, Any],
        namespace: str | None = None,
        *,
        status: bool = False,
        resource_version: str | None = None,
        **_: Any,
    ) -> dict[str, Any]:
        if resource_version is not None:
            metadata = {**body.get("metadata", {}), "resourceVersion": str(resource_version)}
            body = {**body, "metadata": metadata}
        if resource.plural != "leases":  # the replica's heartbeat is not a session write
            self.patches.append((name, copy.deepcopy(body), status))
        key = (resource.plural, name)
        if key not in self.objects:
            raise NotFound(404, f"{name} not found")
        obj = copy.deepcopy(self.objects[key])
        wanted = (body.get("metadata") or {}).get("resourceVersion")
        if wanted is not None and wanted != obj["metadata"]["resourceVersion"]:
            raise Conflict(409, "the object has been modified", {"reason": "Conflict"})
        uid = (body.get("metadata") or {}).get("uid")
        if uid is not None and uid != obj["metadata"].get("uid"):
            raise Conflict(409, "Precondition failed: UID in object meta", {"reason": "Conflict"})
        if status:
            merge(obj.setdefault("status", {}), body.get("status") or {})
        else:
            merge(obj, {k: v for k, v in body.items() if k not in ("status", "metadata")})
            meta = {k: v for k, v in (body.get("metadata") or {}).items() if k != "resourceVersion"}
            merge(obj["metadata"], meta)
        self._store(resource.plural, obj, "MODIFIED")
        return copy.deepcopy(obj)

    async def delete(
        self,
        resource: Resource,
        name: str,
        namespace: str | None = None,
        *,
        uid: str | None = None,
        resource_version: str | None = None,
        **_: Any,
    ) -> dict[str, Any]:
        key = (resource.plural, name)
        if key not in self.objects:
            raise NotFound(404, f"{name} not found")
        if uid and self.objects[key]["metadata"].get("uid") != uid:
            raise Conflict(409, "Precondition failed: UID in precondition", {"reason": "Conflict"})
        current = self.objects[key]["metadata"]["resourceVersion"]
        if resource_version and current != resource_version:
            raise Conflict(409, "Precondition failed: ResourceVersion", {"reason": "Conflict"})
        obj = self.objects.pop(key)
        self.deletes += 1
        self.revision += 1
        self.events.append((self.revision, resource.plural, "DELETED", copy.deepcopy(obj)))
        self._wake()
        return obj

    async def aclose(self) -> None:
        return None
