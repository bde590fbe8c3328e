"""Issue 16's load test: abusive clients beside normal ones, on loopback, bounded in time.

Normal clients each send short chat requests one after another; the test measures their p99
latency alone and while abusive clients hammer the same server with requests that must each
cost only themselves: a runaway client chat template (stopped by its sandbox budget), bodies
over the size limit (413 while read), lone surrogates (400), and grammars, each one new so that
no remembered verdict helps: a costly regex, and the same regex placed after cheap masks (both
refused by the grammar probe's process, the second by its pattern's own check). Every abusive
request must get its 4xx.

Issue 44's abusive tenants, under API keys of their own beside the normal clients' key, on a
server with a quota of awaiting sessions per key and short read timeouts: a key that holds its
quota of sessions ended in forced tool calls, never resumed, and floods more (each a 429 with
``Retry-After``); idle and half-sent connections (each closed by the read timeouts, unanswered);
deep JSON bodies (400s); tiny tool-output chunks without whitespace into one session (200s).

The CPU is shared (other processes come and go), so one comparison of two runs would measure
the neighbours as much as the server: the test runs `ROUNDS` rounds, each a run alone and a run
beside the abusive clients back to back (in alternating order), and compares the median over
rounds of the per-round ratio of p99s with `P99_RATIO`. A failing measurement is repeated once
(both are reported, the second with grammars of its own); a server that lets abusive clients
slow the others fails both. About 10 s per test on a shared 2-core CPU (twice that when the
measurement is repeated), and 5 s to start the abusive clients' process.

The server runs in the test's process, beside the normal clients (the same work alone and
beside); the abusive clients run in a spawned process of their own (`AbusiveClients`), so that
their own Python (httpx, building deep JSON, sockets) does not hold the server's GIL: as
threads of the test's process they did, and the test measured them more than the server.

Each abusive client is paced to `ABUSIVE_RATE` requests per second: together more than the
normal clients' rate. The test claims that abusive requests at such a rate cost only
themselves, not that the server survives a flood: unpaced, sending as fast as they are answered
(keep-alive connections with ``TCP_NODELAY``, as ``edmm serve``'s and the test server's have),
the tenants send 2-15 times as many requests and the normal clients' ratio is 2-3 on this CPU:
the server's HTTP layer and engine share one process and its GIL, and a refusal (a 429 of a
rate limit included: ~0.7-1.0 ms) costs about what the cheap requests it refuses cost
(`docs/limits.md`). Until 2026-12-07 the test server lacked ``TCP_NODELAY``, and a client's
delayed ACK (~40 ms per kept-alive response) did this pacing unannounced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import multiprocessing
import socket
import statistics
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import httpx
import pytest
from server_helpers import (
    MODEL,
    QUESTION,
    WEATHER,
    LiveServer,
    nested_json,
    serve,
    server_config,
)

from edmm.server import ServerState
from edmm.server.sessions import owner_of
from edmm.server.templates import TemplateLimits

pytestmark = pytest.mark.slow  # ~10 s a test; fast tier: each abuse beside a bystander,
# test_adversarial.py

NORMAL_CLIENTS = 3
REQUESTS_PER_CLIENT = 8
ABUSIVE_CLIENTS = 3  # at least; one per kind where there are more kinds
ROUNDS = 5
BODY_LIMIT = 1 << 20
P99_RATIO = 1.5
LEAD_S = 0.3  # the abusive clients are at it this long before the normal ones start
COSTLY = "^((a{100}){100}){%d}$"  # lexer states for ~0.2 s of CPU (any count >= 10)
NORMAL_KEY = {"Authorization": "Bearer normal-key"}  # the normal clients' API key
# the abusive tenants' server and keys
FLOOD_KEY = {"Authorization": "Bearer flooding-key"}  # forced-call sessions, never resumed
ABUSE_KEY = {"Authorization": "Bearer abusive-key"}  # connections, deep JSON, tiny chunks
MAX_AWAITING = 8  # sessions awaiting tools a key may hold
READ_TIMEOUT_S = 0.5  # header and body read timeouts
SLACK_S = 3.0  # a loaded machine's lateness in closing a timed-out connection
BURST = 10  # requests of a kind one abusive client sends in a row
# requests per second one abusive client sends over HTTP at most (each paced): with
# `ABUSIVE_CLIENTS` of them more than the normal clients' rate alone (~35 per second on the
# 2-core CPU). At 20 the tenants test passed alone (1.0-1.3) but not in the thorough tier's
# long-lived process (1.70 then 1.52). Unpaced: see the module docstring.
ABUSIVE_RATE = 10.0
CONNECTIONS = 30  # idle and half-sent connections one abusive client opens at once
DEEP = 100_000  # levels of the deep JSON bodies
CHILD_TIMEOUT_S = 60.0  # the abusive clients' process starts, and ends its bursts, within this


@pytest.fixture(scope="module")
def server(tiny_dir: Path) -> Iterator[LiveServer]:
    config = dataclasses.replace(
        server_config(tiny_dir), allow_client_chat_template=True, max_body_bytes=BODY_LIMIT,
        template_limits=TemplateLimits(time_s=0.25))
    yield from serve(ServerState(config))


@pytest.fixture(scope="module")
def abusers() -> Iterator[AbusiveClients]:
    """The process of the abusive clients, one for the module's tests."""
    with AbusiveClients() as clients:
        yield clients


@pytest.fixture(scope="module")
def tenants(tiny_dir: Path) -> Iterator[LiveServer]:
    """A server with a quota of awaiting sessions per key and short read timeouts."""
    config = dataclasses.replace(
        server_config(tiny_dir), max_body_bytes=BODY_LIMIT, max_awaiting_per_key=MAX_AWAITING,
        header_timeout_s=READ_TIMEOUT_S, body_timeout_s=READ_TIMEOUT_S)
    yield from serve(ServerState(config), read_timeouts=True)


def _normal(http: httpx.Client) -> float:
    t0 = time.monotonic()
    resp = http.post("/v1/chat/completions", headers=NORMAL_KEY, json={
        "model": MODEL, "messages": QUESTION, "max_tokens": 8, "temperature": 0})
    assert resp.status_code == 200, resp.text
    return time.monotonic() - t0


def _schema_request(schema: dict[str, object], max_tokens: int) -> dict[str, object]:
    return {"model": MODEL, "messages": QUESTION, "max_tokens": max_tokens, "temperature": 0,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": schema}}}


def _abusive(kind: str, i: int) -> tuple[bytes, int]:
    """The ``i``-th abusive request of ``kind`` (a JSON body) and the status it must get."""
    chat = {"model": MODEL, "messages": QUESTION, "max_tokens": 16}
    if kind == "grammar":  # refused by the probe: its first mask is over the budget
        body = _schema_request({"type": "object", "required": ["a"], "properties": {
            "a": {"type": "string", "pattern": COSTLY % (10 + i)}}}, 16)
        return json.dumps(body).encode(), 400
    if kind == "later":  # cheap first mask; refused for its pattern alone
        body = _schema_request({"type": "object", "required": ["x", "a"], "properties": {
            "x": {"type": "string", "maxLength": 2},
            "a": {"type": "string", "pattern": COSTLY % (10 + i)}}}, 48)
        return json.dumps(body).encode(), 400
    if kind == "template":
        loops = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                 "{% endfor %}")
        return json.dumps({**chat, "chat_template_kwargs": {"chat_template": loops}}
                          ).encode(), 400
    if kind == "body":
        return json.dumps({**chat, "pad": "x" * (2 * BODY_LIMIT)}).encode(), 413
    assert kind == "surrogate"
    return json.dumps({**chat, "messages": [{"role": "user", "content": "\ud800"}]}
                      ).encode(), 400


Send = Callable[[httpx.Client, int], int]
"""``send(http, i)`` sends the ``i``-th burst of a kind of abusive request (on ``http``, or on
sockets of its own), checks that each request gets what it must, and returns how many requests
it sent."""


def _posted(kind: str) -> Send:
    """The chat body `_abusive` makes for ``kind``, posted; its 4xx checked."""
    def send(http: httpx.Client, i: int) -> int:
        body, status = _abusive(kind, i)
        resp = http.post("/v1/chat/completions", content=body,
                         headers={"content-type": "application/json"})
        assert resp.status_code == status, (kind, resp.text[:300])
        assert "error" in resp.json()
        return 1
    return send


def _forced_call(http: httpx.Client, key: dict[str, str]) -> httpx.Response:
    """A turn of ``key``'s that ends in a forced weather call (the session then awaits it)."""
    return http.post("/v1/chat/completions", headers=key, json={
        "model": MODEL, "messages": QUESTION, "tools": [WEATHER], "tool_choice": "required",
        "parallel_tool_calls": False, "temperature": 0, "max_tokens": 64})


def _awaiting(resp: httpx.Response) -> tuple[str, str]:
    """The session id and call id of a turn that ended in one tool call."""
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    return resp.headers["x-session-id"], choice["message"]["tool_calls"][0]["id"]


def _flood(http: httpx.Client, i: int) -> int:
    """More forced-call turns of `FLOOD_KEY`, which holds its quota of awaiting sessions:
    each a 429 with ``Retry-After``."""
    for _ in range(BURST):
        resp = _forced_call(http, FLOOD_KEY)
        assert resp.status_code == 429, resp.text[:300]
        assert resp.json()["error"]["code"] == "quota_awaiting", resp.text[:300]
        assert 1 <= int(resp.headers["retry-after"]) <= 600
    return BURST


def _half_sent(address: tuple[str, int], session: str) -> list[bytes]:
    """What the idle and half-sent connections send: nothing, part of the headers, the
    headers and part of the body."""
    head = (f"POST /v1/edmm/sessions/{session}/tool_output HTTP/1.1\r\n"
            f"Host: {address[0]}:{address[1]}\r\n"
            f"Authorization: {ABUSE_KEY['Authorization']}\r\n").encode()
    return [b"", head + b"Content-Type: appl",
            head + b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"tool"]


def _connections(address: tuple[str, int], session: str) -> int:
    """`CONNECTIONS` connections at once, idle or half-sent: each closed by the read
    timeouts, unanswered."""
    sends = _half_sent(address, session)
    socks = [socket.create_connection(address, timeout=10) for _ in range(CONNECTIONS)]
    try:
        for k, sock in enumerate(socks):
            sock.sendall(sends[k % len(sends)])
        deadline = time.monotonic() + READ_TIMEOUT_S + SLACK_S
        for sock in socks:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                assert sock.recv(4096) == b"", "a half-sent request was answered"
            except TimeoutError:
                raise AssertionError("an idle or half-sent connection stays open") from None
            except ConnectionResetError:
                pass  # closed
    finally:
        for sock in socks:
            sock.close()
    return CONNECTIONS


def _deep(http: httpx.Client, i: int, session: str) -> int:
    """JSON nested `DEEP` levels deep, as a chat body and as a tool output: 400s."""
    inner = nested_json(DEEP)
    bodies = [('/v1/chat/completions', f'{{"model": "{MODEL}", "messages": {inner}}}'),
              (f"/v1/edmm/sessions/{session}/tool_output",
               f'{{"tool_call_id": "c", "content": {inner}}}')]
    for j in range(BURST):
        path, body = bodies[(i + j) % len(bodies)]
        resp = http.post(path, content=body, headers={**ABUSE_KEY,
                                                      "content-type": "application/json"})
        assert resp.status_code == 400, resp.text[:300]
        assert "error" in resp.json()
    return BURST


def _chunks(http: httpx.Client, i: int, session: str, call: str) -> int:
    """Tiny tool-output chunks without whitespace into the session's awaited call: 200s."""
    path = f"/v1/edmm/sessions/{session}/tool_output"
    for j in range(BURST):
        chunk = "ab7{"[(i + j) % 4]
        resp = http.post(path, headers=ABUSE_KEY, json={"tool_call_id": call, "content": chunk})
        assert resp.status_code == 200, resp.text[:300]
        assert resp.json()["accepted"] == 1
    return BURST


TENANT_KINDS = ("flood", "connections", "deep", "chunks")


@dataclass(frozen=True)
class Target:
    """What the abusive clients' process needs to make their requests (plain data, pickled to
    it): the server's URL, the kinds of abuse (`_sender`'s names), and for `TENANT_KINDS` the
    session of `ABUSE_KEY`'s whose awaited ``call`` the deep tool outputs and chunks name."""

    url: str
    kinds: tuple[str, ...]
    session: str = ""
    call: str = ""


def _sender(kind: str, target: Target) -> Send:
    """The `Send` of ``kind`` against ``target``: a tenants' kind, or a posted chat body."""
    host, port = target.url.removeprefix("http://").split(":")
    tenants: dict[str, Send] = {
        "flood": _flood,
        "connections": lambda http, i: _connections((host, int(port)), target.session),
        "deep": lambda http, i: _deep(http, i, target.session),
        "chunks": lambda http, i: _chunks(http, i, target.session, target.call)}
    return tenants.get(kind) or _posted(kind)


def _tenant_target(server: LiveServer) -> Target:
    """Issue 44's abusive tenants, once `FLOOD_KEY` holds its quota of awaiting sessions
    (its next turn is a 429) and `ABUSE_KEY` holds one whose call the chunks feed."""
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with ThreadPoolExecutor(MAX_AWAITING) as pool:
            held = list(pool.map(lambda _: _forced_call(http, FLOOD_KEY), range(MAX_AWAITING)))
        assert len({_awaiting(resp) for resp in held}) == MAX_AWAITING
        assert _flood(http, 0) == BURST
        session, call = _awaiting(_forced_call(http, ABUSE_KEY))
    return Target(server.url, TENANT_KINDS, session, call)


def _abusive_client(target: Target, offset: int, next_serial: Callable[[], int],
                    done: threading.Event) -> Counter[str]:
    """One abusive client: bursts of ``target``'s kinds in turn (from the ``offset``-th),
    each numbered by ``next_serial`` and each HTTP request paced to `ABUSIVE_RATE`, until
    ``done``; how many requests of each kind it sent."""
    sends = [(kind, _sender(kind, target)) for kind in target.kinds]
    sent: Counter[str] = Counter()
    i = offset
    pace = _Pacer(ABUSIVE_RATE, done)
    with httpx.Client(base_url=target.url, timeout=60,
                      event_hooks={"request": [lambda request: pace()]}) as http:
        while not done.is_set():
            kind, send = sends[i % len(sends)]
            sent[kind] += send(http, next_serial())
            i += 1
    return sent


class _Pacer:
    """Called before each request of a client: waits until ``1 / rate`` seconds after the
    previous request's slot (no wait once ``done`` is set)."""

    def __init__(self, rate: float, done: threading.Event) -> None:
        self._gap = 1.0 / rate
        self._done = done
        self._next = time.monotonic()

    def __call__(self) -> None:
        now = time.monotonic()
        self._done.wait(max(0.0, self._next - now))
        self._next = max(now, self._next) + self._gap


class _Serial:
    """Serial numbers 0, 1, 2, ... to any thread."""

    def __init__(self) -> None:
        self._count = itertools.count()
        self._lock = threading.Lock()

    def __call__(self) -> int:
        with self._lock:
            return next(self._count)


def _abusive_process(conn: Connection) -> None:
    """The abusive clients' process (see `AbusiveClients`). It answers ``"ready"``; then at
    each ``("start", target)`` it starts `ABUSIVE_CLIENTS` clients of ``target`` (at least
    one per kind) and answers ``"started"``; at the next message it stops them (each ends its
    burst) and answers their counts of requests sent per kind, or an `AssertionError` with
    the first failure's traceback. It ends at any other message. The bursts' serial numbers
    run on across the starts of one target: every grammar of a test is new (those of a
    repeated measurement too)."""
    serials: dict[Target, _Serial] = {}
    conn.send("ready")
    while (message := conn.recv())[0] == "start":
        target: Target = message[1]
        serial = serials.setdefault(target, _Serial())
        clients = max(ABUSIVE_CLIENTS, len(target.kinds))
        done = threading.Event()
        with ThreadPoolExecutor(clients) as pool:
            runs = [pool.submit(_abusive_client, target, k, serial, done)
                    for k in range(clients)]
            conn.send("started")
            conn.recv()
            done.set()
        conn.send(_outcome(runs))


def _outcome(runs: list[Future[Counter[str]]]) -> Counter[str] | AssertionError:
    """The clients' counts summed, or an `AssertionError` with the first failure's traceback
    (an exception of the child process, sent as its text)."""
    for run in runs:
        error = run.exception()
        if error is not None:
            return AssertionError("an abusive client failed:\n"
                                  + "".join(traceback.format_exception(error)))
    return sum((run.result() for run in runs), Counter())


class AbusiveClients:
    """Abusive clients in a process of their own, started by ``with`` (and ended after it),
    set on a server by `abusing`.

    A process, not threads beside the test's: the clients' own Python (httpx, building deep
    JSON, 30 sockets at a time) would hold the GIL of the test process, where the server
    runs, and the test would measure its clients rather than the server. Spawned (not
    forked: the test process runs threads); the clients are made there from a `Target`.
    """

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, self._child = context.Pipe()
        self._process = context.Process(target=_abusive_process, args=(self._child,),
                                        name="abusive-clients", daemon=True)

    def __enter__(self) -> AbusiveClients:
        self._process.start()
        self._child.close()
        assert self._receive() == "ready"
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(OSError):
            self._conn.send(("end",))
        self._process.join(CHILD_TIMEOUT_S)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()

    @contextlib.contextmanager
    def abusing(self, target: Target, sent: Counter[str]) -> Iterator[None]:
        """``target``'s abusive clients at it through the block, from `LEAD_S` before it;
        their requests counted in ``sent`` after it (each checked: a failed check fails the
        block)."""
        self._conn.send(("start", target))
        assert self._receive() == "started"
        time.sleep(LEAD_S)
        try:
            yield
        finally:
            self._conn.send(("stop",))
            counts = self._receive()
        assert isinstance(counts, Counter), counts
        sent.update(counts)

    def _receive(self) -> object:
        """The process's next answer (an error it answers is raised)."""
        if not self._conn.poll(CHILD_TIMEOUT_S):
            raise AssertionError(f"the abusive clients' process did not answer in "
                                 f"{CHILD_TIMEOUT_S} s (exit code {self._process.exitcode})")
        answer = self._conn.recv()
        if isinstance(answer, BaseException):
            raise answer
        return answer


def _normal_client(url: str) -> list[float]:
    """One normal client's latencies: `REQUESTS_PER_CLIENT` requests, one after another."""
    # a connection per request: a kept-alive one the server closes at its read timeout (0.5 s
    # with the tenants' server) would race the client's next request on it
    with httpx.Client(base_url=url, timeout=60,
                      limits=httpx.Limits(max_keepalive_connections=0)) as http:
        return [_normal(http) for _ in range(REQUESTS_PER_CLIENT)]


def _run(server: LiveServer, beside: contextlib.AbstractContextManager[None]) -> list[float]:
    """The latencies of `NORMAL_CLIENTS` normal clients at once, inside ``beside``
    (`AbusiveClients.abusing`, or a null context for a run alone)."""
    with beside, ThreadPoolExecutor(NORMAL_CLIENTS) as pool:
        runs = [pool.submit(_normal_client, server.url) for _ in range(NORMAL_CLIENTS)]
        return [seconds for run in runs for seconds in run.result()]


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


@dataclass
class Measurement:
    """Per round, the normal clients' p99 alone and beside the abusive clients."""

    alone: list[float] = field(default_factory=list)
    beside: list[float] = field(default_factory=list)
    sent: Counter[str] = field(default_factory=Counter)

    @property
    def ratio(self) -> float:
        """The median over rounds of p99 beside / p99 alone."""
        return statistics.median(b / a for a, b in zip(self.alone, self.beside, strict=True))

    def __str__(self) -> str:
        rounds = ", ".join(f"{b * 1e3:.0f}/{a * 1e3:.0f}"
                           for a, b in zip(self.alone, self.beside, strict=True))
        return (f"median ratio {self.ratio:.2f} (p99 ms beside/alone per round: {rounds}; "
                f"abusive requests: {dict(self.sent)})")


def _measure(server: LiveServer, abusers: AbusiveClients, target: Target) -> Measurement:
    """`ROUNDS` rounds of a run alone and one beside ``target``'s abusive clients, in
    alternating order, after a warm-up run (the first requests compile and fill caches)."""
    m = Measurement()
    _run(server, contextlib.nullcontext())
    for r in range(ROUNDS):
        for abuse in ((False, True) if r % 2 == 0 else (True, False)):
            beside = abusers.abusing(target, m.sent) if abuse else contextlib.nullcontext()
            (m.beside if abuse else m.alone).append(_p99(_run(server, beside)))
    assert set(m.sent) == set(target.kinds), m.sent
    return m


def _compare(server: LiveServer, abusers: AbusiveClients, target: Target
             ) -> list[Measurement]:
    """Measurements beside ``target``'s abusive clients (a second one only when the first is
    over `P99_RATIO`); the last must be within it."""
    measurements = [_measure(server, abusers, target)]
    if measurements[0].ratio > P99_RATIO:
        measurements.append(_measure(server, abusers, target))
    report = "; then ".join(map(str, measurements))
    print(f"\n{'+'.join(target.kinds)}: {report}")
    assert measurements[-1].ratio <= P99_RATIO, report
    return measurements


def test_abusive_clients_do_not_slow_normal_ones(server: LiveServer,
                                                 abusers: AbusiveClients) -> None:
    _compare(server, abusers, Target(server.url, ("template", "body", "surrogate")))


def test_costly_grammar_clients_do_not_slow_normal_ones(server: LiveServer,
                                                        abusers: AbusiveClients) -> None:
    _compare(server, abusers, Target(server.url, ("grammar",)))


def test_costly_patterns_after_cheap_masks_do_not_slow_normal_ones(
        server: LiveServer, abusers: AbusiveClients) -> None:
    _compare(server, abusers, Target(server.url, ("later",)))


def test_abusive_tenants_do_not_slow_normal_ones(tenants: LiveServer,
                                                 abusers: AbusiveClients) -> None:
    """Issue 44's tenants beside the normal clients' key: a key past its quota of idle
    awaiting sessions (429s), idle and half-sent connections (closed by the read timeouts),
    deep JSON (400s), tiny tool-output chunks without whitespace (200s). Their sessions stay
    held: the flooding key's refusals are all counted, and it holds exactly its quota."""
    measurements = _compare(tenants, abusers, _tenant_target(tenants))
    flood = owner_of({"authorization": FLOOD_KEY["Authorization"]})
    refused = BURST + sum(m.sent["flood"] for m in measurements)
    assert tenants.metric("edmm_key_quota_refusals_total", key=flood,
                          quota="awaiting") == refused
    assert tenants.metric("edmm_key_awaiting_sessions", key=flood) == MAX_AWAITING
