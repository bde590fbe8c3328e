"""API-key authentication (``edmm serve --api-key``, or ``$EDMM_API_KEY``), as vLLM's server
and OpenAI's API do it.

Every request under ``/v1`` must send one of the keys as ``Authorization: Bearer KEY``;
``/health`` and ``/metrics`` stay open (as in vLLM). A request without the header, or with
another key, is a 401 whose body is OpenAI's: ``invalid_request_error``, code None when no key
was sent, ``invalid_api_key`` for a wrong one (its message shows only the key's first and last
characters). Keys are compared in constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from typing import Any

from edmm.openai_errors import error_body, send_error

PROTECTED_PREFIX = "/v1"
NO_KEY = ("You didn't provide an API key. You need to provide your API key in an "
          "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")


class ApiKeyGuard:
    """ASGI middleware: 401 for a ``/v1`` request without one of ``keys`` (see the module
    docstring)."""

    def __init__(self, app: Any, keys: Sequence[str]) -> None:
        self.app = app
        self._keys = [k.encode("utf-8", "surrogatepass") for k in keys]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if (scope["type"] != "http" or scope.get("method") == "OPTIONS"
                or not scope["path"].startswith(PROTECTED_PREFIX)):
            await self.app(scope, receive, send)
            return
        sent = _bearer(scope)
        if sent is not None and any(hmac.compare_digest(sent, k) for k in self._keys):
            await self.app(scope, receive, send)
            return
        if sent is None:
            body = error_body(NO_KEY, "invalid_request_error")
        else:
            body = error_body(f"Incorrect API key provided: {_masked(sent)}.",
                              "invalid_request_error", code="invalid_api_key")
        await send_error(send, 401, body, [(b"www-authenticate", b"Bearer")])


def _bearer(scope: Any) -> bytes | None:
    """The key of the request's ``Authorization: Bearer KEY`` header (None: no such header)."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, key = bytes(value).partition(b" ")
            return key.strip() if scheme.lower() == b"bearer" and key.strip() else None
    return None


def _masked(key: bytes) -> str:
    text = key.decode("utf-8", "replace")
    return text[:3] + "*" * 3 + text[-4:] if len(text) > 8 else "*" * len(text)
