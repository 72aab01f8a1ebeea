"""A thin asynchronous Kubernetes API client over httpx.

Only what the operator, router and agent need: get, list (chunked), create, patch
(merge, strategic, JSON or apply; the object or its status), delete, evict and watch.
Every failure is a :mod:`sessionfleet.kube.errors` exception. It never blocks the
event loop: kopf handlers and the router call it directly.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Literal
from urllib.parse import urlencode, urlsplit
from urllib.request import getproxies, proxy_bypass

import httpx

from sessionfleet.kube.config import KubeConfig
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
MAX_IN_FLIGHT = 16
"""Requests open at once per client: enough for 200 writes a second at 80 ms each."""


def environment_proxy(server: str) -> str | None:
    """Return the proxy the environment names for ``server`` (``HTTPS_PROXY``, ``NO_PROXY``).

    As client-go's ``http.ProxyFromEnvironment``: the requests go straight to a
    connection pool, which reads no environment of its own.
    """
    parts = urlsplit(server)
    if not parts.hostname or proxy_bypass(parts.hostname):
        return None
    return getproxies().get(parts.scheme)


def _ssl_context(config: KubeConfig) -> ssl.SSLContext | bool:
    if not config.verify:
        return False
    context = ssl.create_default_context(cafile=config.ca_file)
    if config.cert_file and config.key_file:
        context.load_cert_chain(config.cert_file, config.key_file)
    return context


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
        transport: httpx.AsyncBaseTransport | None = None,
        max_in_flight: int = MAX_IN_FLIGHT,
    ) -> None:
        """Bind a client to ``config``.

        ``write_gate``, when given, is asked before every request but a GET: while it
        answers false the request is refused with :class:`NotLeading`, unsent.
        ``transport`` replaces both connection pools (a benchmark's in-process server).
        At most ``max_in_flight`` requests (watches aside) are open at once; the others
        wait their turn, first come first served.
        """
        self.config = config
        self.field_manager = field_manager
        self.write_gate = write_gate
        self._server = config.server.rstrip("/")
        self._timeout = httpx.Timeout(timeout, connect=10.0)
        self._request_timeout = self._timeout.as_dict()
        self._base_headers = {
            "User-Agent": user_agent,
            "Accept": "application/json",
            "Accept-Encoding": "gzip, deflate",
        }
        verify = _ssl_context(config)
        proxy = environment_proxy(config.server)
        # Requests wait for a turn here, not in the connection pool: httpcore's pool
        # matches every queued request against every connection on each request and
        # response, and asks every idle connection's socket whether it is still open
        # (a few system calls each). With 64 connections, kept open after an API
        # server's slow spell, that was a quarter of the operator's CPU while binding
        # (bench/README.md, "Scale"). A short queue of our own keeps it constant.
        self._turns = asyncio.Semaphore(max_in_flight)
        self._transport = transport or httpx.AsyncHTTPTransport(
            verify=verify,
            proxy=proxy,
            limits=httpx.Limits(
                max_connections=max_in_flight, max_keepalive_connections=max_in_flight
            ),
        )
        # A watch holds its connection for minutes: a pool of its own, so that watches
        # never take the requests' connections nor wait behind them.
        self._watch_transport = transport or httpx.AsyncHTTPTransport(
            verify=verify,
            proxy=proxy,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=8),
        )
        # Requests go to the connection pool directly; only watches stream through the
        # client. A client's own work per request (merging the URL with its base and
        # parsing it again, cookies, auth and redirect flows, hooks) was about half of
        # a request's CPU in the operator's profile, and an API server needs none of it.
        self._http = httpx.AsyncClient(
            base_url=config.server,
            transport=self._watch_transport,
            timeout=self._timeout,
            headers=self._base_headers,
        )

    async def __aenter__(self) -> Kube:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pools."""
        await self._http.aclose()  # and the watches' pool
        if self._transport is not self._watch_transport:
            await self._transport.aclose()

    def _headers(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        headers = {**self._base_headers, **(extra or {})}
        token = self.config.bearer_token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return headers

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
        if method != "GET" and self.write_gate is not None and not self.write_gate():
            raise NotLeading(0, f"{method} {path}: not sent, this process is not the leader")
        content = None if body is None else json.dumps(body).encode()
        headers = self._headers({"Content-Type": content_type} if content is not None else None)
        url = f"{self._server}{path}?{urlencode(params)}" if params else self._server + path
        request = httpx.Request(
            method,
            url,
            content=content,
            headers=headers,
            extensions={"timeout": self._request_timeout},
        )
        try:
            async with self._turns:
                response = await self._transport.handle_async_request(request)
                try:
                    await response.aread()
                finally:
                    await response.aclose()
        except httpx.HTTPError as error:
            raise ApiUnavailable(0, f"{method} {path}: {error!r}") from error
        payload: dict[str, Any] = {}
        if response.content:
            try:
                payload = response.json()
            except ValueError:
                payload = {"message": response.text[:500]}
        if response.is_error:
            raise error_for(response.status_code, payload, f"{method} {path} failed")
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
        grace_period_seconds: int | None = None,
        propagation: str | None = None,
    ) -> dict[str, Any]:
        """Delete an object; with ``uid``, only that incarnation of the name."""
        options: dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1"}
        if uid:
            options["preconditions"] = {"uid": uid}
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
        timeout = httpx.Timeout(timeout_seconds + 30, connect=10.0)
        try:
            async with self._http.stream(
                "GET",
                resource.path(namespace),
                params=params,
                headers=self._headers(),
                timeout=timeout,
            ) as response:
                if response.is_error:
                    await response.aread()
                    try:
                        payload = response.json()
                    except ValueError:
                        payload = {}
                    raise error_for(response.status_code, payload, "watch failed")
                async for line in response.aiter_lines():
                    if not line:
                        continue
                    event = json.loads(line)
                    kind, obj = event.get("type", ""), event.get("object") or {}
                    if kind == "ERROR":
                        raise error_for(int(obj.get("code", 500)), obj, "watch error")
                    yield kind, obj
        except httpx.HTTPError as error:
            raise ApiUnavailable(0, f"watch {resource.plural}: {error!r}") from error


__all__ = ["Kube", "KubeError", "PatchType"]
