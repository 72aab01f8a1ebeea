"""Resource paths and the error tree; the client itself is exercised in e2e/."""

from __future__ import annotations

import pytest

from sessionfleet.kube import (
    NODES,
    PDBS,
    PODS,
    SESSIONS,
    ApiUnavailable,
    Conflict,
    Forbidden,
    Gone,
    Invalid,
    KubeError,
    NotFound,
    TooManyRequests,
)
from sessionfleet.kube.errors import error_for


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        (PODS.path("ns"), "/api/v1/namespaces/ns/pods"),
        (PODS.path("ns", "p"), "/api/v1/namespaces/ns/pods/p"),
        (PODS.path(), "/api/v1/pods"),
        (NODES.path("ignored", "n1"), "/api/v1/nodes/n1"),
        (PDBS.path("ns"), "/apis/policy/v1/namespaces/ns/poddisruptionbudgets"),
        (
            SESSIONS.path("ns", "s"),
            "/apis/sessionfleet.dev/v1alpha1/namespaces/ns/agentsessions/s",
        ),
    ],
)
def test_paths(path: str, expected: str) -> None:
    assert path == expected


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        (403, Forbidden),
        (404, NotFound),
        (409, Conflict),
        (410, Gone),
        (422, Invalid),
        (429, TooManyRequests),
        (500, ApiUnavailable),
        (503, ApiUnavailable),
        (400, KubeError),
    ],
)
def test_error_for_status(status: int, cls: type[KubeError]) -> None:
    error = error_for(status, {"message": "m", "reason": "R"}, "fallback")
    assert type(error) is cls
    assert error.status == status and error.message == "m" and error.reason == "R"


def test_error_without_body_uses_fallback() -> None:
    assert error_for(404, None, "GET /x failed").message == "GET /x failed"
