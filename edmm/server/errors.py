"""Typed API errors, each rendered as an OpenAI error object with its HTTP status.

Every handler raises an `APIError` subclass; the app turns it into
``{"error": {"message", "type", "param", "code"}}`` (`edmm.openai_errors.error_body`, which the
proxy shares). Anything else that escapes a handler is a
bug: it becomes a 500 with the same shape, and the server keeps running.
"""

from __future__ import annotations

import math
from http import HTTPStatus
from typing import Any

from edmm.openai_errors import error_body


class APIError(Exception):
    """An error reported to the client; subclasses fix the HTTP status and the error type."""

    status: HTTPStatus = HTTPStatus.INTERNAL_SERVER_ERROR
    type: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The OpenAI error object."""
        return error_body(self.message, self.type, self.param, self.code)

    @property
    def headers(self) -> dict[str, str]:
        """HTTP headers of the error response."""
        return {}


class BadRequestError(APIError):
    """The request is malformed or asks for something this server cannot do (400)."""

    status = HTTPStatus.BAD_REQUEST
    type = "invalid_request_error"


class ContextLengthError(BadRequestError):
    """The prompt (plus the requested completion) does not fit in the model's context (400)."""

    def __init__(self, message: str, *, param: str | None = "messages") -> None:
        super().__init__(message, param=param, code="context_length_exceeded")


class NotFoundError(APIError):
    """An unknown model, session or pending tool call (404)."""

    status = HTTPStatus.NOT_FOUND
    type = "not_found_error"


class ModelNotFoundError(NotFoundError):
    """The request names a model this server does not serve (404, OpenAI's wording)."""

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.", param="model",
                         code="model_not_found")
        self.type = "invalid_request_error"


class ConflictError(APIError):
    """The request does not fit the current state of a session (409)."""

    status = HTTPStatus.CONFLICT
    type = "invalid_request_error"


class PayloadTooLargeError(APIError):
    """A part of the request is over its size limit (413)."""

    status = HTTPStatus.REQUEST_ENTITY_TOO_LARGE
    type = "invalid_request_error"


class TooManyRequestsError(APIError):
    """The client is over one of its quotas (429); ``retry_after_s``: when to try again
    (the ``Retry-After`` header, whole seconds, at least 1)."""

    status = HTTPStatus.TOO_MANY_REQUESTS
    type = "rate_limit_error"

    def __init__(self, message: str, retry_after_s: float, *, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message, param=param, code=code)
        self.retry_after_s = retry_after_s

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


class ServiceUnavailableError(APIError):
    """The engine is shutting down or failed (503)."""

    status = HTTPStatus.SERVICE_UNAVAILABLE
    type = "service_unavailable"


class EngineStepError(APIError):
    """The engine failed while computing this request (500); the request was aborted."""

    status = HTTPStatus.INTERNAL_SERVER_ERROR
    type = "internal_error"
