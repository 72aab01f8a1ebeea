"""What a kubelet would run for a container: argv and environment (pure functions).

Implements the parts of the kubelet's container start the pod backer needs:
``$(VAR)`` expansion with Kubernetes' rules, environment variables from literal
values, ``fieldRef`` (the downward API) and ConfigMap/Secret keys, and the readiness
probe's HTTP endpoint.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

#: Looks up one key of a ConfigMap or Secret: (kind, namespace, name, key) -> value,
#: or None when the object or key does not exist.
RefResolver = Callable[[str, str, str, str], str | None]

_LABEL_PATH = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")


class PodSpecError(ValueError):
    """The container cannot be started as specified (the kubelet's CreateContainerConfigError)."""


def expand(text: str, variables: Mapping[str, str]) -> str:
    """Expand ``$(VAR)`` references as the kubelet does.

    ``$(VAR)`` becomes the value of VAR when it is defined and stays as written when
    it is not; ``$$`` is an escaped ``$`` (so ``$$(VAR)`` yields ``$(VAR)``); any
    other ``$`` is kept.
    """
    out: list[str] = []
    index = 0
    while index < len(text):
        char = text[index]
        if char == "$" and index + 1 < len(text):
            following = text[index + 1]
            if following == "$":
                out.append("$")
                index += 2
                continue
            if following == "(":
                end = text.find(")", index + 2)
                if end != -1:
                    name = text[index + 2 : end]
                    out.append(variables.get(name, text[index : end + 1]))
                    index = end + 1
                    continue
        out.append(char)
        index += 1
    return "".join(out)


def field_value(pod: Mapping[str, Any], path: str) -> str:
    """Resolve a downward-API ``fieldRef.fieldPath`` against a pod (API JSON form).

    Raises:
        PodSpecError: for a path the kubelet does not support either.
    """
    metadata = pod.get("metadata", {})
    spec = pod.get("spec", {})
    status = pod.get("status", {})
    simple: dict[str, Any] = {
        "metadata.name": metadata.get("name"),
        "metadata.namespace": metadata.get("namespace"),
        "metadata.uid": metadata.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.hostIP": status.get("hostIP"),
        "status.podIP": status.get("podIP"),
    }
    if path in simple:
        return str(simple[path] or "")
    if path == "status.podIPs":
        return ",".join(item.get("ip", "") for item in status.get("podIPs") or [])
    match = _LABEL_PATH.match(path)
    if match:
        return str((metadata.get(match.group(1)) or {}).get(match.group(2), ""))
    raise PodSpecError(f"unsupported fieldRef.fieldPath {path!r}")


def container_env(
    pod: Mapping[str, Any], container: Mapping[str, Any], resolve_ref: RefResolver
) -> dict[str, str]:
    """The container's environment variables, in declaration order.

    A literal ``value`` may reference variables declared before it; values from
    ``valueFrom`` are taken verbatim, as the kubelet does.

    Raises:
        PodSpecError: a referenced ConfigMap/Secret key is missing and not optional,
            or the source is one the backer does not implement.
    """
    namespace = pod.get("metadata", {}).get("namespace", "")
    variables: dict[str, str] = {}
    for entry in container.get("env") or []:
        name = entry["name"]
        if "valueFrom" not in entry:
            variables[name] = expand(entry.get("value", ""), variables)
            continue
        source = entry["valueFrom"]
        if "fieldRef" in source:
            variables[name] = field_value(pod, source["fieldRef"]["fieldPath"])
            continue
        for key, kind in (("configMapKeyRef", "ConfigMap"), ("secretKeyRef", "Secret")):
            if key in source:
                ref = source[key]
                value = resolve_ref(kind, namespace, ref["name"], ref["key"])
                if value is not None:
                    variables[name] = value
                elif not ref.get("optional", False):
                    raise PodSpecError(f"{kind} {ref['name']!r} has no key {ref['key']!r}")
                break
        else:
            raise PodSpecError(f"env {name}: unsupported valueFrom {sorted(source)}")
    if container.get("envFrom"):
        raise PodSpecError("envFrom is not supported by the pod backer")
    return variables


def container_argv(container: Mapping[str, Any], variables: Mapping[str, str]) -> list[str]:
    """``command`` + ``args`` with ``$(VAR)`` expanded.

    Raises:
        PodSpecError: without ``command`` there is no image entrypoint to fall back to.
    """
    command = list(container.get("command") or [])
    if not command:
        raise PodSpecError("a backed container needs an explicit command (images are not run)")
    return [expand(part, variables) for part in command + list(container.get("args") or [])]


@dataclass(frozen=True)
class HttpProbe:
    """An ``httpGet`` readiness probe, resolved to a URL."""

    url: str


def readiness_probe(pod: Mapping[str, Any], container: Mapping[str, Any]) -> HttpProbe | None:
    """The container's ``httpGet`` readiness probe as a URL, or None if it has none.

    Named ports are looked up in the container's ports; the host defaults to the
    pod IP, as the kubelet probes it.
    """
    probe = container.get("readinessProbe") or {}
    http_get = probe.get("httpGet")
    if not http_get:
        return None
    port = http_get.get("port")
    if isinstance(port, str) and not port.isdigit():
        named = {
            item.get("name"): item.get("containerPort") for item in container.get("ports") or []
        }
        if port not in named:
            raise PodSpecError(f"readinessProbe names unknown port {port!r}")
        port = named[port]
    host = http_get.get("host") or pod.get("status", {}).get("podIP") or "127.0.0.1"
    scheme = str(http_get.get("scheme", "HTTP")).lower()
    path = http_get.get("path", "/")
    if not path.startswith("/"):
        path = "/" + path
    return HttpProbe(f"{scheme}://{host}:{port}{path}")
