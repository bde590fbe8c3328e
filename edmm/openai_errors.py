"""The OpenAI error object, shared by `edmm serve` and `edmm proxy` (no heavy imports)."""

from __future__ import annotations

from typing import Any


def error_body(message: str, type_: str, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    """``{"error": {...}}`` in OpenAI's shape (``code``: OpenAI's string, or the HTTP status
    as vLLM writes it)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
