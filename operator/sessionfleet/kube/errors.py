"""The one exception tree for Kubernetes API access.

Callers catch what they can act on: :class:`NotFound` and :class:`Conflict` are
everyday outcomes of level-triggered reconciliation; :class:`TooManyRequests` is the
Eviction API refusing under a PodDisruptionBudget; :class:`ApiUnavailable` means
"retry later". Everything else is a :class:`KubeError` with the server's message.
"""

from __future__ import annotations

from typing import Any


class KubeError(Exception):
    """An API request failed; ``status`` is the HTTP status (0: no answer)."""

    def __init__(self, status: int, message: str, body: dict[str, Any] | None = None) -> None:
        super().__init__(f"{status}: {message}" if status else message)
        self.status = status
        self.message = message
        self.body = body or {}

    @property
    def reason(self) -> str:
        """The server's machine-readable reason (``AlreadyExists``, ``Invalid``…)."""
        return str(self.body.get("reason", ""))


class NotFound(KubeError):
    """404: the object (or its namespace, or its kind) does not exist."""


class Conflict(KubeError):
    """409: it already exists, or the resourceVersion was stale."""


class Forbidden(KubeError):
    """403: RBAC denies the request."""


class Invalid(KubeError):
    """422: the API server rejected the object (schema, CEL, immutable field)."""


class TooManyRequests(KubeError):
    """429: throttled, or an eviction refused by a PodDisruptionBudget."""


class Gone(KubeError):
    """410: a watch's resourceVersion is too old; list again."""


class ApiUnavailable(KubeError):
    """No usable answer: connection failure, timeout or a 5xx; retry later."""


class NotLeading(KubeError):
    """Refused here, never sent: this process does not hold the leadership now.

    Raised by a :class:`~sessionfleet.kube.client.Kube` with a write gate, for every
    request but a read, once the gate closes (see :mod:`sessionfleet.operator.leader`).
    """


_BY_STATUS: dict[int, type[KubeError]] = {
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    410: Gone,
    422: Invalid,
    429: TooManyRequests,
}


def error_for(status: int, body: dict[str, Any] | None, fallback: str) -> KubeError:
    """Return the exception for an HTTP error answer."""
    body = body or {}
    message = str(body.get("message") or fallback)
    if status >= 500:
        return ApiUnavailable(status, message, body)
    return _BY_STATUS.get(status, KubeError)(status, message, body)
