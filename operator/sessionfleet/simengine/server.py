"""The simulated engine's HTTP server: vLLM's OpenAI-compatible API on aiohttp.

SIMULATOR. It generates filler text, not model output. What matches vLLM (V1 engine,
started with ``--enable-prompt-tokens-details``):

* ``POST /v1/chat/completions`` and ``POST /v1/completions``, streaming (SSE) and not;
  ``usage.prompt_tokens_details.cached_tokens``; in streams a final usage chunk with
  ``stream_options.include_usage`` or when started with ``--enable-force-include-usage``;
* ``GET /v1/models``, ``GET /health``, ``GET /version``, ``GET /metrics`` with vLLM's
  metric names (:mod:`sessionfleet.engines.vllm`);
* ``POST /pause?mode=abort|wait|keep[&clear_cache=...]``, ``POST /resume``,
  ``GET /is_paused`` and ``POST /reset_prefix_cache`` with vLLM's semantics: ``keep``
  freezes in-flight requests until ``/resume`` and never clears the cache; ``abort``
  (the default) ends them with ``finish_reason: abort``; ``wait`` lets them finish;
  new requests wait while paused; ``clear_cache`` (default true, as in vLLM) drops the
  cached blocks after ``abort`` or ``wait``;
* ``POST /v1/messages``, Anthropic's Messages API as vLLM serves it: a ``message``
  object, or a stream of ``message_start``, ``content_block_start``,
  ``content_block_delta``, ``content_block_stop``, ``message_delta`` and
  ``message_stop`` events; usage with vLLM's semantics (``input_tokens`` uncached,
  ``cache_read_input_tokens`` the prefix-cache hits, ``cache_creation_input_tokens``
  0), split in streams as Anthropic documents it: input and cache counts in
  ``message_start``, the output count in ``message_delta``;
* error bodies ``{"error": {"message", "type", "param", "code"}}``, and on
  ``/v1/messages`` Anthropic's ``{"type": "error", "error": {"type", "message"}}``.

What only the simulator has, under ``/sim/``:

* ``GET /sim/cache``: blocks, tokens and sessions held;
* ``POST /sim/cache/export`` ``{"directory": DIR, "session": ID?}``: write the cache (or
  one session's blocks) to ``DIR``; ``POST /sim/cache/import`` ``{"directory": DIR}``:
  load one. A session is known by the router's ``X-Sessionfleet-Session-Id`` header or
  the engine's ``--session-header``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from sessionfleet._version import __version__
from sessionfleet.engines import FORWARDED_SESSION_HEADER, anthropic
from sessionfleet.simengine.cache import SnapshotError, read_snapshot, write_snapshot
from sessionfleet.simengine.engine import (
    EngineCollector,
    EngineConfig,
    Generation,
    RequestError,
    SimEngine,
)
from sessionfleet.simengine.tokenizer import anthropic_chat, render_chat

logger = logging.getLogger("sessionfleet.sim-engine")

MAX_BODY_BYTES: Final = 64 * 1024 * 1024
"""Request bodies up to 64 MiB: a 180K-token context is about 700 KB, far below."""


def error_response(message: str, status: int, kind: str) -> web.Response:
    """Return an error in vLLM's shape: ``{"error": {"message", "type", "param", "code"}}``."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status)


# --- request parsing ------------------------------------------------------------------------


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json(loads=json.loads)
    except (ValueError, UnicodeDecodeError) as error:
        raise RequestError(f"the request body is not valid JSON: {error}") from error
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def _positive_int(body: Mapping[str, Any], *names: str) -> int | None:
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise RequestError(f"{name} must be a positive integer", 400)
        return value
    return None


@dataclass(frozen=True, slots=True)
class _Common:
    stream: bool
    include_usage: bool
    max_tokens: int | None


def _check_model(body: Mapping[str, Any], model: str) -> None:
    requested = body.get("model")
    if not isinstance(requested, str) or not requested:
        raise RequestError("model is required: a string naming the served model")
    if requested != model:
        raise RequestError(f"The model `{requested}` does not exist.", 404, "NotFoundError")


def _stream_flag(body: Mapping[str, Any]) -> bool:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream must be a boolean")
    return stream


def _common(body: Mapping[str, Any], model: str, force_include_usage: bool) -> _Common:
    _check_model(body, model)
    n = body.get("n", 1)
    if n != 1:
        raise RequestError("the simulated engine generates one choice: n must be 1")
    stream = _stream_flag(body)
    options = body.get("stream_options")
    include_usage = force_include_usage
    if options is not None:
        if not isinstance(options, dict):
            raise RequestError("stream_options must be an object")
        if not stream:
            raise RequestError("stream_options can only be set when stream is true")
        include_usage = include_usage or bool(options.get("include_usage"))
    max_tokens = _positive_int(body, "max_completion_tokens", "max_tokens")
    return _Common(stream, include_usage, max_tokens)


# --- the application ---------------------------------------------------------------------

ENGINE_KEY: Final = web.AppKey("engine", SimEngine)


def _directory_bytes(directory: Path) -> int:
    """Return the bytes of the files a snapshot wrote (its size on storage)."""
    return sum(f.stat().st_size for f in directory.iterdir() if f.is_file())


def _session_of(request: web.Request, config: EngineConfig) -> str | None:
    return request.headers.get(FORWARDED_SESSION_HEADER) or request.headers.get(
        config.session_header
    )


class _Handlers:
    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine
        self.config = engine.config

    async def health(self, _: web.Request) -> web.Response:
        return web.Response()

    async def version(self, _: web.Request) -> web.Response:
        return web.json_response({"version": f"sessionfleet-sim {__version__}"})

    async def models(self, _: web.Request) -> web.Response:
        model = self.config.model
        card = {
            "id": model,
            "object": "model",
            "created": int(self.engine.started_at),
            "owned_by": "sessionfleet-sim",
            "root": model,
            "parent": None,
            "max_model_len": self.config.max_model_len,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def metrics(self, request: web.Request) -> web.Response:
        registry: CollectorRegistry = request.app[_REGISTRY_KEY]
        return web.Response(
            body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if request.query.get("wait_for_inflight_requests", "").lower() == "true":
            mode = "wait"  # vLLM's deprecated spelling of mode=wait
        clear_cache = request.query.get("clear_cache", "true").lower() != "false"
        await self.engine.pause(mode, clear_cache)
        return web.json_response({"status": "paused"})

    async def resume(self, _: web.Request) -> web.Response:
        self.engine.resume()
        return web.json_response({"status": "resumed"})

    async def is_paused(self, _: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.engine.paused})

    async def reset_prefix_cache(self, _: web.Request) -> web.Response:
        self.engine.cache.clear()
        return web.Response()

    async def cache_summary(self, _: web.Request) -> web.Response:
        return web.json_response(self.engine.summary())

    async def cache_export(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        directory = body.get("directory")
        session = body.get("session")
        if not isinstance(directory, str) or not directory:
            raise RequestError("directory is required: the folder to write the snapshot to")
        if session is not None and not isinstance(session, str):
            raise RequestError("session must be a string")
        snapshot = self.engine.snapshot(session)
        started = time.monotonic()
        try:
            manifest = await asyncio.to_thread(write_snapshot, snapshot, Path(directory))
        except OSError as error:
            raise RequestError(
                f"cannot write to {directory}: {error}", 500, "InternalServerError"
            ) from error
        size = await asyncio.to_thread(_directory_bytes, Path(directory))
        return web.json_response(
            {
                "directory": directory,
                "blocks": manifest["blocks"],
                "tokens": manifest["tokens"],
                "sessions": sorted(manifest["sessions"]),
                # Per session, the prefix tokens saved: what a checkpoint records.
                "sessionTokens": {
                    sid: entry["tokens"] for sid, entry in manifest["sessions"].items()
                },
                "bytes": size,
                "seconds": round(time.monotonic() - started, 6),
            }
        )

    async def cache_import(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        directory = body.get("directory")
        if not isinstance(directory, str) or not directory:
            raise RequestError("directory is required: the folder holding a snapshot")
        started = time.monotonic()
        try:
            snapshot = await asyncio.to_thread(read_snapshot, Path(directory))
            added = self.engine.restore(snapshot)
        except SnapshotError as error:
            raise RequestError(str(error), 422, "UnprocessableEntity") from error
        return web.json_response(
            {
                "directory": directory,
                "blocks": len(snapshot.blocks),
                "added": added,
                "sessions": sorted(snapshot.sessions),
                "sessionTokens": {sid: r.tokens for sid, r in snapshot.sessions.items()},
                "seconds": round(time.monotonic() - started, 6),
            }
        )

    # --- generation ---------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        common = _common(body, self.config.model, self.config.force_include_usage)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list")
        if not all(isinstance(m, dict) for m in messages):
            raise RequestError("every message must be an object")
        try:
            prompt = render_chat(messages)
        except ValueError as error:
            raise RequestError(str(error)) from error
        return await self._generate(request, prompt, common, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        common = _common(body, self.config.model, self.config.force_include_usage)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise RequestError(
                "prompt must be a non-empty string (the simulator takes no token ids "
                "and one prompt per request)"
            )
        return await self._generate(request, prompt, common, chat=False)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic's Messages API: the request is rendered as vLLM renders it."""
        body = await _json_body(request)
        _check_model(body, self.config.model)
        max_tokens = body.get("max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise RequestError("max_tokens is required: a positive integer")
        stream = _stream_flag(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list")
        try:
            prompt = render_chat(anthropic_chat(body.get("system"), messages))
        except ValueError as error:
            raise RequestError(str(error)) from error
        generation = Generation(
            prompt=prompt,
            max_tokens=max_tokens,
            explicit_max_tokens=True,
            session_id=_session_of(request, self.config),
        )
        ident = f"msg_{uuid.uuid4().hex}"
        details = self.config.enable_prompt_tokens_details
        if stream:
            return await _stream_message(request, self.engine, generation, ident, details)
        await self.engine.run(generation, None)
        text = "".join(generation.words)
        return web.json_response(
            {
                "id": ident,
                "type": "message",
                "role": "assistant",
                "content": [{"type": "text", "text": text}] if text else [],
                "model": self.config.model,
                "stop_reason": anthropic.STOP_REASONS.get(generation.finish_reason),
                "stop_sequence": None,
                "usage": _message_usage(generation, details),
            }
        )

    async def _generate(
        self, request: web.Request, prompt: str, common: _Common, *, chat: bool
    ) -> web.StreamResponse:
        generation = Generation(
            prompt=prompt,
            max_tokens=common.max_tokens or self.config.default_max_tokens,
            explicit_max_tokens=common.max_tokens is not None,
            session_id=_session_of(request, self.config),
        )
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        model = self.config.model
        details = self.config.enable_prompt_tokens_details
        if not common.stream:
            await self.engine.run(generation, None)
            text = "".join(generation.words)
            choice: dict[str, Any]
            if chat:
                choice = {
                    "index": 0,
                    "message": {"role": "assistant", "content": text, "tool_calls": []},
                    "logprobs": None,
                    "finish_reason": generation.finish_reason,
                    "stop_reason": None,
                }
            else:
                choice = {
                    "index": 0,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": generation.finish_reason,
                    "stop_reason": None,
                }
            return web.json_response(
                {
                    "id": ident,
                    "object": "chat.completion" if chat else "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [choice],
                    "usage": generation.usage(details),
                }
            )
        return await _stream(
            request, self.engine, generation, ident, created, chat, common, details
        )


async def _stream(
    request: web.Request,
    engine: SimEngine,
    generation: Generation,
    ident: str,
    created: int,
    chat: bool,
    common: _Common,
    details: bool,
) -> web.StreamResponse:
    """Serve a request as server-sent events, one chunk per generated token."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    obj = "chat.completion.chunk" if chat else "text_completion"
    # The constant part of every chunk, serialised once.
    head = (
        f'data: {{"id":"{ident}","object":"{obj}","created":{created},'
        f'"model":{json.dumps(engine.config.model)},"choices":['
    )
    pending: list[str] = []
    if chat:
        pending.append(
            head + '{"index":0,"delta":{"role":"assistant","content":""},'
            '"logprobs":null,"finish_reason":null}]}\n\n'
        )

    async def emit(index: int, delta: str, slow: bool) -> None:
        if chat:
            part = f'{{"index":0,"delta":{{"content":{json.dumps(delta)}}},"logprobs":null,'
        else:
            part = f'{{"index":0,"text":{json.dumps(delta)},"logprobs":null,'
        pending.append(head + part + '"finish_reason":null}]}\n\n')
        # Without decode time every token is ready at once: one write, not hundreds.
        if slow:
            await response.write("".join(pending).encode())
            pending.clear()

    await engine.run(generation, emit)
    if chat:
        last = '{"index":0,"delta":{},"logprobs":null,'
    else:
        last = '{"index":0,"text":"","logprobs":null,'
    pending.append(
        head + last + f'"finish_reason":"{generation.finish_reason}","stop_reason":null}}]}}\n\n'
    )
    if common.include_usage:
        usage = json.dumps(generation.usage(details), separators=(",", ":"))
        pending.append(head + f'],"usage":{usage}}}\n\n')
    pending.append("data: [DONE]\n\n")
    await response.write("".join(pending).encode())
    await response.write_eof()
    return response


def _message_usage(generation: Generation, details: bool) -> dict[str, Any]:
    return anthropic.usage(
        generation.prompt_tokens,
        generation.cached_tokens,
        generation.completion_tokens,
        details=details,
    )


def _event(name: str, data: Mapping[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


async def _stream_message(
    request: web.Request,
    engine: SimEngine,
    generation: Generation,
    ident: str,
    details: bool,
) -> web.StreamResponse:
    """Serve a Messages request as Anthropic's server-sent events, one delta per token.

    The prompt's usage is known once the cache has been looked up, before the first
    token, so ``message_start`` carries the input and cache counts (as Anthropic's API
    does) and ``message_delta`` the cumulative output count only: a reader must combine
    the two (:func:`sessionfleet.engines.anthropic.merge_stream_usage`).
    """
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    pending: list[str] = []
    started = False

    async def start() -> None:
        nonlocal started
        started = True
        await response.prepare(request)
        message: dict[str, Any] = {
            "id": ident,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": engine.config.model,
            "stop_reason": None,
            "stop_sequence": None,
            # Called at the first token; no output is counted before its delta (vLLM: 0).
            "usage": {**_message_usage(generation, details), "output_tokens": 0},
        }
        pending.append(_event("message_start", {"type": "message_start", "message": message}))
        block = {"type": "text", "text": ""}
        pending.append(
            _event(
                "content_block_start",
                {"type": "content_block_start", "index": 0, "content_block": block},
            )
        )

    async def emit(index: int, delta: str, slow: bool) -> None:
        if not started:
            await start()
        # The constant head of every delta is short; json.dumps escapes the text only.
        pending.append(
            'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
            f'"delta":{{"type":"text_delta","text":{json.dumps(delta)}}}}}\n\n'
        )
        if slow:
            await response.write("".join(pending).encode())
            pending.clear()

    await engine.run(generation, emit)
    if not started:  # nothing generated (aborted at once): the stream still has its frame
        await start()
    pending.append(_event("content_block_stop", {"type": "content_block_stop", "index": 0}))
    stop = anthropic.STOP_REASONS.get(generation.finish_reason)
    pending.append(
        _event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop, "stop_sequence": None},
                "usage": {"output_tokens": generation.completion_tokens},
            },
        )
    )
    pending.append(_event("message_stop", {"type": "message_stop"}))
    await response.write("".join(pending).encode())
    await response.write_eof()
    return response


_REGISTRY_KEY: Final = web.AppKey("registry", CollectorRegistry)


@web.middleware
async def _errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except RequestError as error:
        if anthropic.is_messages_path(request.path):
            body = anthropic.error_body(error.status, error.message)
            return web.json_response(body, status=error.status)
        return error_response(error.message, error.status, error.kind)


def build_app(config: EngineConfig, engine: SimEngine | None = None) -> web.Application:
    """Return the aiohttp application of one simulated engine."""
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_errors])
    # The engine's asyncio primitives bind to the running loop on first use, so the
    # engine may be built before the loop starts.
    engine = engine or SimEngine(config)
    registry = CollectorRegistry(auto_describe=True)
    registry.register(EngineCollector(engine))
    app[ENGINE_KEY] = engine
    app[_REGISTRY_KEY] = registry
    handlers = _Handlers(engine)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/version", handlers.version)
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_get("/metrics", handlers.metrics)
    app.router.add_post("/v1/chat/completions", handlers.chat)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_post(anthropic.MESSAGES_PATH, handlers.messages)
    app.router.add_post("/pause", handlers.pause)
    app.router.add_post("/resume", handlers.resume)
    app.router.add_get("/is_paused", handlers.is_paused)
    app.router.add_post("/reset_prefix_cache", handlers.reset_prefix_cache)
    app.router.add_get("/sim/cache", handlers.cache_summary)
    app.router.add_post("/sim/cache/export", handlers.cache_export)
    app.router.add_post("/sim/cache/import", handlers.cache_import)
    return app


async def serve(config: EngineConfig, host: str, port: int, import_dir: Path | None) -> None:
    """Serve until SIGTERM or SIGINT."""
    engine = SimEngine(config)
    if import_dir is not None:
        snapshot = await asyncio.to_thread(read_snapshot, import_dir)
        added = engine.restore(snapshot)
        logger.info(
            "imported %d blocks (%d new) and %d sessions from %s",
            len(snapshot.blocks),
            added,
            len(snapshot.sessions),
            import_dir,
        )
    runner = web.AppRunner(build_app(config, engine), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    logger.info(
        "SIMULATED engine serving %r on http://%s:%d (kv %d tokens, block %d)",
        config.model,
        host,
        port,
        config.kv_tokens,
        config.block_size,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
