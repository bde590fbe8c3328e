"""`RequestGuard` without a model: Host names, header and body limits, on a stub ASGI app."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from edmm.server.http_guard import RequestGuard, default_allowed_hosts


async def _echo(scope: Any, receive: Any, send: Any) -> None:
    """Answers 200 with the body it read."""
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


def _send(guard: dict[str, Any], method: str, **request: Any) -> httpx.Response:
    """One request through a `RequestGuard(**guard)` in front of `_echo`."""
    async def run() -> httpx.Response:
        app = RequestGuard(_echo, **guard)  # type: ignore[arg-type]
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport,
                                     base_url="http://127.0.0.1:8000") as client:
            return await client.request(method, "/x", **request)
    return asyncio.run(run())


@pytest.mark.parametrize(("bound", "want"), [
    ("127.0.0.1", ["127.0.0.1", "::1", "localhost"]),
    ("localhost", ["127.0.0.1", "::1", "localhost"]),
    ("::1", ["127.0.0.1", "::1", "localhost"]),
    ("10.1.2.3", ["10.1.2.3"]),
    ("0.0.0.0", None),
    ("::", None),
])
def test_default_allowed_hosts(bound: str, want: list[str] | None) -> None:
    assert default_allowed_hosts(bound) == want


@pytest.mark.parametrize(("host", "ok"), [
    ("127.0.0.1:8000", True), ("LOCALHOST", True), ("[::1]:8000", True), ("::1", True),
    ("evil.example", False), ("127.0.0.1.evil.example", False), ("", False),
])
def test_host_header(host: str, ok: bool) -> None:
    resp = _send({"allowed_hosts": default_allowed_hosts("127.0.0.1")}, "POST", content=b"{}",
                 headers={"host": host})
    assert resp.status_code == (200 if ok else 400), resp.text
    if not ok:
        assert resp.json()["error"]["code"] == "invalid_host"


def test_any_host_when_allowed() -> None:
    resp = _send({"allowed_hosts": ["*"]}, "POST", content=b"{}",
                 headers={"host": "evil.example"})
    assert resp.status_code == 200


def test_body_limit() -> None:
    guard = {"allowed_hosts": None, "max_body_bytes": 1000}
    assert _send(guard, "POST", content=b"a" * 1000).content == b"a" * 1000
    resp = _send(guard, "POST", content=b"a" * 1001)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"

    async def chunks() -> Any:  # no Content-Length: counted while read
        for _ in range(5):
            yield b"a" * 300

    assert _send(guard, "POST", content=chunks()).status_code == 413


def test_header_limit() -> None:
    guard = {"allowed_hosts": None, "max_header_bytes": 4096}
    assert _send(guard, "GET", headers={"x-a": "a" * 1000}).status_code == 200
    resp = _send(guard, "GET", headers={"x-a": "a" * 5000})
    assert resp.status_code == 431 and resp.json()["error"]["code"] == "headers_too_large"
