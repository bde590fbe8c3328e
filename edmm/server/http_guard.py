"""`RequestGuard`: the HTTP-level limits in front of the app (pure ASGI middleware).

Before a request reaches a route it checks

- the ``Host`` header against the allowed names (a page on another origin that rebinds its
  DNS name to 127.0.0.1 still sends its own name: 400),
- the total size of the headers (431),
- the body size: ``Content-Length`` at once, and the bytes received while reading (413; the
  body is read here, so a route never sees one over the limit),

and answers each refusal with an OpenAI error object. A request it lets through carries the
wall-clock time its body was read in its ASGI state (`BODY_READ_NS`, for `edmm.server.stages`).
"""

from __future__ import annotations

import ipaddress
import json
import time
from collections.abc import Awaitable, Callable, Collection, MutableMapping
from typing import Any

from edmm.openai_errors import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_MAX_BODY_BYTES = 16 << 20
DEFAULT_MAX_HEADER_BYTES = 64 << 10
_WILDCARD_HOSTS = ("0.0.0.0", "::", "")
# A body over the limit is read on (and dropped) up to this many times the limit, so that the
# client, still sending, reads the 413 instead of a reset connection.
DRAIN_FACTOR = 4
BODY_READ_NS = "edmm_body_read_ns"  # key in ``scope["state"]`` (Starlette's ``request.state``)


def default_allowed_hosts(bound: str) -> list[str] | None:
    """The ``Host`` names a server bound to ``bound`` accepts: its own address, plus
    ``localhost`` and the loopback addresses when it is loopback; None (any) when it is bound
    to every interface (then the operator lists the names with ``--allowed-hosts``)."""
    if bound in _WILDCARD_HOSTS:
        return None
    hosts = [bound]
    if bound == "localhost" or _is_loopback(bound):
        hosts += ["localhost", "127.0.0.1", "::1"]
    return sorted(set(hosts))


class RequestGuard:
    """ASGI middleware enforcing the module docstring's limits on ``app``.

    Args:
        allowed_hosts: accepted ``Host`` names (without port, case-insensitive); None: any.
        max_body_bytes: the largest request body.
        max_header_bytes: the largest total of header names and values.
    """

    def __init__(self, app: ASGIApp, allowed_hosts: Collection[str] | None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES) -> None:
        self.app = app
        self.allowed_hosts = (None if allowed_hosts is None or "*" in allowed_hosts
                              else {h.lower().strip("[]") for h in allowed_hosts})
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = list(scope.get("headers", []))
        if sum(len(k) + len(v) for k, v in headers) > self.max_header_bytes:
            await _refuse(send, 431, f"the request headers are over {self.max_header_bytes} "
                                     "bytes", "headers_too_large")
            return
        host = _host_name(dict(headers).get(b"host", b""))
        if self.allowed_hosts is not None and host not in self.allowed_hosts:
            await _refuse(send, 400, f"the Host header {host!r} is not one this server "
                                     "answers to (see --allowed-hosts)", "invalid_host")
            return
        length = dict(headers).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            await self._too_large(send)
            return
        body = await self._read_body(receive)
        if body is None:
            await self._too_large(send)
            return
        scope.setdefault("state", {})[BODY_READ_NS] = time.time_ns()
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive: Receive) -> Message | None:
        """The whole body as one ``http.request`` message, or None past the limit (a
        disconnect is passed on as it came)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return message
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await _drain(receive, message, self.max_body_bytes * DRAIN_FACTOR)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

    async def _too_large(self, send: Send) -> None:
        await _refuse(send, 413, f"the request body is over {self.max_body_bytes} bytes",
                      "request_too_large")


async def _drain(receive: Receive, message: Message, most: int) -> None:
    """Read and drop the rest of a body (at most ``most`` bytes)."""
    while message.get("more_body", False) and most > 0:
        message = await receive()
        if message["type"] != "http.request":
            return
        most -= len(message.get("body", b""))


def _replay(first: Message, receive: Receive) -> Receive:
    """``receive`` that returns ``first`` once, then what ``receive`` returns."""
    pending = [first]

    async def replay() -> Message:
        if pending:
            return pending.pop()
        return await receive()
    return replay


def _host_name(value: bytes) -> str:
    """The host of a ``Host`` header, without the port or IPv6 brackets, lower case."""
    host = value.decode("latin-1").strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def _refuse(send: Send, status: int, message: str, code: str) -> None:
    body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
