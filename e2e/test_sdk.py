"""The official OpenAI and Anthropic Python SDKs through the router, on the real control plane.

Real clients, not hand-made requests: ``openai.OpenAI`` and ``anthropic.Anthropic``
pointed at a ``sessionfleet router`` process, in front of simulated engines that the
real operator runs as pods (backed processes) on this test's own fake GPU nodes. The
session id travels as the SDKs let a user send it: ``default_headers`` for a whole
client, ``extra_headers`` per call. What is checked is what an agent sees: its turns stay
on one worker and its cache grows, streams end with their usage, the AgentSession's
status adds up the tokens, and the router's refusals arrive as the SDKs' documented
exceptions, retried only where a retry can help.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from e2e.helpers import wait_until
from e2e.operator import (
    Custom,
    OperatorProcess,
    on_own_nodes,
    ready_workers,
    session,
    sim_worker,
    start_router,
)
from sessionfleet.resources.names import session_object_name

pytestmark = pytest.mark.timeout(240)

SYSTEM = "You are a coding agent working in a large repository. " * 40
NOT_A_KEY = "unused"  # the router runs without authentication here; the SDKs want a key


@pytest.fixture
def fleet(
    operator: OperatorProcess, crs: Custom, namespace: str, own_nodes: list[str]
) -> list[str]:
    """Two Ready sim workers of model ``m``, each on one of this test's own nodes."""
    for name, node in zip(("w1", "w2"), own_nodes, strict=True):
        crs.create(on_own_nodes(sim_worker(name), namespace, node))
    ready_workers(crs, 2, operator)
    return ["w1", "w2"]


@pytest.fixture
def router(cluster: Any, namespace: str, fleet: list[str], tmp_path: Path) -> Iterator[str]:
    """A router for the namespace; 503s advise a 1 s wait, held turns give up after 2 s."""
    url, process = start_router(
        cluster.kubeconfig,
        namespace,
        "r1",
        tmp_path,
        "--retry-after=1",
        "--hold-timeout=2",
        # Two new sessions per client at once, then one per 100 s: the third is a 429.
        "--new-sessions-burst-per-client=2",
        "--new-sessions-per-client=0.01",
    )
    yield url
    process.stop()
    print(f"--- router log\n{process.log_tail()}")


@pytest.fixture
def clients() -> Iterator[ExitStack]:
    """Closes the SDK clients a test opens: an unclosed connection is a ResourceWarning,
    which this suite turns into an error in whichever later test collects it."""
    with ExitStack() as stack:
        yield stack


def status_with_turns(crs: Custom, session_id: str, turns: int) -> dict[str, Any]:
    """Wait for the router to write ``turns`` turns to the session's status; return it."""
    name = session_object_name(session_id)

    def written() -> dict[str, Any] | None:
        status = crs.status("agentsessions", name)
        return status if status.get("turns") == turns else None

    return wait_until(written, timeout=30, what=f"{turns} turns in the status of {session_id}")


class Attempts:
    """An httpx client that counts the requests an SDK really sends, retries included."""

    def __init__(self, clients: ExitStack) -> None:
        self.sent = 0
        # The SDK's own client class (the SDKs use httpx2, not httpx), with a hook.
        self.client = clients.enter_context(
            openai.DefaultHttpxClient(event_hooks={"request": [self._count]})
        )

    def _count(self, _: object) -> None:
        self.sent += 1


# --- OpenAI: chat completions ----------------------------------------------------------


def test_openai_sdk_turns_stay_on_one_worker_and_the_status_adds_them_up(
    router: str, crs: Custom, clients: ExitStack
) -> None:
    # One client for one session (default_headers), one client shared by sessions
    # (extra_headers per call): both ways the OpenAI SDK documents for custom headers.
    dedicated = clients.enter_context(
        openai.OpenAI(
            base_url=f"{router}/v1",
            api_key=NOT_A_KEY,
            default_headers={"X-Session-Id": "sdk-default"},
            max_retries=0,
        )
    )
    shared = clients.enter_context(
        openai.OpenAI(base_url=f"{router}/v1", api_key=NOT_A_KEY, max_retries=0)
    )
    sessions = [
        ("sdk-default", dedicated, {}),
        ("sdk-extra", shared, {"X-Session-Id": "sdk-extra"}),
    ]
    for session_id, client, extra_headers in sessions:
        messages: list[Any] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Fix the flaky test."},
        ]
        workers: set[str] = set()
        cached: list[int] = []
        prompts: list[int] = []
        completions: list[int] = []
        for turn in range(4):
            raw = client.chat.completions.with_raw_response.create(
                model="m", messages=messages, max_tokens=16, extra_headers=extra_headers
            )
            workers.add(raw.headers["x-sessionfleet-worker"])
            completion = raw.parse()
            usage = completion.usage
            assert usage is not None and usage.prompt_tokens_details is not None
            hit = usage.prompt_tokens_details.cached_tokens
            assert hit is not None  # the engine reports it (--enable-prompt-tokens-details)
            cached.append(hit)
            prompts.append(usage.prompt_tokens)
            completions.append(usage.completion_tokens)
            messages += [
                {"role": "assistant", "content": completion.choices[0].message.content},
                {"role": "user", "content": f"tool output {turn}: " + "ok\n" * 40},
            ]
        assert len(workers) == 1, workers
        assert cached[0] == 0
        assert all(later > earlier for earlier, later in zip(cached, cached[1:], strict=False))

        # A streamed turn asking for usage ends with the usage chunk (no choices).
        stream = client.chat.completions.create(
            model="m",
            messages=messages,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers=extra_headers,
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert len(text) == 16 * 4  # 16 one-token filler words of 4 characters
        last = chunks[-1]
        assert last.choices == [] and last.usage is not None
        assert last.usage.prompt_tokens_details is not None
        streamed_hit = last.usage.prompt_tokens_details.cached_tokens
        assert streamed_hit is not None and streamed_hit > cached[-1]
        cached.append(streamed_hit)
        prompts.append(last.usage.prompt_tokens)
        completions.append(last.usage.completion_tokens)

        status = status_with_turns(crs, session_id, 5)
        assert status["worker"] in workers
        assert status["promptTokens"] == sum(prompts)
        assert status["cachedTokens"] == sum(cached)
        assert status["completionTokens"] == sum(completions) == 5 * 16


def test_openai_sdk_raises_the_documented_errors(
    router: str, crs: Custom, namespace: str, clients: ExitStack
) -> None:
    client = clients.enter_context(
        openai.OpenAI(base_url=f"{router}/v1", api_key=NOT_A_KEY, max_retries=0)
    )
    hello: list[Any] = [{"role": "user", "content": "hello"}]

    # A body the router cannot route: 400 with its own message and code.
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="", messages=hello, max_tokens=4)
    assert bad.value.status_code == 400 and bad.value.code == "invalid_body"
    assert "model must be a non-empty string" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad_id:
        client.chat.completions.create(
            model="m", messages=hello, max_tokens=4, extra_headers={"X-Session-Id": "a b"}
        )
    assert bad_id.value.code == "invalid_session_id"

    # No worker for the model, and a path the router does not serve: 404s.
    with pytest.raises(openai.NotFoundError) as unknown_model:
        client.chat.completions.create(model="nope", messages=hello, max_tokens=4)
    assert unknown_model.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as unknown_path:
        client.with_options(base_url=router).post(
            "/elsewhere", body={}, cast_to=openai.types.chat.ChatCompletion
        )
    assert unknown_path.value.code == "not_found"

    # Workers of the model exist but none is Ready (its pod cannot be scheduled): 503.
    crs.create(on_own_nodes(sim_worker("cold", model="cold"), namespace, "no-such-node"))
    wait_until(
        lambda: crs.get("inferenceworkers", "cold").get("status"),
        timeout=30,
        what="the operator to see worker cold",
    )

    def unavailable() -> openai.InternalServerError | None:
        try:
            client.chat.completions.create(model="cold", messages=hello, max_tokens=4)
        except openai.InternalServerError as error:
            return error
        except openai.NotFoundError:
            return None  # the router's watch has not shown the worker yet
        raise AssertionError("a model without a Ready worker was answered")

    refused = wait_until(unavailable, timeout=30, what="503 no_ready_worker")
    assert refused.status_code == 503 and refused.code == "no_ready_worker"
    assert refused.response.headers["Retry-After"] == "1"
    # The router refused before forwarding anything, so a retry is safe: the SDK waits
    # the advised second and sends the turn again, once per allowed retry.
    attempts = Attempts(clients)
    retrying = clients.enter_context(
        openai.OpenAI(
            base_url=f"{router}/v1", api_key=NOT_A_KEY, max_retries=1, http_client=attempts.client
        )
    )
    with pytest.raises(openai.InternalServerError):
        retrying.chat.completions.create(model="cold", messages=hello, max_tokens=4)
    assert attempts.sent == 2

    # A session pinned to that worker has its turn held, then refused: 503 session_held.
    crs.create(
        session("held", model="cold", workerPin="cold")
        | {"metadata": {"name": session_object_name("id-held")}}
    )

    def held_turn() -> openai.InternalServerError | None:
        with pytest.raises(openai.InternalServerError) as refused:
            client.chat.completions.create(
                model="cold",
                messages=hello,
                max_tokens=4,
                extra_headers={"X-Session-Id": "id-held"},
            )
        # Until the router's watch shows the new AgentSession, the turn is a new
        # session's, for which no worker is Ready (503 no_ready_worker; nothing created).
        return refused.value if refused.value.code == "session_held" else None

    held = wait_until(held_turn, timeout=30, what="503 session_held")
    assert held.status_code == 503

    # A finished session: 409, and no retry, though the SDK retries 409s by default.
    finals = {"X-Session-Id": "sdk-done", "X-Session-Final": "true"}
    client.chat.completions.create(model="m", messages=hello, max_tokens=4, extra_headers=finals)
    wait_until(
        lambda: (
            crs.status("agentsessions", session_object_name("sdk-done")).get("phase") == "Finished"
        ),
        timeout=30,
        what="the operator to mark sdk-done Finished",
    )

    def conflict() -> openai.ConflictError | None:
        try:
            client.chat.completions.create(
                model="m", messages=hello, max_tokens=4, extra_headers={"X-Session-Id": "sdk-done"}
            )
        except openai.ConflictError as error:
            return error
        return None  # the router's table has not shown Finished yet

    assert wait_until(conflict, timeout=20, what="409").code == "session_finished"
    attempts = Attempts(clients)
    default_retries = clients.enter_context(
        openai.OpenAI(base_url=f"{router}/v1", api_key=NOT_A_KEY, http_client=attempts.client)
    )
    assert default_retries.max_retries == 2
    with pytest.raises(openai.ConflictError) as finished:
        default_retries.chat.completions.create(
            model="m", messages=hello, max_tokens=4, extra_headers={"X-Session-Id": "sdk-done"}
        )
    assert finished.value.response.headers["x-should-retry"] == "false"
    assert attempts.sent == 1

    # New sessions beyond the client's burst (two: sdk-done and one more): 429.
    client.chat.completions.create(
        model="m", messages=hello, max_tokens=4, extra_headers={"X-Session-Id": "sdk-second"}
    )
    with pytest.raises(openai.RateLimitError) as limited:
        client.chat.completions.create(
            model="m", messages=hello, max_tokens=4, extra_headers={"X-Session-Id": "sdk-third"}
        )
    assert limited.value.code == "too_many_new_sessions"
    assert int(limited.value.response.headers["Retry-After"]) > 0


# --- Anthropic: the Messages API -------------------------------------------------------


def test_anthropic_sdk_turns_stay_on_one_worker_and_the_status_adds_them_up(
    router: str, crs: Custom, clients: ExitStack
) -> None:
    # Claude Code's own session header, sent by the client on every call.
    client = clients.enter_context(
        anthropic.Anthropic(
            base_url=router,
            api_key=NOT_A_KEY,
            default_headers={"x-claude-code-session-id": "claude-sdk"},
            max_retries=0,
        )
    )
    messages: list[Any] = [{"role": "user", "content": "Fix the flaky test."}]
    workers: set[str] = set()
    reads: list[int] = []
    prompts: list[int] = []
    outputs: list[int] = []
    for turn in range(4):
        if turn % 2 == 0:
            raw = client.messages.with_raw_response.create(
                model="m", system=SYSTEM, messages=messages, max_tokens=16
            )
            workers.add(raw.headers["x-sessionfleet-worker"])
            reply = raw.parse()
        else:
            with client.messages.stream(
                model="m", system=SYSTEM, messages=messages, max_tokens=16
            ) as stream:
                workers.add(stream.response.headers["x-sessionfleet-worker"])
                text = "".join(stream.text_stream)
                reply = stream.get_final_message()
            assert reply.content[0].type == "text" and reply.content[0].text == text
        usage = reply.usage
        assert usage.cache_read_input_tokens is not None
        reads.append(usage.cache_read_input_tokens)
        prompts.append(usage.input_tokens + usage.cache_read_input_tokens)
        outputs.append(usage.output_tokens)
        assert reply.stop_reason == "max_tokens"
        messages += [
            {"role": "assistant", "content": reply.content},
            {"role": "user", "content": f"tool output {turn}: " + "ok\n" * 40},
        ]
    assert len(workers) == 1, workers
    assert reads[0] == 0
    assert all(later > earlier for earlier, later in zip(reads, reads[1:], strict=False))

    status = status_with_turns(crs, "claude-sdk", 4)
    spec = crs.get("agentsessions", session_object_name("claude-sdk"))["spec"]
    assert spec["client"] == "ClaudeCode"
    # The streamed turns count their prompt too: message_start's half of their usage.
    assert status["promptTokens"] == sum(prompts)
    assert status["cachedTokens"] == sum(reads)
    assert status["completionTokens"] == sum(outputs) == 4 * 16


def test_anthropic_sdk_raises_the_documented_errors(router: str, clients: ExitStack) -> None:
    client = clients.enter_context(
        anthropic.Anthropic(base_url=router, api_key=NOT_A_KEY, max_retries=0)
    )
    hello: list[Any] = [{"role": "user", "content": "hello"}]

    # The router's own refusals, in Anthropic's shape: the SDK reads type and message.
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="", messages=hello, max_tokens=4)
    assert bad.value.type == "invalid_request_error"
    assert bad.value.api_message is not None
    assert "model must be a non-empty string" in bad.value.api_message
    assert bad.value.response.headers["x-sessionfleet-reason"] == "invalid_body"
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(model="nope", messages=hello, max_tokens=4)
    assert unknown.value.type == "not_found_error"
    assert unknown.value.response.headers["x-sessionfleet-reason"] == "model_not_found"

    # The engine's own refusal passes through, in the same shape.
    with pytest.raises(anthropic.BadRequestError) as engine:
        client.messages.create(model="m", messages=hello, max_tokens=0)
    assert engine.value.type == "invalid_request_error"
    assert "x-sessionfleet-reason" not in engine.value.response.headers
    assert engine.value.api_message is not None
    assert "max_tokens is required" in engine.value.api_message

    # The same refusal in a stream is raised when the stream is opened.
    with (
        pytest.raises(anthropic.NotFoundError),
        client.messages.stream(model="nope", messages=hello, max_tokens=4) as stream,
    ):
        stream.get_final_message()
