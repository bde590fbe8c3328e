"""A live ASGI app on a free loopback port, for the tests that talk HTTP to one.

Its connections have ``TCP_NODELAY``, as ``edmm serve``'s do: the listening socket is made with
``IPPROTO_TCP``, which asyncio needs to see to set the option on each accepted connection (with
protocol 0 it does not, and every response after a kept-alive connection's first waits some
40 ms for the client's delayed ACK).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

START_TIMEOUT_S = 30.0


@contextmanager
def serve_app(app: Any, **config: Any) -> Iterator[str]:
    """Run an ASGI app under uvicorn on a free loopback port (``config``: more
    `uvicorn.Config` arguments); yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                           timeout_graceful_shutdown=2, **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
