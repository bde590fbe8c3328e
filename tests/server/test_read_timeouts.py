"""Read timeouts of HTTP connections (`edmm.server.read_timeouts`) under a live uvicorn: idle
and half-sent connections are closed, however slowly their bytes trickle in; a body that keeps
coming, and an app that takes its time, are not cut."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from loopback import serve_app

from edmm.server.read_timeouts import read_timeout_protocol

HEADER_S = 0.6
BODY_S = 0.6
KEEP_ALIVE_S = 30  # long: what closes the connections below is the read timeouts
SLACK_S = 1.0  # a loaded machine's timer lateness


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Reads the body, waits ``?sleep`` seconds, answers its length."""
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    if scope["query_string"].startswith(b"sleep="):
        await asyncio.sleep(float(scope["query_string"][6:]))
    body = str(size).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def address() -> Iterator[tuple[str, int]]:
    with serve_app(_app, http=read_timeout_protocol(HEADER_S, BODY_S),
                   timeout_keep_alive=KEEP_ALIVE_S) as url:
        host, port = url.removeprefix("http://").split(":")
        yield host, int(port)


def _connect(address: tuple[str, int]) -> socket.socket:
    sock = socket.create_connection(address, timeout=10)
    sock.settimeout(0.05)
    return sock


def _closed(sock: socket.socket) -> bool:
    """True once the server closed ``sock`` (what it sent before is skipped)."""
    try:
        while data := sock.recv(4096):
            del data
        return True
    except TimeoutError:
        return False
    except OSError:
        return True


def _closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> float:
    """Seconds until the server closes ``sock`` (sending a byte of ``trickle`` each 50 ms
    meanwhile); fails past ``seconds``."""
    start = time.monotonic()
    for byte in [trickle[i:i + 1] for i in range(len(trickle))] or [b""] * 10**6:
        if byte:
            try:
                sock.sendall(byte)
            except OSError:
                return time.monotonic() - start
        if _closed(sock):
            return time.monotonic() - start
        assert time.monotonic() - start < seconds, "the connection stays open"
    raise AssertionError("trickle ran out before the connection closed")


def _reply_body(sock: socket.socket) -> bytes:
    """The body of the next response on ``sock`` (its length given)."""
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < int(
            data.split(b"content-length: ")[1].split(b"\r\n")[0]):
        chunk = sock.recv(4096)
        assert chunk, f"closed before the reply: {data!r}"
        data += chunk
    sock.settimeout(0.05)
    return data.split(b"\r\n\r\n", 1)[1]


def _request(sock: socket.socket, body: bytes = b"", query: str = "") -> bytes:
    """POST ``body``; the reply's body."""
    sock.sendall(b"POST /?%s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                 % (query.encode(), len(body), body))
    return _reply_body(sock)


def test_idle_connections_are_closed_after_the_header_timeout(
        address: tuple[str, int]) -> None:
    """200 connections that send nothing: all closed, none before the timeout (each counted
    from its own connect: opening 200 may take longer than the timeout on a loaded machine)."""
    socks, opened = [], []
    try:
        for _ in range(200):
            socks.append(_connect(address))
            opened.append(time.monotonic())
        assert not any(_closed(s) for s in socks[-5:])  # just opened
        for sock, since in zip(socks, opened, strict=True):
            while not _closed(sock):
                assert time.monotonic() < since + HEADER_S + SLACK_S, \
                    "an idle connection stays open"
        assert time.monotonic() - opened[-1] >= HEADER_S * 0.9
    finally:
        for sock in socks:
            sock.close()


def test_headers_trickled_in_are_cut_at_the_header_timeout(address: tuple[str, int]) -> None:
    """Bytes keep coming, the headers never end: closed anyway (fresh and kept-alive)."""
    trickle = b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000
    with _connect(address) as sock:
        assert _closed_within(sock, HEADER_S + SLACK_S, trickle) >= HEADER_S * 0.9
    with _connect(address) as sock:
        assert _request(sock) == b"0"  # kept alive after it
        assert _closed_within(sock, HEADER_S + SLACK_S, trickle) >= HEADER_S * 0.9


@pytest.mark.slow  # a server, subprocess or seconds of waiting: the thorough tier
def test_a_stalled_body_is_cut_a_slow_one_is_not(address: tuple[str, int]) -> None:
    """A body that stops is cut ``BODY_S`` after its last piece; one whose pieces keep
    coming (in all longer than both timeouts) is read whole and answered."""
    with _connect(address) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b"x" * 10)
        assert _closed_within(sock, BODY_S + SLACK_S) >= BODY_S * 0.9
    with _connect(address) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 8\r\n\r\n")
        for _ in range(8):
            time.sleep(BODY_S / 3)
            sock.sendall(b"x")
        assert _reply_body(sock) == b"8"


@pytest.mark.slow  # a server, subprocess or seconds of waiting: the thorough tier
def test_an_app_that_takes_its_time_is_not_cut(address: tuple[str, int]) -> None:
    """No timer runs while the app works on a request whose body is in."""
    with _connect(address) as sock:
        assert _request(sock, b"abc", f"sleep={HEADER_S + BODY_S + 0.3}") == b"3"
        assert not _closed(sock)
