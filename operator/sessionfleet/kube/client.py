"""A thin asynchronous Kubernetes API client over httpcore.

Only what the operator, router and agent need: get, list (chunked), create, patch
(merge, strategic, JSON or apply; the object or its status), delete, evict and watch.
Every failure is a :mod:`sessionfleet.kube.errors` exception. It never blocks the
event loop: kopf handlers and the router call it directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import ssl
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlencode, urlsplit
from urllib.request import getproxies, proxy_bypass

import httpcore

from sessionfleet.kube.config import KubeConfig
from sessionfleet.kube.connections import (
    TRANSPORT_ERRORS,
    Connect,
    Connections,
    decoded,
    factory,
    origin_of,
    url_at,
)
from sessionfleet.kube.errors import ApiUnavailable, KubeError, NotLeading, error_for
from sessionfleet.kube.resources import PODS, Resource

PatchType = Literal["merge", "strategic", "json", "apply"]
_CONTENT_TYPES: dict[PatchType, str] = {
    "merge": "application/merge-patch+json",
    "strategic": "application/strategic-merge-patch+json",
    "json": "application/json-patch+json",
    "apply": "application/apply-patch+yaml",
}
FIELD_MANAGER = "sessionfleet"
MAX_IN_FLIGHT = 64
"""Requests open at once per client (watches aside), as many connections kept open."""
CONNECT_SECONDS = 10.0
"""How long a new connection may take, TLS handshake included."""
MAX_EVENT_BYTES = 64 * 1024 * 1024
"""The longest watch event read (etcd refuses objects over 1.5 MiB by default)."""
KEEPALIVE_SECONDS = 5.0
"""A connection idle for longer is closed (httpx's default)."""
HOLD_WRITES_ENV = "SESSIONFLEET_TEST_HOLD_WRITES"
"""Test-only (e2e/test_leader.py): while the file this names exists, every write waits
just after its gate check, as in a process paused at that instant, and a file beside it
(``.held``) says one does. Never set in production."""


def environment_proxy(server: str) -> str | None:
    """Return the proxy the environment names for ``server`` (``HTTPS_PROXY``, ``NO_PROXY``).

    As client-go's ``http.ProxyFromEnvironment``: the requests go straight to a
    connection pool, which reads no environment of its own.
    """
    parts = urlsplit(server)
    if not parts.hostname or proxy_bypass(parts.hostname):
        return None
    return getproxies().get(parts.scheme)


def _ssl_context(config: KubeConfig) -> ssl.SSLContext:
    if config.verify:
        context = ssl.create_default_context(cafile=config.ca_file)
    else:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if config.cert_file and config.key_file:
        context.load_cert_chain(config.cert_file, config.key_file)
    return context


async def _held(hold: Path) -> None:
    """Wait while ``hold`` exists (:data:`HOLD_WRITES_ENV`)."""
    while hold.exists():
        hold.with_suffix(".held").touch()
        await asyncio.sleep(0.05)


Page = list[dict[str, Any]]
"""One page of a chunked LIST (the name, because ``Kube.list`` hides the builtin)."""


class Kube:
    """An API client bound to one cluster. Use as ``async with Kube(config) as kube``."""

    def __init__(
        self,
        config: KubeConfig,
        *,
        timeout: float = 30.0,
        field_manager: str = FIELD_MANAGER,
        user_agent: str = "sessionfleet",
        write_gate: Callable[[], bool] | None = None,
        write_timeout: float | None = None,
        max_in_flight: int = MAX_IN_FLIGHT,
        connect: Connect | None = None,
    ) -> None:
        """Bind a client to ``config``.

        ``write_gate``, when given, is asked before every request but a GET, when it is
        admitted and again when it is sent (once it has its turn and a connection):
        while it answers false the request is refused with :class:`NotLeading`, unsent.
        ``write_timeout``, when given, bounds such a request's whole life, from admission
        to its answer (queue, connection, sending, the API server's work, which is told
        the same deadline): a write admitted while the gate was open lands within that
        time or not at all (docs/operator.md, "Fencing"). The timeout is
        :class:`ApiUnavailable`, as any request without an answer.
        At most ``max_in_flight`` requests (watches aside) are open at once; the others
        wait their turn, first come first served (:mod:`sessionfleet.kube.connections`).
        ``connect`` replaces the requests' connections (a benchmark's in-process server).
        """
        self.config = config
        self.field_manager = field_manager
        self.write_gate = write_gate
        self.write_timeout = write_timeout
        self._hold_writes = os.environ.get(HOLD_WRITES_ENV) if write_gate is not None else None
        self._server = config.server.rstrip("/")
        self._request_timeout = {
            "connect": CONNECT_SECONDS,
            "read": timeout,
            "write": timeout,
            "pool": timeout,
        }
        self._base_headers = {
            "User-Agent": user_agent,
            "Accept": "application/json",
            "Accept-Encoding": "gzip, deflate",
        }
        context = _ssl_context(config)
        proxy = environment_proxy(config.server)
        server = urlsplit(self._server)
        self._host_header = server.netloc.encode()
        self._prefix = server.path
        self._origin = origin_of(server)
        self._request_headers = [(k.encode(), v.encode()) for k, v in self._base_headers.items()]
        # No Accept-Encoding on watches: a stream of small events is sent as it is.
        self._watch_headers = [h for h in self._request_headers if h[0] != b"Accept-Encoding"]
        self._requests = Connections(
            self._origin,
            connect or factory(context, proxy, KEEPALIVE_SECONDS),
            size=max_in_flight,
            keepalive=KEEPALIVE_SECONDS,
        )
        # Watches stream on connections of their own, one each for minutes, so that
        # they never take the requests' connections nor wait for them.
        self._watch_connect = factory(context, proxy, 0.0)

    async def __aenter__(self) -> Kube:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connections."""
        await self._requests.aclose()

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str | int] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        """Send one request; return the decoded JSON answer or raise a KubeError."""
        if method == "GET":
            return await self._send(method, path, params, body, content_type, None)
        self._check_gate(method, path)
        if self.write_timeout is not None:
            # The API server is given the same deadline (its ``timeout`` parameter): a
            # write it has not done by then, waiting in its own queues, it no longer does.
            params = {**(params or {}), "timeout": f"{max(int(self.write_timeout), 1)}s"}
        try:
            async with asyncio.timeout(self.write_timeout):  # None: no bound
                if self._hold_writes:
                    await _held(Path(self._hold_writes))
                return await self._send(method, path, params, body, content_type, self._check_gate)
        except TimeoutError as error:
            if self.write_timeout is None:
                raise
            raise ApiUnavailable(
                0, f"{method} {path}: no answer within {self.write_timeout:g} s"
            ) from error

    def _check_gate(self, method: str = "", path: str = "") -> None:
        if self.write_gate is not None and not self.write_gate():
            raise NotLeading(0, f"{method} {path}: not sent, this process is not the leader")

    def _head(self, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """Return a request's headers: the Host, ``headers`` and the current bearer token."""
        head = [(b"Host", self._host_header), *headers]
        token = self.config.bearer_token()
        if token:
            head.append((b"Authorization", f"Bearer {token}".encode()))
        return head

    async def _send(
        self,
        method: str,
        path: str,
        params: Mapping[str, str | int] | None,
        body: Any,
        content_type: str,
        gate: Callable[[str, str], None] | None,
    ) -> dict[str, Any]:
        target = f"{self._prefix}{path}?{urlencode(params)}" if params else self._prefix + path
        headers = self._head(self._request_headers)
        content = b""
        if body is not None:
            content = json.dumps(body).encode()
            headers.append((b"Content-Type", content_type.encode()))
            headers.append((b"Content-Length", str(len(content)).encode()))
        request = httpcore.Request(
            method.encode(),
            url_at(self._origin, target),
            headers=headers,
            content=content,
            extensions={"timeout": self._request_timeout},
        )
        try:
            ready = None if gate is None else functools.partial(gate, method, path)
            answer = await self._requests.send(request, ready)
            text = decoded(answer)
        except TRANSPORT_ERRORS as error:
            raise ApiUnavailable(0, f"{method} {path}: {error!r}") from error
        payload: dict[str, Any] = {}
        if text:
            try:
                payload = json.loads(text)
            except ValueError:
                payload = {"message": text[:500].decode(errors="replace")}
        if answer.status >= 400:
            raise error_for(answer.status, payload, f"{method} {path} failed")
        return payload

    async def get(
        self, resource: Resource, name: str, namespace: str | None = None
    ) -> dict[str, Any]:
        """Return one object."""
        return await self.request("GET", resource.path(namespace, name))

    async def list(
        self,
        resource: Resource,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        chunk: int = 500,
    ) -> tuple[list[dict[str, Any]], str]:
        """Return every object and the list's resourceVersion, fetched in chunks."""
        items: list[dict[str, Any]] = []
        version = ""
        async for page, last in self.pages(
            resource,
            namespace,
            label_selector=label_selector,
            field_selector=field_selector,
            chunk=chunk,
        ):
            items.extend(page)
            version = last or version
        return items, version

    async def pages(
        self,
        resource: Resource,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        chunk: int = 500,
    ) -> AsyncIterator[tuple[Page, str | None]]:
        """Yield a chunked LIST page by page; the last page carries the resourceVersion.

        A caller that turns each page into something smaller as it comes never holds
        the whole list of objects: a relist of 100,000 sessions is 4 KB each.
        """
        params: dict[str, str | int] = {"limit": chunk}
        if label_selector:
            params["labelSelector"] = label_selector
        if field_selector:
            params["fieldSelector"] = field_selector
        while True:
            page = await self.request("GET", resource.path(namespace), params=params)
            meta = page.get("metadata") or {}
            more = meta.get("continue")
            yield page.get("items") or [], None if more else str(meta.get("resourceVersion", ""))
            if not more:
                return
            params["continue"] = more

    async def create(
        self, resource: Resource, body: Mapping[str, Any], namespace: str | None = None
    ) -> dict[str, Any]:
        """Create an object; :class:`Conflict` when it exists."""
        return await self.request(
            "POST",
            resource.path(namespace),
            params={"fieldManager": self.field_manager},
            body=body,
        )

    async def patch(
        self,
        resource: Resource,
        name: str,
        body: Any,
        namespace: str | None = None,
        *,
        status: bool = False,
        patch_type: PatchType = "merge",
        resource_version: int | str | None = None,
    ) -> dict[str, Any]:
        """Patch an object, or its status subresource when ``status`` is true.

        With ``resource_version`` (a merge patch), the API server applies the patch only
        to that version of the object and answers :class:`Conflict` otherwise: a write
        decided from a copy that someone has since changed fails instead of winning.
        """
        if resource_version is not None:
            if patch_type != "merge":
                raise ValueError("a resourceVersion precondition needs a merge patch")
            metadata = {**body.get("metadata", {}), "resourceVersion": str(resource_version)}
            body = {**body, "metadata": metadata}
        path = resource.path(namespace, name) + ("/status" if status else "")
        params: dict[str, str | int] = {"fieldManager": self.field_manager}
        if patch_type == "apply":
            params["force"] = "true"
        return await self.request(
            "PATCH", path, params=params, body=body, content_type=_CONTENT_TYPES[patch_type]
        )

    async def delete(
        self,
        resource: Resource,
        name: str,
        namespace: str | None = None,
        *,
        uid: str | None = None,
        resource_version: int | str | None = None,
        grace_period_seconds: int | None = None,
        propagation: str | None = None,
    ) -> dict[str, Any]:
        """Delete an object; with ``uid``, only that incarnation of the name.

        With ``resource_version`` too, only that version of it (:class:`Conflict`
        otherwise): a delete decided from a copy that someone has since changed fails.
        """
        options: dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1"}
        preconditions: dict[str, str] = {}
        if uid:
            preconditions["uid"] = uid
        if resource_version:
            preconditions["resourceVersion"] = str(resource_version)
        if preconditions:
            options["preconditions"] = preconditions
        if grace_period_seconds is not None:
            options["gracePeriodSeconds"] = grace_period_seconds
        if propagation:
            options["propagationPolicy"] = propagation
        return await self.request("DELETE", resource.path(namespace, name), body=options)

    async def evict(self, pod: str, namespace: str) -> dict[str, Any]:
        """Ask the Eviction API to evict a pod; :class:`TooManyRequests` under a PDB."""
        body = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": pod, "namespace": namespace},
        }
        return await self.request("POST", PODS.path(namespace, pod) + "/eviction", body=body)

    async def watch(
        self,
        resource: Resource,
        namespace: str | None = None,
        *,
        resource_version: str = "",
        timeout_seconds: int = 300,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """Yield ``(type, object)`` events until the server ends the watch.

        Types are ADDED, MODIFIED, DELETED and BOOKMARK; a :class:`Gone` error means
        the resourceVersion expired and the caller must list again.
        """
        params: dict[str, str | int] = {
            "watch": 1,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": timeout_seconds,
        }
        if resource_version:
            params["resourceVersion"] = resource_version
        if label_selector:
            params["labelSelector"] = label_selector
        if field_selector:
            params["fieldSelector"] = field_selector
        target = f"{self._prefix}{resource.path(namespace)}?{urlencode(params)}"
        request = httpcore.Request(
            b"GET",
            url_at(self._origin, target),
            headers=self._head(self._watch_headers),
            extensions={"timeout": {**self._request_timeout, "read": timeout_seconds + 30}},
        )
        connection = self._watch_connect(self._origin)
        try:
            response = await connection.handle_async_request(request)
            try:
                if response.status >= 400:
                    payload: dict[str, Any] = {}
                    with contextlib.suppress(ValueError):
                        payload = json.loads(await response.aread())
                    raise error_for(response.status, payload, "watch failed")
                async for line in _lines(response.aiter_stream()):
                    event = json.loads(line)
                    if not isinstance(event, dict):
                        raise ValueError(f"a watch event is an object, not {line[:80]!r}")
                    kind, obj = event.get("type", ""), event.get("object") or {}
                    if kind == "ERROR":
                        raise error_for(int(obj.get("code", 500)), obj, "watch error")
                    yield kind, obj
            finally:
                await response.aclose()
        except TRANSPORT_ERRORS as error:
            raise ApiUnavailable(0, f"watch {resource.plural}: {error!r}") from error
        except ValueError as error:  # not JSON: the stream is not the API server's
            raise ApiUnavailable(0, f"watch {resource.plural}: {error}") from error
        finally:
            await connection.aclose()


async def _lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Yield the non-empty lines of a byte stream, however its chunks cut them.

    A line longer than :data:`MAX_EVENT_BYTES` is a ValueError: no object the API
    server stores comes near it, and a stream that never ends its line is not kept.
    """
    pending = b""
    async for chunk in chunks:
        pending += chunk
        *lines, pending = pending.split(b"\n")
        if len(pending) > MAX_EVENT_BYTES:
            raise ValueError(f"a watch event over {MAX_EVENT_BYTES} bytes")
        for line in lines:
            if line.strip():
                yield line
    if pending.strip():
        yield pending


__all__ = ["Kube", "KubeError", "PatchType"]
