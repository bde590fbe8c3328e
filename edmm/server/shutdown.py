"""Stopping ``edmm serve``: a graceful drain on SIGTERM (or Ctrl-C), and nothing left behind.

On the first SIGTERM or SIGINT `DrainingServer` stops accepting connections and answers any
new request with a 503 (`DrainGuard`, ``/health`` included, so a load balancer stops routing
here), while the requests already running go on for up to ``ServerConfig.shutdown_timeout_s``
seconds. Those still running then are ended by the engine loop (`EngineLoop.end_all`): a
stream gets an error event and ``data: [DONE]``, a non-streamed request a 503. The server then
closes its state (the engine, the tokenizing thread, the grammar-probe and client-template
processes) and returns; uvicorn's habit of re-raising the signal afterwards (which killed the
process before its children were stopped) is not followed: the exit status is 0.

Child processes die with the server even when it is killed (`edmm.server.children`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import uvicorn

from edmm.openai_errors import error_body, send_error

if TYPE_CHECKING:
    from edmm.server.state import ServerState

logger = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_TIMEOUT_S = 8.0  # docker stop sends SIGKILL 10 s after SIGTERM
# uvicorn's own limit, past the drain: requests ended by the drain get this long to send
# their last events before uvicorn cancels what is left.
UVICORN_MARGIN_S = 5.0


class DrainGuard:
    """ASGI middleware: while the server drains, every new HTTP request is a 503 (``Connection:
    close``); ``draining`` is an `threading.Event` set when the drain starts."""

    def __init__(self, app: Any, draining: threading.Event) -> None:
        self.app = app
        self.draining = draining

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.draining.is_set():
            body = error_body("the server is shutting down", "service_unavailable")
            await send_error(send, 503, body, [(b"connection", b"close"),
                                               (b"retry-after", b"1")])
            return
        await self.app(scope, receive, send)


class DrainingServer(uvicorn.Server):
    """A uvicorn server that drains ``state`` on shutdown (see the module docstring)."""

    def __init__(self, config: Any, state: ServerState, ready_message: str = "") -> None:
        super().__init__(config)
        self.state = state
        self.ready_message = ready_message

    @classmethod
    def run_app(cls, app: Any, state: ServerState, ready_message: str = "",
                **uvicorn_options: Any) -> None:
        """Serve ``app`` until SIGTERM or SIGINT, then drain (`ServerConfig.shutdown_timeout_s`)
        and return; ``ready_message`` is logged once the socket listens and the signal
        handlers are in place (a stop sent after it is never lost)."""
        grace = state.config.shutdown_timeout_s
        config = uvicorn.Config(app, timeout_graceful_shutdown=int(grace + UVICORN_MARGIN_S),
                                **uvicorn_options)
        cls(config, state, ready_message).run()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's start, then the ready message (inside `capture_signals`)."""
        await super().startup(sockets)
        if self.started and self.ready_message:
            logger.info(self.ready_message)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Refuse new requests, give the running ones the grace period, then end them."""
        state = self.state
        state.draining.set()
        grace = state.config.shutdown_timeout_s
        logger.info("shutting down: new requests get a 503; running ones have %g s to finish",
                    grace)
        timer = asyncio.get_running_loop().call_later(grace, state.end_requests)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """uvicorn's signal handling, without raising the signal again once served: the
        caller still has its state to close."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
