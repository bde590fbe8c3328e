"""The OpenAI error object, shared by `edmm serve` and `edmm proxy` (no heavy imports)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable
from typing import Any


def error_body(message: str, type_: str, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    """``{"error": {...}}`` in OpenAI's shape (``code``: OpenAI's string, or the HTTP status
    as vLLM writes it)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


async def send_error(send: Callable[[dict[str, Any]], Awaitable[None]], status: int,
                     body: dict[str, Any], headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """Send ``body`` (an `error_body`) as an ASGI JSON response of ``status``."""
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode()), *headers]})
    await send({"type": "http.response.body", "body": data})
