"""Fair to every client: quotas per API key (429 with Retry-After), one key's flood never
evicts another key's paused KV, per-key usage on /metrics, tool deadlines that expire on an
idle server, and sessions nobody can name closed."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import MODEL, QUESTION, WEATHER, LiveServer, serve, server_config

from edmm.agent import SessionTag
from edmm.server import ServerState
from edmm.server.sessions import owner_of, session_key

KEY_A = {"Authorization": "Bearer flooding-key"}
KEY_B = {"Authorization": "Bearer patient-key"}
OWNER_A = owner_of({"authorization": KEY_A["Authorization"]})
OWNER_B = owner_of({"authorization": KEY_B["Authorization"]})
MAX_AWAITING = 8
NUM_PAGES = 60  # ~6 forced-call sessions of the tiny model (32 tokens a page)
DEADLINE_S = 6.0


@pytest.fixture(scope="module")
def tenants(tiny_dir: Path) -> Iterator[LiveServer]:
    config = server_config(tiny_dir)
    config = dataclasses.replace(config, max_awaiting_per_key=MAX_AWAITING,
                                 engine={**config.engine, "num_pages": NUM_PAGES,
                                         "max_model_len": 1024})
    yield from serve(ServerState(config))


def _call(server: LiveServer, headers: dict[str, str],
          **extra: Any) -> httpx.Response:
    """A turn that ends in a forced weather call."""
    return httpx.post(f"{server.url}/v1/chat/completions", headers=headers, timeout=60, json={
        "model": MODEL, "messages": QUESTION, "tools": [WEATHER], "tool_choice": "required",
        "parallel_tool_calls": False, "temperature": 0, "max_tokens": 64, **extra})


def _has_kv(server: LiveServer, owner: str, sid: str) -> bool:
    tag = SessionTag.session(session_key(owner, sid))
    return bool(server.state.loop.call(lambda b: b.engine.kv.tagged(tag)).result(10))


@pytest.mark.slow  # a server, subprocess or seconds of waiting: the thorough tier
def test_a_flood_gets_429s_and_leaves_another_keys_paused_kv(tenants: LiveServer) -> None:
    """Key B pauses a session; key A opens forced-call sessions that never resume, more
    than memory holds: past its quota of awaiting sessions it gets 429s with Retry-After,
    and under the memory pressure it made its own sessions' KV goes, never B's (B's resume
    reuses its whole context)."""
    first = _call(tenants, KEY_B)
    assert first.status_code == 200, first.text
    sid = first.headers["x-session-id"]
    message = first.json()["choices"][0]["message"]
    statuses = []
    for _ in range(MAX_AWAITING + 4):
        resp = _call(tenants, KEY_A)
        statuses.append(resp.status_code)
        if resp.status_code == 429:
            error = resp.json()["error"]
            assert error["code"] == "quota_awaiting" and error["type"] == "rate_limit_error"
            assert 1 <= int(resp.headers["retry-after"]) <= 600
    assert statuses == [200] * MAX_AWAITING + [429] * 4
    assert tenants.metric("edmm_key_awaiting_sessions", key=OWNER_A) == MAX_AWAITING
    assert tenants.metric("edmm_key_quota_refusals_total", key=OWNER_A,
                          quota="awaiting") == 4
    assert tenants.metric("edmm_key_sessions", key=OWNER_B) == 1
    assert tenants.metric("edmm_key_kv_pages", key=OWNER_B) > 0
    assert _has_kv(tenants, OWNER_B, sid)
    messages = [*QUESTION, message, *({"role": "tool", "tool_call_id": c["id"], "content": "21"}
                                      for c in message["tool_calls"])]
    resumed = httpx.post(f"{tenants.url}/v1/chat/completions", headers=KEY_B, timeout=60,
                         json={"model": MODEL, "messages": messages, "tools": [WEATHER],
                               "max_tokens": 2, "temperature": 0})
    assert resumed.status_code == 200 and resumed.headers["x-session-id"] == sid
    usage = first.json()["usage"]
    context = usage["prompt_tokens"] + usage["completion_tokens"]
    assert resumed.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= context - 1
    # a plain turn (no tools: it cannot end awaiting) still goes through for A
    plain = httpx.post(f"{tenants.url}/v1/chat/completions", headers=KEY_A, timeout=60,
                       json={"model": MODEL, "messages": QUESTION, "max_tokens": 2})
    assert plain.status_code == 200, plain.text


@pytest.fixture(scope="module")
def deadlines(tiny_dir: Path) -> Iterator[LiveServer]:
    config = dataclasses.replace(server_config(tiny_dir), tool_timeout_s=DEADLINE_S)
    yield from serve(ServerState(config))


def _scrape(server: LiveServer) -> dict[str, float]:
    """One scrape of /metrics: sessions by state (``state``) and ``pages``, KV pages in use."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        if line.startswith("edmm_sessions{"):
            values[line.split('state="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("edmm_kv_pages_in_use{"):
            values["pages"] = float(line.rsplit(" ", 1)[1])
    return values


@pytest.mark.slow  # a server, subprocess or seconds of waiting: the thorough tier
def test_deadlines_expire_on_an_idle_server(deadlines: LiveServer) -> None:
    """20 sessions awaiting tools, then no request at all: within a second of the last
    deadline every one is abandoned and its pages are back (read in one scrape, whose
    snapshot is taken before the engine thread could run anything the scrape woke it for)."""
    baseline = _scrape(deadlines)["pages"]
    with ThreadPoolExecutor(20) as pool:
        replies = list(pool.map(lambda _: _call(deadlines, KEY_A), range(20)))
    last = time.monotonic()
    assert [r.status_code for r in replies] == [200] * 20
    assert {r.json()["choices"][0]["finish_reason"] for r in replies} == {"tool_calls"}
    # 20 sessions: a request never takes a session whose identical turn is still ending
    assert len({r.headers["x-session-id"] for r in replies}) == 20
    now = _scrape(deadlines)  # the first replies' deadlines may have run out on a slow machine
    assert now["awaiting_tool"] >= 1 and now["awaiting_tool"] + now["abandoned"] == 20
    time.sleep(max(0.0, last + DEADLINE_S + 1.0 - time.monotonic()))
    after = _scrape(deadlines)
    assert after["awaiting_tool"] == 0 and after["abandoned"] == 20
    assert after["pages"] <= baseline


def test_a_session_whose_name_never_reached_its_client_is_closed(
        deadlines: LiveServer) -> None:
    """A non-streamed request whose client leaves before the response: the session it made
    under a server-made name (which nobody can know) is closed; a named one stays."""
    def sessions() -> list[str]:
        return list(deadlines.state.loop.call(lambda b: b.agent.session_ids()).result(10))

    before = set(sessions())
    for headers in ({}, {"X-Session-Id": "known-name"}):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{deadlines.url}/v1/chat/completions", headers={**KEY_B, **headers},
                       timeout=0.3, json={"model": MODEL, "messages": QUESTION,
                                          "max_tokens": 1500, "ignore_eos": True})
    deadline = time.monotonic() + 10
    while (left := set(sessions()) - before) != {session_key(OWNER_B, "known-name")}:
        assert time.monotonic() < deadline, left
        time.sleep(0.05)
