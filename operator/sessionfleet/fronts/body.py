"""Reading what the router needs from bodies without decoding them whole.

A turn's request body is the whole conversation: 700 KB for a 180K-token context. The
router needs one field of it, ``model``, and forwards the bytes unchanged. Decoding the
body into Python objects and encoding it again would cost milliseconds per turn and
could change it (key order, number formats, escapes); scanning for the key costs a
``bytes.find`` (memchr speed) over the body.

The scan is exact, not a guess. In JSON a string's inner quotes are always escaped, so
the bytes ``"model"`` preceded by ``{`` or ``,`` and followed by ``:`` (whitespace
allowed) can only be an object key. It is the top-level key when it is the object's
first key; or when the brackets after its value close the outermost object (checked
over that short tail only, for clients that send ``model`` after ``messages``); or
when it is the only such key in the body (a chat or completion request must have a
top-level ``model``). Otherwise, with several such keys (a tool schema with a
``model`` property), the whole body is walked (:func:`decode_model`): strings and
brackets only, with no Python objects built, so that no body can make the router's
memory grow with its nesting. That is rare; a large body is walked in a thread.

Responses are read the same way: ``usage`` is the last key of a response and the last
chunk of a stream, so it is found by searching the tail backwards and decoding only
its value. Anthropic's Messages streams are the exception: their usage is split between
the first event (``message_start``: input and cache counts) and the last ones
(``message_delta``: output count), so the first bytes of a stream are kept too and
the two halves merged (:func:`usage_in_stream`).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator, Mapping
from typing import Any, Final

from sessionfleet.engines.anthropic import merge_stream_usage
from sessionfleet.engines.vllm import Usage, parse_usage, usage_of_response

MAX_MODEL_CHARS: Final = 256
_MODEL_KEY: Final = b'"model"'
_WHITESPACE: Final = b" \t\r\n"
# A JSON string at the start of the text, escapes included.
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_WINDOW: Final = 4 * MAX_MODEL_CHARS + 64
# Strings (skipped whole, escapes included) and brackets, for walking a short tail.
_TAIL_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[{}\[\]]', re.DOTALL)
_MAX_TAIL: Final = 65536
"""The last-key shortcut walks at most this many bytes after the key."""


class BodyError(ValueError):
    """A request body the router cannot route; the message is for the client."""


def _is_key(body: bytes, start: int) -> int | None:
    """If the ``"model"`` at ``start`` is an object key, return where its value starts."""
    before = start - 1
    while before >= 0 and body[before] in _WHITESPACE:
        before -= 1
    if before < 0 or body[before] not in b"{,":
        return None
    after = start + len(_MODEL_KEY)
    while after < len(body) and body[after] in _WHITESPACE:
        after += 1
    if after >= len(body) or body[after] != ord(":"):
        return None
    after += 1
    while after < len(body) and body[after] in _WHITESPACE:
        after += 1
    return after


def _check(model: Any) -> str:
    if not isinstance(model, str) or not model:
        raise BodyError("model must be a non-empty string naming the served model")
    if len(model) > MAX_MODEL_CHARS:
        raise BodyError(f"model must be at most {MAX_MODEL_CHARS} characters")
    return model


def _string_at(body: bytes, start: int) -> tuple[str, int] | None:
    r"""Decode the JSON string value at ``start``; return it and where it ends.

    Raises :class:`BodyError` for a string JSON cannot decode (an invalid escape such
    as ``\q``, a lone surrogate escape is fine, invalid UTF-8 is not).
    """
    match = _JSON_STRING.match(body, start, start + _WINDOW)
    if match is None:
        return None
    try:
        value = json.loads(match.group())
    except ValueError as error:  # UnicodeDecodeError is a ValueError too
        raise BodyError(f"model is not a valid JSON string: {error}") from error
    return (value, match.end()) if isinstance(value, str) else None


def _closes_top_level(body: bytes, start: int) -> bool:
    """Whether the text from ``start`` closes the outermost object and ends the body.

    That is: its brackets (outside strings) first go one level below where ``start``
    is exactly at a ``}`` after which only whitespace remains. Then ``start`` was at
    the top level of the body's object.
    """
    depth = 0
    for token in _TAIL_TOKENS.finditer(body, start):
        symbol = token.group()
        if symbol in (b"{", b"["):
            depth += 1
        elif symbol in (b"}", b"]"):
            depth -= 1
            if depth < 0:
                return symbol == b"}" and not body[token.end() :].strip()
    return False


FULL_WALK_INLINE_BYTES: Final = 65536
"""Bodies up to this size are walked on the event loop when the scan cannot decide;
larger ones in a worker thread, so a large body never stalls other turns."""


def scan_model(body: bytes) -> str | None:
    """Return the top-level ``model`` of a JSON request body found by scanning.

    Three ways, cheapest first, each exact: ``model`` is the object's first key (then
    it is top-level by position); or the last ``model`` key is followed by nothing but
    the rest of the top-level object (checked over that short tail only: clients that
    write ``model`` after ``messages``); or the body has exactly one ``model`` key (one
    forward pass). Returns None when only a walk of the whole body can tell (several such keys, or
    none found); raises :class:`BodyError` for a body that cannot be routed.
    """
    first = 0
    while first < len(body) and body[first] in _WHITESPACE:
        first += 1
    if first >= len(body) or body[first] != ord("{"):
        raise BodyError("the request body must be a JSON object")
    found = body.find(_MODEL_KEY, first, first + _WINDOW)
    if found != -1 and not body[first + 1 : found].strip():
        value_at = _is_key(body, found)
        string = _string_at(body, value_at) if value_at is not None else None
        if string is not None:
            return _check(string[0])
    last = body.rfind(_MODEL_KEY, first)
    if last != -1 and len(body) - last <= _MAX_TAIL:
        value_at = _is_key(body, last)
        string = _string_at(body, value_at) if value_at is not None else None
        if string is not None and _closes_top_level(body, string[1]):
            return _check(string[0])
    keys = 0
    value_at = None
    found = body.find(_MODEL_KEY, first)
    while found != -1:
        where = _is_key(body, found)
        if where is not None:
            keys += 1
            value_at = where
            if keys > 1:
                break
        found = body.find(_MODEL_KEY, found + len(_MODEL_KEY))
    if keys == 1 and value_at is not None:
        string = _string_at(body, value_at)
        if string is None:
            raise BodyError("model must be a non-empty string naming the served model")
        return _check(string[0])
    return None


def _is_model_key(token: bytes) -> bool:
    if token == _MODEL_KEY:
        return True
    if b"\\" not in token:
        return False
    try:  # a key written with escapes, such as "mod\u0065l"
        return bool(json.loads(token) == "model")
    except ValueError:
        return False


def decode_model(body: bytes) -> str:
    """Return the top-level ``model`` by walking the whole body; raise :class:`BodyError`.

    The walk tokenises strings and brackets only (a regular expression, at C speed) and
    follows the nesting depth, so it finds the top-level key however the body is laid
    out (several ``model`` keys, escaped keys; with duplicates the last one wins, as in
    a JSON decoder) while building no objects: memory stays flat whatever the body
    holds. The rest of the body is not validated; the engine refuses invalid JSON.
    """
    first = len(body) - len(body.lstrip(_WHITESPACE))
    if first >= len(body) or body[first] != ord("{"):
        raise BodyError("the request body must be a JSON object")
    depth = 0
    value_at: int | None = None
    for token in _TAIL_TOKENS.finditer(body, first):
        symbol = body[token.start()]
        if symbol == ord('"'):
            if depth == 1:
                after = token.end()
                while after < len(body) and body[after] in _WHITESPACE:
                    after += 1
                if after < len(body) and body[after] == ord(":") and _is_model_key(token.group()):
                    value_at = after + 1
                    while value_at < len(body) and body[value_at] in _WHITESPACE:
                        value_at += 1
        elif symbol in b"{[":
            depth += 1
        else:
            depth -= 1
            if depth <= 0:
                break
    if depth != 0:
        raise BodyError("the request body is not a complete JSON object")
    if value_at is None:
        raise BodyError("the request body has no model field")
    string = _string_at(body, value_at)
    if string is None:
        raise BodyError("model must be a non-empty string naming the served model")
    return _check(string[0])


def find_model(body: bytes) -> str:
    """Return the top-level ``model`` of a JSON request body; raise :class:`BodyError`.

    The scan of :func:`scan_model`, else a walk of the whole body (:func:`decode_model`).
    """
    model = scan_model(body)
    return model if model is not None else decode_model(body)


async def model_of(body: bytes) -> str:
    """:func:`find_model` for the event loop: a large full decode runs in a thread."""
    model = scan_model(body)
    if model is not None:
        return model
    if len(body) <= FULL_WALK_INLINE_BYTES:
        return decode_model(body)
    return await asyncio.to_thread(decode_model, body)


_USAGE_KEY = re.compile(r'"usage"\s*:\s*')
_DECODER = json.JSONDecoder()
TAIL_BYTES: Final = 16384
"""How much of a response's end is kept to find its usage in."""
_MAX_TRIES: Final = 4


HEAD_BYTES: Final = 4096
"""How much of a stream's start is kept: Anthropic's ``message_start`` event, which
carries the prompt's usage, is the first event and a few hundred bytes long."""
_MESSAGE_START = re.compile(r'"type"\s*:\s*"message_start"')


def _usage_values(text: str) -> Iterator[Any]:
    """Yield the decoded values of the last few ``"usage":`` keys of ``text``, last first."""
    matches = list(_USAGE_KEY.finditer(text))
    for match in reversed(matches[-_MAX_TRIES:]):
        try:
            value, _ = _DECODER.raw_decode(text, match.end())
        except (ValueError, RecursionError):
            continue
        yield value


def usage_in_tail(tail: bytes) -> Usage | None:
    """Return the usage in the last part of a response body or event stream, if any.

    Each ``"usage":`` key from the end is tried (a few at most) until one holds token
    counts: the final usage chunk of a stream follows content chunks that may carry
    ``"usage": null``. The Responses API's final event nests usage in ``response``,
    which the same search finds.
    """
    for value in _usage_values(tail.decode("utf-8", errors="replace")):
        usage = parse_usage(value)
        if usage is not None:
            return usage
    return None


def _opening_usage(head: bytes) -> Mapping[str, Any] | None:
    """Return the usage of an Anthropic ``message_start`` event at a stream's start."""
    text = head.decode("utf-8", errors="replace")
    start = _MESSAGE_START.search(text)
    found = _USAGE_KEY.search(text, start.end()) if start is not None else None
    if found is None:
        return None
    try:
        value, _ = _DECODER.raw_decode(text, found.end())
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, Mapping) else None


def usage_in_stream(head: bytes, tail: bytes) -> Usage | None:
    """Return the usage of an event stream from its first and last bytes.

    An Anthropic Messages stream reports the input and cache counts in its first event
    (``message_start``) and the cumulative output count in its last ``message_delta``,
    which may or may not repeat the others: the two are merged, the later counts
    winning (:func:`sessionfleet.engines.anthropic.merge_stream_usage`). Taking only
    the last usage would count a turn's prompt as zero tokens. A stream that broke
    before its ``message_delta`` still counts its prompt. Every other stream carries
    its usage whole in its last chunk (:func:`usage_in_tail`).
    """
    opening = _opening_usage(head)
    if opening is None:
        return usage_in_tail(tail)
    text = tail.decode("utf-8", errors="replace")
    closing = next((value for value in _usage_values(text) if isinstance(value, Mapping)), {})
    return parse_usage(merge_stream_usage(opening, closing))


def usage_in_body(body: bytes) -> Usage | None:
    """Return the usage of a complete (non-streamed) JSON response."""
    if len(body) <= TAIL_BYTES:
        try:
            return usage_of_response(json.loads(body))
        except (ValueError, RecursionError):
            return None
    return usage_in_tail(body[-TAIL_BYTES:])


class BodyBudget:
    """The bytes of request bodies a front (router or EPP) holds at once, against a cap."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0

    def reserve(self, size: int) -> bool:
        """Take ``size`` bytes of the budget; False (and nothing taken) when they do not fit."""
        if self.used + size > self.capacity:
            return False
        self.used += size
        return True

    def release(self, size: int) -> None:
        """Give back bytes taken with :meth:`reserve`."""
        self.used -= size
