"""Who may call the node agent: the TokenReview decision, the token cache, per-node tokens.

The decision is a pure function over a TokenReview's status; the reviewer and the
operator's token source talk to a stand-in API server on 127.0.0.1 (the real
TokenRequest and TokenReview run in e2e/test_agent_auth.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from sessionfleet.agent.auth import (
    REVIEW_CACHE_SECONDS,
    Access,
    StaticToken,
    TokenReviewer,
    review_verdict,
)
from sessionfleet.checkpoint.agent_tokens import AgentTokens, node_audience
from sessionfleet.cli import build_parser
from sessionfleet.kube import Kube, KubeConfig, KubeError
from sessionfleet.operator.drivers.criu import AgentAccess

OPERATOR = "system:serviceaccount:sessionfleet-system:sessionfleet-operator"
PROMETHEUS = "system:serviceaccount:monitoring:prometheus"
AUDIENCE = node_audience("gpu-1")


def status(
    username: str = OPERATOR, audiences: list[str] | None = None, **extra: Any
) -> dict[str, Any]:
    return {
        "authenticated": True,
        "user": {"username": username},
        "audiences": [AUDIENCE] if audiences is None else audiences,
        **extra,
    }


@pytest.mark.parametrize(
    ("review", "audience", "refusal"),
    [
        (status(), AUDIENCE, None),
        ({}, AUDIENCE, "not accepted"),
        (status(authenticated=False), AUDIENCE, "not accepted"),
        (status(authenticated="true"), AUDIENCE, "not accepted"),  # only a real true
        (status(error="token expired"), AUDIENCE, "token expired"),
        # A token the operator got for another node: refused here.
        (status(audiences=[node_audience("gpu-2")]), AUDIENCE, "not for this node"),
        (status(audiences=[]), AUDIENCE, "not for this node"),
        # The operator's ServiceAccount with the API server's own audience: not for us.
        (status(audiences=["https://kubernetes.default.svc"]), AUDIENCE, "not for this node"),
        (status(username="system:serviceaccount:llama:default"), AUDIENCE, "may not"),
        (status(username=""), AUDIENCE, "an anonymous caller may not"),
        (status(username=OPERATOR.upper()), AUDIENCE, "may not"),
        # A metrics reader: the API server's audience is checked by the server.
        (status(username=PROMETHEUS, audiences=["https://kubernetes.default.svc"]), None, None),
    ],
)
def test_the_review_verdict(
    review: dict[str, Any], audience: str | None, refusal: str | None
) -> None:
    allowed = frozenset({OPERATOR, PROMETHEUS}) if audience is None else frozenset({OPERATOR})
    verdict = review_verdict(review, audience, allowed)
    if refusal is None:
        assert verdict is None
    else:
        assert verdict is not None and refusal in verdict


async def test_the_static_token_is_compared_exactly() -> None:
    static = StaticToken("s3cret")
    assert await static.refusal("s3cret", Access.OPERATE) is None
    for offered in ("", "s3cre", "s3cretx", "S3CRET", "s3cr\udcff"):
        assert await static.refusal(offered, Access.OPERATE) is not None


@dataclass
class ApiServer:
    """A stand-in API server: TokenReview answers from a table, TokenRequest counts."""

    kube: Kube
    tokens: dict[tuple[str, str | None], dict[str, Any]]
    """(token, audience or None) → the review's status."""
    reviews: list[dict[str, Any]] = field(default_factory=list)
    requests: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


@pytest.fixture
async def api() -> AsyncIterator[ApiServer]:
    tokens: dict[tuple[str, str | None], dict[str, Any]] = {}
    reviews: list[dict[str, Any]] = []
    requests: list[tuple[str, dict[str, Any]]] = []

    async def review(request: web.Request) -> web.Response:
        body = await request.json()
        reviews.append(body)
        audiences = body["spec"].get("audiences")
        key = (body["spec"]["token"], audiences[0] if audiences else None)
        return web.json_response({**body, "status": tokens.get(key, {"authenticated": False})})

    async def token_request(request: web.Request) -> web.Response:
        body = await request.json()
        requests.append((request.match_info["name"], body))
        if request.match_info["name"] == "tokenless":
            return web.json_response({**body, "status": {}})
        audience = body["spec"]["audiences"][0]
        return web.json_response({**body, "status": {"token": f"token-{len(requests)}-{audience}"}})

    app = web.Application()
    app.router.add_post("/apis/authentication.k8s.io/v1/tokenreviews", review)
    app.router.add_post(
        "/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token", token_request
    )
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    kube = Kube(KubeConfig(server=str(server.make_url("")).rstrip("/")))
    yield ApiServer(kube, tokens, reviews, requests)
    await kube.aclose()
    await server.close()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_token_is_reviewed_for_this_nodes_audience_and_cached(api: ApiServer) -> None:
    clock = Clock()
    reviewer = TokenReviewer(api.kube, "gpu-1", frozenset({OPERATOR}), clock=clock)
    api.tokens[("for-gpu-1", AUDIENCE)] = status()
    api.tokens[("for-gpu-2", node_audience("gpu-2"))] = status(audiences=[node_audience("gpu-2")])
    assert await reviewer.refusal("for-gpu-1", Access.OPERATE) is None
    assert api.reviews[0]["spec"] == {"token": "for-gpu-1", "audiences": [AUDIENCE]}
    assert await reviewer.refusal("for-gpu-1", Access.OPERATE) is None
    assert len(api.reviews) == 1, "accepted tokens are cached"
    clock.now += REVIEW_CACHE_SECONDS + 1
    assert await reviewer.refusal("for-gpu-1", Access.OPERATE) is None
    assert len(api.reviews) == 2, "and asked about again once the cache expired"
    # The token another node's agent saw, replayed here: reviewed for *this* audience.
    refusal = await reviewer.refusal("for-gpu-2", Access.OPERATE)
    assert refusal is not None and "not accepted" in refusal
    assert await reviewer.refusal("", Access.OPERATE) is not None


async def test_metrics_readers_read_metrics_and_nothing_else(api: ApiServer) -> None:
    reviewer = TokenReviewer(api.kube, "gpu-1", frozenset({OPERATOR}), frozenset({PROMETHEUS}))
    api.tokens[("prom", None)] = status(username=PROMETHEUS, audiences=["api"])
    api.tokens[("operator", AUDIENCE)] = status()
    assert await reviewer.refusal("prom", Access.READ_METRICS) is None
    assert await reviewer.refusal("prom", Access.OPERATE) is not None
    assert await reviewer.refusal("operator", Access.READ_METRICS) is None
    assert await reviewer.refusal("operator", Access.OPERATE) is None
    # An operator token with the API server's audience is no metrics reader.
    api.tokens[("op-api", None)] = status(audiences=["api"])
    assert await reviewer.refusal("op-api", Access.READ_METRICS) is not None


async def test_an_unreachable_api_server_refuses(api: ApiServer) -> None:
    async with Kube(KubeConfig(server="http://127.0.0.1:9")) as kube:
        reviewer = TokenReviewer(kube, "gpu-1", frozenset({OPERATOR}))
        refusal = await reviewer.refusal("anything", Access.OPERATE)
    assert refusal is not None and "could not review" in refusal


def test_a_reviewer_needs_an_operator(api: ApiServer) -> None:
    with pytest.raises(ValueError, match="operator identity"):
        TokenReviewer(api.kube, "gpu-1", frozenset())


async def test_the_operator_requests_one_token_per_node_and_reuses_it(api: ApiServer) -> None:
    clock = Clock()
    tokens = AgentTokens(api.kube, "sessionfleet-system", "sessionfleet-operator", clock=clock)
    first = await tokens.for_node("gpu-1")
    assert await tokens.for_node("gpu-1") == first
    other = await tokens.for_node("gpu-2")
    assert other != first and other.endswith(node_audience("gpu-2"))
    assert [(name, body["spec"]) for name, body in api.requests] == [
        ("sessionfleet-operator", {"audiences": [AUDIENCE], "expirationSeconds": 600}),
        (
            "sessionfleet-operator",
            {"audiences": [node_audience("gpu-2")], "expirationSeconds": 600},
        ),
    ]
    clock.now += 301  # past half its life
    assert await tokens.for_node("gpu-1") != first
    assert len(api.requests) == 3


async def test_an_answer_without_a_token_is_a_kube_error(api: ApiServer) -> None:
    with pytest.raises(KubeError, match="holds no token"):
        await AgentTokens(api.kube, "ns", "tokenless").for_node("gpu-1")


@pytest.mark.parametrize("text", ["sf", "sf/", "/op", "SF/op", "sf/op/x", "sf/Op"])
def test_the_operators_service_account_flag_is_checked(
    text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["operator", f"--agent-service-account={text}"])
    assert "NAMESPACE/NAME" in capsys.readouterr().err


async def test_how_the_operator_authenticates_to_the_agents(api: ApiServer, tmp_path: Any) -> None:
    assert AgentAccess().driver(api.kube) is None, "no way to authenticate: no criu driver"
    (tmp_path / "token").write_text("s3cret\n")
    static = AgentAccess(token_file=str(tmp_path / "token")).driver(api.kube)
    assert static is not None and static.token == "s3cret" and static.tokens is None
    await static.http.aclose()
    review = AgentAccess(service_account="sf/op", token_file=str(tmp_path / "token")).driver(
        api.kube
    )
    assert review is not None and review.token is None and review.tokens is not None
    assert review.tokens.path == "/api/v1/namespaces/sf/serviceaccounts/op/token"
    await review.http.aclose()
