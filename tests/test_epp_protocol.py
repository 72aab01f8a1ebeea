"""The EPP protocol over ext_proc messages, against the protocol document's points.

kubernetes-sigs/gateway-api-inference-extension, docs/proposals/004-endpoint-picker-protocol:
the destination header and metadata (same value, primary then fallbacks, comma-separated),
the subset hint, the 503 and 429 immediate responses, and the served endpoint read back;
and the three body modes with the messages in Envoy's order.
"""

from __future__ import annotations

from typing import Any

import pytest
from epp_fakes import (
    MODES,
    USAGE,
    chat_body,
    completion,
    destination_of,
    fleet,
    immediate_of,
    request_body,
    request_headers,
    response_body,
    response_headers,
    session,
    set_headers,
    sse_chunks,
    table,
    worker,
)

from sessionfleet.epp.picker import EndpointPicker, PickerConfig, endpoint_address
from sessionfleet.epp.protocol import Exchange, ExchangeSettings
from sessionfleet.fronts.admission import SessionRates
from sessionfleet.fronts.bindings import BindingTable
from sessionfleet.fronts.identity import session_object_name

SID = {"x-session-id": "task-42"}
NO_LIMITS = SessionRates(0, 0, 0, 0)


def exchange(
    bindings: BindingTable,
    *,
    fallbacks: int = 2,
    rates: SessionRates = NO_LIMITS,
    mode: int = MODES.FULL_DUPLEX_STREAMED,
) -> Exchange:
    picker = EndpointPicker(
        bindings, PickerConfig(fallbacks=fallbacks, session_rates=rates), now=0.0
    )
    return Exchange(picker, ExchangeSettings(mode, mode, max_body_bytes=4096), started=1.0)


def kinds(answers: list[Any]) -> list[str]:
    return [a.WhichOneof("response") for a in answers]


def echoed(answer: Any) -> tuple[bytes, bool]:
    kind = answer.WhichOneof("response")
    streamed = getattr(answer, kind).response.body_mutation.streamed_response
    return streamed.body, streamed.end_of_stream


# --- formats ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "address"),
    [
        ("http://10.0.0.1:8000", "10.0.0.1:8000"),
        ("http://10.0.0.1", "10.0.0.1:80"),
        ("https://w.example:8443/", "w.example:8443"),
        ("http://[fd00::1]:8000", "[fd00::1]:8000"),
        ("10.0.0.7:9000", "10.0.0.7:9000"),
    ],
)
def test_endpoints_are_ip_port(url: str, address: str) -> None:
    assert endpoint_address(url) == address


def test_full_duplex_bound_session_holds_the_headers_answer_until_the_body_ends() -> None:
    ex = exchange(fleet([session("task-42", "w-2")]))
    body = chat_body()
    first, second = body[:40], body[40:]
    assert ex.receive(request_headers(SID), 0.0) == []
    assert ex.receive(request_body(first, False), 0.0) == []
    answers = ex.receive(request_body(second, True), 0.0)
    assert kinds(answers) == ["request_headers", "request_body", "request_body"]
    # The header and the metadata name the same endpoint: the session's worker, alone.
    assert destination_of(answers[0]) == ("10.0.0.2:8000", "10.0.0.2:8000")
    headers = set_headers(answers[0].request_headers.response)
    assert headers["x-sessionfleet-session-id"] == "task-42"
    assert [echoed(a) for a in answers[1:]] == [(first, False), (second, True)]
    assert ex.route is not None and ex.route.session == session_object_name("task-42", None)

    assert kinds(ex.receive(response_headers(served="10.0.0.2:8000"), 0.0)) == ["response_headers"]
    done = completion()
    out = ex.receive(response_body(done[:10], False), 0.0) + ex.receive(
        response_body(done[10:], True), 0.0
    )
    assert [echoed(a) for a in out] == [(done[:10], False), (done[10:], True)]
    outcome = ex.ended()
    assert outcome.completed and outcome.status == 200 and outcome.served == "10.0.0.2:8000"
    assert outcome.usage is not None
    assert (outcome.usage.prompt_tokens, outcome.usage.cached_tokens) == (120, 100)


def test_buffered_decides_in_the_body_answer() -> None:
    ex = exchange(fleet([session("task-42", "w-3")]), mode=MODES.BUFFERED)
    assert kinds(ex.receive(request_headers(SID), 0.0)) == ["request_headers"]
    answers = ex.receive(request_body(chat_body(), True), 0.0)
    assert kinds(answers) == ["request_body"]
    assert destination_of(answers[0]) == ("10.0.0.3:8000", "10.0.0.3:8000")
    assert not answers[0].request_body.response.HasField("body_mutation")
    ex.receive(response_headers(), 0.0)
    out = ex.receive(response_body(completion(), True), 0.0)
    assert kinds(out) == ["response_body"]
    assert not out[0].response_body.response.HasField("body_mutation")
    usage = ex.ended().usage
    assert usage is not None and usage.completion_tokens == USAGE["completion_tokens"]


def test_streamed_decides_at_the_headers_and_lets_the_chunks_pass() -> None:
    ex = exchange(fleet([session("task-42", "w-1")]), mode=MODES.STREAMED)
    answers = ex.receive(request_headers(SID), 0.0)
    assert kinds(answers) == ["request_headers"]
    assert destination_of(answers[0]) == ("10.0.0.1:8000", "10.0.0.1:8000")
    body = chat_body(stream=True)
    for part, end in ((body[:50], False), (body[50:], True)):
        out = ex.receive(request_body(part, end), 0.0)
        assert kinds(out) == ["request_body"]
        assert not out[0].request_body.response.HasField("header_mutation")
    ex.receive(response_headers(event_stream=True), 0.0)
    chunks = sse_chunks()
    for i, chunk in enumerate(chunks):
        assert kinds(ex.receive(response_body(chunk, i == len(chunks) - 1), 0.0)) == [
            "response_body"
        ]
    outcome = ex.ended()
    assert outcome.completed and outcome.usage is not None
    assert outcome.usage.prompt_tokens == 120


def test_mode_announced_by_envoy_wins_over_the_configured_default() -> None:
    ex = exchange(fleet([session("task-42", "w-1")]), mode=MODES.FULL_DUPLEX_STREAMED)
    answers = ex.receive(request_headers(SID, mode=MODES.BUFFERED), 0.0)
    assert kinds(answers) == ["request_headers"]
    assert not answers[0].request_headers.response.HasField("header_mutation")
    assert kinds(ex.receive(request_body(chat_body(), True), 0.0)) == ["request_body"]


def test_headers_ending_the_request_are_decided_at_once_in_every_mode() -> None:
    ex = exchange(fleet([session("task-42", "w-2")]))
    answers = ex.receive(request_headers(SID, end=True), 0.0)
    assert kinds(answers) == ["request_headers"]
    assert destination_of(answers[0])[0] == "10.0.0.2:8000"


def test_full_duplex_request_with_trailers_is_decided_at_the_trailers() -> None:
    ex = exchange(fleet([session("task-42", "w-2")]))
    ex.receive(request_headers(SID), 0.0)
    assert ex.receive(request_body(chat_body(), False), 0.0) == []
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    answers = ex.receive(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()), 0.0)
    assert kinds(answers) == ["request_headers", "request_body", "request_trailers"]


# --- choosing ---------------------------------------------------------------------------


def test_new_session_gets_the_placement_and_fallbacks_in_order() -> None:
    bindings = fleet([session("other", "w-1"), session("another", "w-1")])
    ex = exchange(bindings, mode=MODES.BUFFERED)
    ex.receive(request_headers({"session-id": "codex-1"}), 0.0)  # Codex's header
    answers = ex.receive(request_body(chat_body(), True), 0.0)
    header, metadata = destination_of(answers[0])
    assert header == metadata
    endpoints = header.split(",")
    assert len(endpoints) == 3 and endpoints[-1] == "10.0.0.1:8000"  # the busiest last
    assert ex.route is not None and ex.route.new is not None
    assert ex.route.new.worker == ex.route.workers[0].name
    # A second turn before the AgentSession exists goes to the same worker, alone.
    again = exchange(bindings, mode=MODES.BUFFERED)
    again.picker = ex.picker
    again.receive(request_headers({"session-id": "codex-1"}), 0.0)
    answer = again.receive(request_body(chat_body(), True), 0.0)
    assert destination_of(answer[0])[0] == endpoints[0]


def test_subagent_lands_on_its_parents_worker() -> None:
    ex = exchange(fleet([session("root", "w-3")]), mode=MODES.BUFFERED)
    ex.receive(
        request_headers({"x-claude-code-session-id": "root", "x-claude-code-agent-id": "sub"}),
        0.0,
    )
    answers = ex.receive(request_body(chat_body(), True), 0.0)
    assert destination_of(answers[0])[0].split(",")[0] == "10.0.0.3:8000"


def test_stateless_request_gets_a_fallback_list() -> None:
    ex = exchange(fleet(), fallbacks=1, mode=MODES.BUFFERED)
    ex.receive(request_headers({}), 0.0)
    answers = ex.receive(request_body(chat_body(), True), 0.0)
    header, metadata = destination_of(answers[0])
    assert header == metadata and len(header.split(",")) == 2
    assert (
        "x-sessionfleet-session-id"
        in answers[0].request_body.response.header_mutation.remove_headers
    )


def test_side_request_for_another_model_is_stateless() -> None:
    bindings = table(
        [worker("w-1", "10.0.0.1"), worker("small", "10.0.0.9", model="small")],
        [session("task-42", "w-1")],
    )
    ex = exchange(bindings, fallbacks=0, mode=MODES.BUFFERED)
    ex.receive(request_headers(SID), 0.0)
    answers = ex.receive(request_body(chat_body("small"), True), 0.0)
    assert destination_of(answers[0])[0] == "10.0.0.9:8000"
    assert ex.route is not None and ex.route.session is None


def test_model_header_names_the_model_without_a_body() -> None:
    bindings = table([worker("w-1", "10.0.0.1"), worker("small", "10.0.0.9", model="small")])
    ex = exchange(bindings, mode=MODES.STREAMED)
    answers = ex.receive(request_headers({"x-gateway-model-name": "small"}), 0.0)
    assert destination_of(answers[0])[0] == "10.0.0.9:8000"


def test_a_request_naming_no_model_goes_to_a_ready_worker_of_any_model() -> None:
    """``GET /v1/models`` in a namespace of several models: routed, as upstream does."""
    bindings = table(
        [
            worker("w-1", "10.0.0.1", phase="Pending"),
            worker("small", "10.0.0.9", model="small"),
        ]
    )
    ex = exchange(bindings, mode=MODES.STREAMED)
    answers = ex.receive(request_headers({":method": "GET", ":path": "/v1/models"}, end=True), 0.0)
    assert destination_of(answers[0]) == ("10.0.0.9:8000", "10.0.0.9:8000")
    assert ex.route is not None and ex.route.session is None and ex.route.model is None


# --- the subset hint --------------------------------------------------------------------


def test_subset_hint_restricts_the_choice() -> None:
    ex = exchange(fleet(), mode=MODES.BUFFERED)
    ex.receive(request_headers({}, subset=["10.0.0.3:8000", "10.9.9.9:8000"]), 0.0)
    answers = ex.receive(request_body(chat_body(), True), 0.0)
    assert destination_of(answers[0]) == ("10.0.0.3:8000", "10.0.0.3:8000")


def test_subset_hint_applies_to_new_sessions_and_their_fallbacks() -> None:
    ex = exchange(fleet(), mode=MODES.BUFFERED)
    ex.receive(request_headers(SID, subset=["10.0.0.1:8000", "10.0.0.2:8000"]), 0.0)
    answers = ex.receive(request_body(chat_body(), True), 0.0)
    assert set(destination_of(answers[0])[0].split(",")) == {"10.0.0.1:8000", "10.0.0.2:8000"}


@pytest.mark.parametrize(
    ("subset", "sessions"),
    [
        ([], []),  # an empty list
        (["10.9.9.9:8000"], []),  # no eligible endpoint in it
        (["10.0.0.1:8000"], [session("task-42", "w-2")]),  # the session's worker is outside
    ],
)
def test_subset_with_nothing_eligible_is_503(
    subset: list[str], sessions: list[dict[str, Any]]
) -> None:
    ex = exchange(fleet(sessions), mode=MODES.BUFFERED)
    ex.receive(request_headers(SID if sessions else {}, subset=subset), 0.0)
    answers = ex.receive(request_body(chat_body(), True), 0.0)
    status, headers, body = immediate_of(answers[0])
    assert status == 503 and "retry-after" in headers
    assert body["error"]["code"] == "no_ready_worker"
    assert ex.closed and ex.receive(response_headers(), 0.0) == []


# --- immediate responses ----------------------------------------------------------------


def test_no_ready_worker_is_503_with_retry_after() -> None:
    ex = exchange(table([worker("w-1", "10.0.0.1", phase="Pending")]), mode=MODES.BUFFERED)
    ex.receive(request_headers(SID), 0.0)
    status, headers, body = immediate_of(ex.receive(request_body(chat_body(), True), 0.0)[0])
    assert status == 503 and headers["retry-after"] == "5"
    assert headers["x-sessionfleet-reason"] == "no_ready_worker"
    assert body["error"]["code"] == "no_ready_worker"


def test_full_fleet_sheds_new_sessions_with_429_no_capacity() -> None:
    """Saturation is flow control's case (429); 503 stays for "nothing can serve"."""
    bindings = table([worker("w-1", "10.0.0.1", max_sessions=1)], [session("other", "w-1")])
    ex = exchange(bindings, mode=MODES.BUFFERED)
    ex.receive(request_headers(SID), 0.0)
    status, headers, body = immediate_of(ex.receive(request_body(chat_body(), True), 0.0)[0])
    assert (status, body["error"]["code"]) == (429, "no_capacity")
    assert headers["retry-after"] == "5"
    down = table([worker("w-1", "10.0.0.1", phase="Pending")])
    ex = exchange(down, mode=MODES.BUFFERED)
    ex.receive(request_headers(SID), 0.0)
    status, _, body = immediate_of(ex.receive(request_body(chat_body(), True), 0.0)[0])
    assert (status, body["error"]["code"]) == (503, "no_ready_worker")


def test_new_sessions_beyond_the_rate_are_shed_with_429() -> None:
    bindings = fleet()
    picker = EndpointPicker(bindings, PickerConfig(session_rates=SessionRates(0, 0, 1, 1)), now=0.0)
    settings = ExchangeSettings(MODES.BUFFERED, MODES.BUFFERED)
    results = []
    for sid in ("a", "b"):
        ex = Exchange(picker, settings, started=0.0)
        ex.receive(request_headers({"x-session-id": sid}), 0.0)
        results.append(ex.receive(request_body(chat_body(), True), 0.0)[0])
    assert results[0].WhichOneof("response") == "request_body"
    status, headers, body = immediate_of(results[1])
    assert status == 429 and int(headers["retry-after"]) >= 1
    assert body["error"]["code"] == "too_many_new_sessions"
    assert ex.refused is not None and ex.refused.status == 429


def test_finished_session_is_409() -> None:
    ex = exchange(fleet([session("task-42", "w-1", phase="Finished")]), mode=MODES.BUFFERED)
    ex.receive(request_headers(SID), 0.0)
    status, _, body = immediate_of(ex.receive(request_body(chat_body(), True), 0.0)[0])
    assert (status, body["error"]["code"]) == (409, "session_finished")


def test_bad_session_id_and_bad_body_are_400() -> None:
    ex = exchange(fleet())
    status, _, body = immediate_of(
        ex.receive(request_headers({"x-session-id": "a b"}, end=True), 0.0)[0]
    )
    assert (status, body["error"]["code"]) == (400, "invalid_session_id")
    ex = exchange(fleet())
    ex.receive(request_headers(SID), 0.0)
    status, _, body = immediate_of(ex.receive(request_body(b'{"messages": []}', True), 0.0)[0])
    assert (status, body["error"]["code"]) == (400, "invalid_body")


def test_body_over_the_limit_is_413() -> None:
    ex = exchange(fleet())
    ex.receive(request_headers(SID), 0.0)
    assert ex.receive(request_body(b"x" * 3000, False), 0.0) == []
    status, _, _ = immediate_of(ex.receive(request_body(b"x" * 3000, False), 0.0)[0])
    assert status == 413


# --- held sessions ----------------------------------------------------------------------


def test_held_session_waits_then_routes_when_bound_again() -> None:
    bindings = fleet([session("task-42", "w-1", phase="Migrating")])
    ex = exchange(bindings, mode=MODES.BUFFERED)
    ex.receive(request_headers(SID), 0.0)
    assert ex.receive(request_body(chat_body(), True), 0.0) == []
    assert ex.waiting and ex.held is not None and "Migrating" in ex.held.reason
    assert ex.retry(0.0) == [] and ex.waiting
    bindings.apply_session(session("task-42", "w-3"))
    answers = ex.retry(0.0)
    assert not ex.waiting
    assert destination_of(answers[0])[0] == "10.0.0.3:8000"


def test_held_session_gives_up_with_503_session_held() -> None:
    ex = exchange(fleet([session("task-42", "w-1", phase="Restoring")]))
    ex.receive(request_headers(SID, end=True), 0.0)
    status, headers, body = immediate_of(ex.give_up(0.0)[0])
    assert (status, body["error"]["code"]) == (503, "session_held")
    assert headers["retry-after"] == "5" and ex.closed


def test_lost_session_continues_where_its_id_hashes() -> None:
    ex = exchange(fleet([session("task-42", "gone", phase="Lost")]))
    answers = ex.receive(request_headers(SID, end=True), 0.0)
    assert destination_of(answers[0])[0] in {"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}


# --- the served endpoint ----------------------------------------------------------------


def test_served_endpoint_from_metadata_or_header() -> None:
    for kwargs in ({"served": "10.0.0.2:8000"}, {"served_header": "10.0.0.2:8000"}):
        ex = exchange(fleet([session("task-42", "w-1")]))
        ex.receive(request_headers(SID, end=True), 0.0)
        ex.receive(response_headers(**kwargs), 0.0)
        assert ex.ended().served == "10.0.0.2:8000"


def test_response_ended_by_its_headers_completes_the_turn() -> None:
    ex = exchange(fleet([session("task-42", "w-1")]))
    ex.receive(request_headers(SID, end=True), 0.0)
    ex.receive(response_headers(204, end=True), 0.0)
    outcome = ex.ended()
    assert outcome.completed and outcome.status == 204 and outcome.usage is None


def test_large_streamed_response_keeps_only_its_tail_for_usage() -> None:
    ex = exchange(fleet([session("task-42", "w-1")]))
    ex.receive(request_headers(SID, end=True), 0.0)
    ex.receive(response_headers(event_stream=True), 0.0)
    filler = b"data: " + b'{"choices": [{"delta": {"content": "' + b"y" * 2000 + b'"}}]}\n\n'
    for _ in range(40):
        ex.receive(response_body(filler, False), 0.0)
    for chunk in sse_chunks():
        ex.receive(response_body(chunk, False), 0.0)
    ex.receive(response_body(b"", True), 0.0)
    usage = ex.ended().usage
    assert usage is not None and usage.prompt_tokens == 120
