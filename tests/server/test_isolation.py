"""Issue 16, items 2 and 7: streamed tool output is folded, capped and closed by ``final``, and
sessions belong to the client that made them (no take-over by prefix, 404 across owners)."""

from __future__ import annotations

import dataclasses
import re
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import MODEL, QUESTION, WEATHER, LiveServer, serve, server_config

from edmm.server import ServerState

CHUNK_LIMIT = 3 << 20  # bytes of one tool_output chunk this module's server accepts
BIG_CHUNK = 2 << 20
CHUNK_RATIO = 8.0  # a chunk's fold / the same body refused for an unknown session (parse only)
BYSTANDER_RATIO = 10.0  # a bystander's latency while chunks fold / its latency alone
KEY_A = {"Authorization": "Bearer key-a"}
KEY_B = {"Authorization": "Bearer key-b"}


@pytest.fixture(scope="module")
def server(tiny_dir: Path) -> Iterator[LiveServer]:
    config = dataclasses.replace(server_config(tiny_dir), max_body_bytes=16 << 20,
                                 max_tool_output_bytes=CHUNK_LIMIT)
    yield from serve(ServerState(config))


def _call(server: LiveServer, headers: dict[str, str] | None = None,
          messages: list[dict[str, Any]] | None = None) -> tuple[str, dict[str, Any]]:
    """A turn that ends in a forced weather call: (session id, assistant message)."""
    resp = httpx.post(f"{server.url}/v1/chat/completions", headers=headers, timeout=60, json={
        "model": MODEL, "messages": messages or QUESTION, "tools": [WEATHER],
        "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0,
        "max_tokens": 64})
    assert resp.status_code == 200, resp.text
    message = resp.json()["choices"][0]["message"]
    assert message["tool_calls"]
    return resp.headers["x-session-id"], message


def _session(server: LiveServer, sid: str, headers: dict[str, str] | None = None,
             method: str = "GET") -> httpx.Response:
    return httpx.request(method, f"{server.url}/v1/edmm/sessions/{sid}", headers=headers,
                         timeout=30)


def _feed(server: LiveServer, sid: str, call_id: str, content: str, final: bool = False,
          headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/edmm/sessions/{sid}/tool_output", headers=headers,
                      json={"tool_call_id": call_id, "content": content, "final": final},
                      timeout=60)


def _bystander(server: LiveServer) -> float:
    """Seconds a 2-token completion takes."""
    t0 = time.monotonic()
    resp = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert resp.status_code == 200, resp.text
    return time.monotonic() - t0


# ---------------------------------------------------------------------- item 2: tool output
def test_big_chunks_are_folded_without_stalling_anyone(server: LiveServer) -> None:
    """Four 2 MB chunks: each answered fast (only the new text is tokenized, up to the
    context): within `CHUNK_RATIO` times the time the same body takes to be refused for an
    unknown session (read and parsed only); and a bystander's small request meanwhile takes
    at most `BYSTANDER_RATIO` times as long as alone just before (medians of three: the
    machine's load scales both sides of each ratio)."""
    sid, message = _call(server)
    call_id = message["tool_calls"][0]["id"]
    chunk = "lorem ipsum dolor sit amet " * (BIG_CHUNK // 27)
    parsed: list[float] = []
    for _ in range(3):
        t0 = time.monotonic()
        assert _feed(server, "no-such-session", call_id, chunk).status_code == 404
        parsed.append(time.monotonic() - t0)
    alone = statistics.median(_bystander(server) for _ in range(3))
    seconds: list[float] = []
    waits: list[float] = []

    def bystanders(stop: threading.Event) -> None:
        while not stop.is_set():
            waits.append(_bystander(server))

    stop = threading.Event()
    side = threading.Thread(target=bystanders, args=(stop,))
    side.start()
    try:
        for _ in range(4):
            t0 = time.monotonic()
            resp = _feed(server, sid, call_id, chunk)
            seconds.append(time.monotonic() - t0)
            assert resp.status_code == 200, resp.text
    finally:
        stop.set()
        side.join()
    parsed_s = statistics.median(parsed)  # a fold: 2-4x; all tokenized: 2.4 / 4.8 / 6.6 / 8.9 s
    assert max(seconds) < CHUNK_RATIO * parsed_s, (seconds, parsed_s)
    assert waits and max(waits) < BYSTANDER_RATIO * alone, (waits, alone)
    assert _session(server, sid, method="DELETE").status_code == 200


def test_a_chunk_over_the_limit_is_413(server: LiveServer) -> None:
    sid, message = _call(server)
    resp = _feed(server, sid, message["tool_calls"][0]["id"], "x" * (CHUNK_LIMIT + 1))
    assert resp.status_code == 413, resp.text
    error = resp.json()["error"]
    assert error["param"] == "content" and error["code"] == "tool_output_too_large"
    assert _session(server, sid, method="DELETE").status_code == 200


def test_final_closes_the_output(server: LiveServer) -> None:
    """After a chunk marked final, more output for the call is a 409; the resume works."""
    sid, message = _call(server)
    call = message["tool_calls"][0]
    assert _feed(server, sid, call["id"], '{"temp": ').status_code == 200
    assert _feed(server, sid, call["id"], "21}", final=True).status_code == 200
    late = _feed(server, sid, call["id"], " more")
    assert late.status_code == 409, late.text
    assert late.json()["error"]["code"] == "tool_output_closed"
    messages = [*QUESTION, message, {"role": "tool", "tool_call_id": call["id"],
                                     "content": '{"temp": 21}'}]
    resp = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": messages, "tools": [WEATHER], "max_tokens": 3})
    assert resp.status_code == 200 and resp.headers["x-session-id"] == sid
    assert _session(server, sid, method="DELETE").status_code == 200


# ---------------------------------------------------------------------- item 7: isolation
@pytest.mark.parametrize("other", [None, KEY_B], ids=["anonymous", "other-key"])
def test_an_identical_first_prompt_does_not_take_an_awaiting_session(
        server: LiveServer, other: dict[str, str] | None) -> None:
    mine = KEY_A if other is not None else None
    sid, _ = _call(server, mine)
    theirs, _ = _call(server, other)
    assert theirs != sid
    state = _session(server, sid, mine)
    assert state.status_code == 200 and state.json()["state"] == "awaiting_tool"
    for s, h in ((sid, mine), (theirs, other)):
        assert _session(server, s, h, method="DELETE").status_code == 200


def test_another_owners_session_is_not_found(server: LiveServer) -> None:
    sid, message = _call(server, KEY_A)
    call_id = message["tool_calls"][0]["id"]
    assert re.fullmatch(r"sess-[0-9a-f]{32}", sid)  # server-made, unguessable
    for headers in (KEY_B, None):
        assert _session(server, sid, headers).status_code == 404
        assert _session(server, sid, headers, method="DELETE").status_code == 404
        assert _feed(server, sid, call_id, "x", headers=headers).status_code == 404
        named = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                           headers={**(headers or {}), "X-Session-Id": sid},
                           json={"model": MODEL, "messages": QUESTION, "max_tokens": 2})
        assert named.status_code == 404, named.text
    assert _feed(server, sid, call_id, "x", headers=KEY_A).status_code == 200
    assert _session(server, sid, KEY_A).json()["state"] == "awaiting_tool"
    assert _session(server, sid, KEY_A, method="DELETE").status_code == 200


def test_tool_results_resume_only_their_owners_session(server: LiveServer) -> None:
    sid, message = _call(server, KEY_A)
    messages = [*QUESTION, message, *({"role": "tool", "tool_call_id": c["id"], "content": "21"}
                                      for c in message["tool_calls"])]
    resp = httpx.post(f"{server.url}/v1/chat/completions", headers=KEY_B, timeout=60,
                      json={"model": MODEL, "messages": messages, "max_tokens": 2})
    assert resp.status_code == 200 and resp.headers["x-session-id"] != sid
    assert _session(server, sid, KEY_A).json()["state"] == "awaiting_tool"
    resp = httpx.post(f"{server.url}/v1/chat/completions", headers=KEY_A, timeout=60,
                      json={"model": MODEL, "messages": messages, "max_tokens": 2})
    assert resp.status_code == 200 and resp.headers["x-session-id"] == sid
    for s, h in ((sid, KEY_A), (resp.headers["x-session-id"], KEY_A)):
        _session(server, s, h, method="DELETE")


def test_a_client_named_session_is_bound_to_its_owner(server: LiveServer) -> None:
    resp = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                      headers={**KEY_B, "X-Session-Id": "my-own-name"},
                      json={"model": MODEL, "messages": QUESTION, "max_tokens": 2})
    assert resp.status_code == 200 and resp.headers["x-session-id"] == "my-own-name"
    assert _session(server, "my-own-name", KEY_A).status_code == 404
    assert _session(server, "my-own-name", KEY_B).status_code == 200
    assert _session(server, "my-own-name", KEY_B, method="DELETE").status_code == 200


# ---------------------------------------------------------------------- item 7: cache salt
LONG_PROMPT = " ".join(f"fact {i} of the shared system prompt." for i in range(60))


def _cached(server: LiveServer, headers: dict[str, str] | None = None, **extra: Any) -> int:
    resp = httpx.post(f"{server.url}/v1/completions", headers=headers, timeout=60, json={
        "model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 1, "temperature": 0, **extra})
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    assert usage["prompt_tokens"] > 100
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def test_cache_salt_scopes_prefix_sharing(server: LiveServer) -> None:
    salt = f"tenant-{time.monotonic_ns()}"  # fresh: nothing cached under it yet
    assert _cached(server, cache_salt=salt) == 0
    assert _cached(server, cache_salt=salt) > 0  # the same salt shares
    assert _cached(server, cache_salt=salt + "-other") == 0
    assert _cached(server) == 0  # unsalted requests see no salted KV


@pytest.fixture(scope="module")
def salted(tiny_dir: Path) -> Iterator[LiveServer]:
    config = dataclasses.replace(server_config(tiny_dir), cache_salt_per_key=True)
    yield from serve(ServerState(config))


def test_cache_salt_per_key_hides_hits_across_clients(salted: LiveServer) -> None:
    assert _cached(salted, KEY_A) == 0
    assert _cached(salted, KEY_A) > 0  # the same client shares its own prefixes
    assert _cached(salted, KEY_B) == 0  # another client learns nothing from cached_tokens
    assert _cached(salted) == 0  # nor does an anonymous one
    assert _cached(salted, KEY_A, cache_salt="x") == 0  # a client's salt scopes further
