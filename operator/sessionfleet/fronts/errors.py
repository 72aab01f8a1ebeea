"""The router's own error answers: a status, a code and a sentence, in the client's shape.

Every error the router itself returns (as opposed to an engine's error, which passes
through unchanged) has the OpenAI error shape clients already parse, plus the code in
an ``X-Sessionfleet-Reason`` header so that it shows in access logs:

.. code-block:: json

   {"error": {"message": "...", "type": "invalid_request_error", "code": "invalid_body",
              "param": null}}

On Anthropic's Messages API (``/v1/messages``) the same error has Anthropic's shape,
which the Anthropic SDKs read their ``type`` and message from (the code stays in the
header):

.. code-block:: json

   {"type": "error", "error": {"type": "invalid_request_error", "message": "..."}}

Errors that retrying cannot cure carry ``x-should-retry: false``, which the OpenAI and
Anthropic SDKs obey: without it they retry every 409 (and 408, 429, 5xx) twice.

=======  ========================  ==========================================================
status   code                      when
=======  ========================  ==========================================================
400      ``invalid_body``          the body is not a JSON object, or ``model`` is missing/bad
400      ``invalid_session_id``    a session, parent or final header cannot be used
404      ``model_not_found``       no InferenceWorker serves the model
404      ``not_found``             a path the router does not serve
405      ``method_not_allowed``    not POST (GET for ``/v1/models``)
409      ``session_finished``      the session is Finished; start a new session id
413      ``body_too_large``        the body exceeds ``--max-body-bytes``
431      ``headers_too_large``     the request line and headers exceed ``--max-header-bytes``
502      ``upstream_unreachable``  the worker refused or dropped the connection
502      ``upstream_timeout``      the worker did not answer in time
502      ``upstream_error``        any other failure talking to the worker
503      ``no_ready_worker``       workers serve the model but none is Ready
503      ``no_capacity``           every Ready worker of the model is full
503      ``session_held``          the session is Migrating, Restoring or Lost, or its worker
                                   is not serving, beyond ``--hold-timeout``
503      ``api_unavailable``       a new session could not be recorded in the API server
503      ``router_not_ready``      the router has not loaded its bindings yet
=======  ========================  ==========================================================

503 answers carry ``Retry-After``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Final

from sessionfleet.engines import anthropic as anthropic_api

if TYPE_CHECKING:
    from aiohttp import web

REASON_HEADER: Final = "X-Sessionfleet-Reason"
SHOULD_RETRY_HEADER: Final = "x-should-retry"
"""Not a standard header, but the one the OpenAI and Anthropic SDKs obey before their
own status-code rules (``_should_retry`` in both)."""
FINAL_CODES: Final = frozenset({"session_finished", "session_name_collision"})
"""409 answers that no retry cures: the session stays Finished, the name stays taken."""

_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
    503: "service_unavailable_error",
}


class RouterError(Exception):
    """An answer the router gives itself instead of forwarding the request."""

    def __init__(
        self, status: int, code: str, message: str, *, retry_after: int | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after

    def body(self, *, anthropic: bool = False) -> bytes:
        """Return the JSON error body: OpenAI's shape, or Anthropic's for its clients."""
        if anthropic:
            return json.dumps(anthropic_api.error_body(self.status, self.message)).encode()
        error = {
            "message": self.message,
            "type": _TYPES.get(self.status, "error"),
            "code": self.code,
            "param": None,
        }
        return json.dumps({"error": error}).encode()

    def response(self, *, anthropic: bool = False) -> web.Response:
        """Return the HTTP answer (``anthropic``: on the Messages API, in its shape)."""
        # Imported here so that the EPP (docs/epp.md), which shares these errors,
        # does not load the HTTP stack.
        from aiohttp import web

        headers = {REASON_HEADER: self.code}
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        if self.code in FINAL_CODES:
            headers[SHOULD_RETRY_HEADER] = "false"
        return web.Response(
            status=self.status,
            body=self.body(anthropic=anthropic),
            content_type="application/json",
            headers=headers,
        )
