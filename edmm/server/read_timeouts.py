"""Read timeouts of HTTP connections: what uvicorn's own HTTP protocol lacks.

uvicorn closes a connection idle between requests (``timeout_keep_alive``) but waits forever
for a request's headers, and for a body that stops arriving: a client (or many) that opens
connections and sends nothing, or a byte now and then, holds them open. `read_timeout_protocol`
makes uvicorn's httptools protocol with two more limits:

- headers: a request's whole header block must arrive within ``header_timeout_s`` of the
  connection opening (or of the previous response's end, on a kept-alive connection), however
  slowly its bytes trickle in;
- body: once the headers are in, the body may pause at most ``body_timeout_s`` between two of
  its pieces (a large body on a slow link still arrives; a stalled one does not hold the
  connection). A pause the server makes (reading paused while the app has not read what came)
  does not count.

Past either limit the connection is closed (the app, if it runs, sees the client gone).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HEADER_TIMEOUT_S = 10.0  # `ServerConfig.header_timeout_s`'s default
BODY_TIMEOUT_S = 30.0  # `ServerConfig.body_timeout_s`'s default


class _ReadTimeoutProtocol(HttpToolsProtocol):
    """`HttpToolsProtocol` with a header timer and a body timer (the module's contract)."""

    header_timeout_s = HEADER_TIMEOUT_S
    body_timeout_s = BODY_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def on_headers_complete(self) -> None:
        self._cancel_timers()
        self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_timeout)
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_timeout)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._cancel_timers()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)  # its headers are in: it starts now
        super().on_response_complete()
        if not pipelined and not self.transport.is_closing():
            self._arm_header_timer()  # the next request's headers

    def _arm_header_timer(self) -> None:
        self._cancel_timers()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._timed_out)

    def _cancel_timers(self) -> None:
        for timer in (self._header_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._body_timer = None

    def _body_timeout(self) -> None:
        if self.flow.read_paused:  # the server's pause, not the client's
            self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_timeout)
            return
        self._timed_out()

    def _timed_out(self) -> None:
        self._header_timer = self._body_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def read_timeout_protocol(header_timeout_s: float = HEADER_TIMEOUT_S,
                          body_timeout_s: float = BODY_TIMEOUT_S) -> type[HttpToolsProtocol]:
    """uvicorn's httptools HTTP protocol with these read timeouts (seconds, > 0), for
    ``uvicorn.Config(http=...)``."""
    if header_timeout_s <= 0 or body_timeout_s <= 0:
        raise ValueError(f"read timeouts must be > 0, got {header_timeout_s}, {body_timeout_s}")
    return type("ReadTimeoutProtocol", (_ReadTimeoutProtocol,),
                {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s})
