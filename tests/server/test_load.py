"""Issue 16's load test: abusive clients beside normal ones, on loopback, bounded in time.

Normal clients each send short chat requests one after another; the test measures their p99
latency alone, then again while abusive clients hammer the same server with requests that
must each cost only themselves: a costly grammar (refused at its first mask), a runaway client
chat template (stopped by its sandbox budget), bodies over the size limit (413 while read) and
lone surrogates (400). The normal clients' p99 must stay within 1.5x of the run alone, and
every abusive request must get its 4xx. About 15 s per test on a laptop CPU, so it runs by
default. Costly grammars still slow the others (an expected failure, see its reason).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from server_helpers import MODEL, QUESTION, LiveServer, serve, server_config

from edmm.server import ServerState
from edmm.server.templates import TemplateLimits

NORMAL_CLIENTS = 3
REQUESTS_PER_CLIENT = 12
ABUSIVE_CLIENTS = 3
BODY_LIMIT = 1 << 20
P99_RATIO = 1.5


@pytest.fixture(scope="module")
def server(tiny_dir: Path) -> Iterator[LiveServer]:
    config = dataclasses.replace(
        server_config(tiny_dir), allow_client_chat_template=True, max_body_bytes=BODY_LIMIT,
        template_limits=TemplateLimits(time_s=0.25))
    yield from serve(ServerState(config))


def _normal(http: httpx.Client) -> float:
    t0 = time.monotonic()
    resp = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": QUESTION, "max_tokens": 8, "temperature": 0})
    assert resp.status_code == 200, resp.text
    return time.monotonic() - t0


def _abusive_requests() -> list[tuple[str, bytes, int]]:
    """(name, JSON body, the status it must get)."""
    chat = {"model": MODEL, "messages": QUESTION, "max_tokens": 16}
    schema = {"type": "object", "required": ["a"], "properties": {
        "a": {"type": "string", "pattern": "^((a{100}){100}){10}$"}}}
    loops = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    return [
        ("grammar", json.dumps({**chat, "response_format": {"type": "json_schema", "json_schema":
                                                            {"name": "x", "schema": schema}}}
                               ).encode(), 400),
        ("template", json.dumps({**chat, "chat_template_kwargs": {"chat_template": loops}}
                                ).encode(), 400),
        ("body", json.dumps({**chat, "pad": "x" * (2 * BODY_LIMIT)}).encode(), 413),
        ("surrogate", json.dumps({**chat, "messages": [{"role": "user", "content": "\ud800"}]}
                                 ).encode(), 400),
    ]


def _run(server: LiveServer, kinds: frozenset[str] = frozenset(),
         ) -> tuple[list[float], dict[str, int]]:
    """The normal clients' latencies beside abusive clients sending requests of ``kinds``
    (none: alone), and how many of each kind were sent (each checked for its status)."""
    abuse = bool(kinds)
    latencies: list[float] = []
    sent: dict[str, int] = {}
    done = threading.Event()
    lock = threading.Lock()

    def normal() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            for _ in range(REQUESTS_PER_CLIENT):
                seconds = _normal(http)
                with lock:
                    latencies.append(seconds)

    def abusive(offset: int) -> None:
        requests = [r for r in _abusive_requests() if r[0] in kinds]
        with httpx.Client(base_url=server.url, timeout=60) as http:
            i = offset
            while not done.is_set():
                name, body, status = requests[i % len(requests)]
                resp = http.post("/v1/chat/completions", content=body,
                                 headers={"content-type": "application/json"})
                assert resp.status_code == status, (name, resp.text[:300])
                assert "error" in resp.json()
                with lock:
                    sent[name] = sent.get(name, 0) + 1
                i += 1

    errors: list[BaseException] = []

    def guarded(fn: Callable[..., None], *args: int) -> Callable[[], None]:
        def run() -> None:
            try:
                fn(*args)
            except BaseException as e:  # reported by the main thread
                errors.append(e)
        return run

    side = [threading.Thread(target=guarded(abusive, k)) for k in range(ABUSIVE_CLIENTS * abuse)]
    for t in side:
        t.start()
    if abuse:
        time.sleep(0.5)  # the abusive clients are at it before the normal ones start
    main = [threading.Thread(target=guarded(normal)) for _ in range(NORMAL_CLIENTS)]
    for t in main:
        t.start()
    for t in main:
        t.join()
    done.set()
    for t in side:
        t.join()
    if errors:
        raise errors[0]
    return latencies, sent


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def _compare(server: LiveServer, kinds: frozenset[str]) -> None:
    _run(server)  # warm-up: the first requests compile and fill caches
    alone, _ = _run(server)
    beside, sent = _run(server, kinds)
    assert set(sent) == kinds, sent
    assert _p99(beside) <= P99_RATIO * _p99(alone), (
        f"p99 {_p99(beside):.3f} s beside abusive clients ({sent}), "
        f"{_p99(alone):.3f} s alone")


def test_abusive_clients_do_not_slow_normal_ones(server: LiveServer) -> None:
    _compare(server, frozenset({"template", "body", "surrogate"}))


@pytest.mark.xfail(strict=True, reason="a grammar's compilation and first mask run on an "
                   "in-process thread and hold the GIL against the engine thread (measured "
                   "~7x the p99); needs a compile probe in a worker process")
def test_costly_grammar_clients_do_not_slow_normal_ones(server: LiveServer) -> None:
    _compare(server, frozenset({"grammar"}))
