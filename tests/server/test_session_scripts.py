"""Random HTTP session scripts against the real app: one session registry, one KV manager.

Hypothesis draws scripts of client actions over a few conversations (a turn ending in a forced
tool call, with or without the session header; the resume carrying its results, found by the
call ids or the header; streamed partial tool output; a client that walks away and lets the
tool deadline abandon the session; a client that hangs up mid-stream; ``DELETE``). After every
action the engine thread checks every owner (`AgentEngine.check_integrity`: sessions against the
KV manager's tagged entries and the scheduler's speculation, then the prefix index, the arena
and the pool); at the end every session the client learned of is closed, the registry is empty
and, within 1 s and without any request, ``/metrics`` shows as many pages in use as before the
script.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import MODEL, QUESTION, WEATHER, LiveServer, serve, server_config
from tiers import examples

from edmm.server import ServerState

RECLAIM_PROBES = 20  # pages back within this many /metrics round trips (at least 1 s)
TOOL_TIMEOUT_S = 1.5  # short: a client that walks away gets its session abandoned in-script
ACTIONS = ("call", "call_named", "resume", "resume_named", "tool_output", "walk_away",
           "disconnect", "close")


@pytest.fixture(scope="module", params=[True, False], ids=["agent", "plain"])
def server(request: pytest.FixtureRequest, tiny_dir: Path) -> Iterator[LiveServer]:
    """A server of this module, EDMM on and off, with a short tool deadline."""
    config = server_config(tiny_dir, execution_aware=request.param)
    config.tool_timeout_s = TOOL_TIMEOUT_S
    yield from serve(ServerState(config))


@dataclass
class _Conversation:
    """What the client knows of one conversation."""

    topic: int
    messages: list[dict[str, Any]] = field(default_factory=list)
    session_id: str | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)  # the pending tool calls


class _Client:
    """Runs script actions over HTTP; remembers every session id the server named."""

    def __init__(self, server: LiveServer) -> None:
        self.server = server
        self.http = httpx.Client(base_url=server.url, timeout=60)
        self.seen: set[str] = set()

    def act(self, action: str, conv: _Conversation) -> None:
        if action in ("call", "call_named"):
            self._call(conv, named=action == "call_named")
        elif action in ("resume", "resume_named") and conv.calls:
            self._resume(conv, named=action == "resume_named")
        elif action == "tool_output" and conv.calls and conv.session_id:
            self.http.post(f"/v1/edmm/sessions/{conv.session_id}/tool_output",
                           json={"tool_call_id": conv.calls[0]["id"], "content": "{\"te"})
        elif action == "walk_away":
            conv.messages, conv.calls, conv.session_id = [], [], None
        elif action == "disconnect":
            self._disconnect(conv)
        elif action == "close" and conv.session_id:
            status = self.http.delete(f"/v1/edmm/sessions/{conv.session_id}").status_code
            assert status in (200, 404, 409)  # 404: abandoned and replaced; 409: busy
            if status == 200:
                conv.messages, conv.calls, conv.session_id = [], [], None

    def _body(self, conv: _Conversation, **extra: Any) -> dict[str, Any]:
        if not conv.messages:
            conv.messages = [QUESTION[0], {"role": "user",
                                           "content": f"Weather question {conv.topic}?"}]
        return {"model": MODEL, "messages": conv.messages, "tools": [WEATHER],
                "temperature": 0, "max_tokens": 40, **extra}

    def _headers(self, conv: _Conversation, named: bool) -> dict[str, str]:
        return {"X-Session-Id": conv.session_id} if named and conv.session_id else {}

    def _post(self, conv: _Conversation, body: dict[str, Any], named: bool) -> dict[str, Any]:
        resp = self.http.post("/v1/chat/completions", json=body,
                              headers=self._headers(conv, named))
        if resp.status_code == 409:  # the named session is still generating (a hang-up)
            return {}
        assert resp.status_code == 200, resp.text
        conv.session_id = resp.headers["x-session-id"]
        self.seen.add(conv.session_id)
        return dict(resp.json()["choices"][0]["message"])

    def _call(self, conv: _Conversation, named: bool) -> None:
        message = self._post(conv, self._body(conv, tool_choice="required",
                                              parallel_tool_calls=False), named)
        if message:
            assert message["tool_calls"]
            conv.messages.append({k: v for k, v in message.items() if v is not None})
            conv.calls = message["tool_calls"]

    def _resume(self, conv: _Conversation, named: bool) -> None:
        conv.messages += [{"role": "tool", "tool_call_id": c["id"],
                           "content": json.dumps({"temp": 20 + conv.topic})}
                          for c in conv.calls]
        message = self._post(conv, self._body(conv, tool_choice="none", max_tokens=3), named)
        conv.calls = []
        if message:
            conv.messages.append({"role": "assistant", "content": message["content"] or ""})
            conv.messages.append({"role": "user", "content": "And tomorrow?"})
        else:
            conv.messages, conv.session_id = [], None

    def _disconnect(self, conv: _Conversation) -> None:
        body = self._body(conv, stream=True, max_tokens=200)
        with self.http.stream("POST", "/v1/chat/completions", json=body,
                              headers=self._headers(conv, True)) as resp:
            if resp.status_code != 200:
                return
            self.seen.add(resp.headers["x-session-id"])
            lines = resp.iter_lines()
            next(lines)  # the first event, then hang up
        conv.messages, conv.calls, conv.session_id = [], [], None


def _check(sessions: Any) -> None:
    """Every owner's invariants, on the engine thread (sessions, KV manager, index, pool)."""
    sessions.agent.check_integrity()


def _wait_idle(server: LiveServer, timeout: float = 30.0) -> None:
    """No request or speculation left (aborts of hung-up streams included)."""
    deadline = time.monotonic() + timeout
    while server.state.loop.call(lambda b: b.has_unfinished()).result(10):
        assert time.monotonic() < deadline, "the engine never went idle"
        time.sleep(0.02)


def _close_all(server: LiveServer, client: _Client, baseline: float) -> None:
    """Close every session the client learned of; the registry must be empty after, and
    within 1 s (or `RECLAIM_PROBES` ``/metrics`` round trips, on a loaded machine) ``/metrics``
    shows the pages in use of the idle server before the script (slots retired by commits,
    losing branches and every session's KV are freed without a request)."""
    _wait_idle(server)
    for session_id in client.seen:
        assert client.http.delete(f"/v1/edmm/sessions/{session_id}").status_code in (200, 404)
    t0 = time.monotonic()
    pages = server.metric("edmm_kv_pages_in_use")
    deadline = time.monotonic() + max(1.0, RECLAIM_PROBES * (time.monotonic() - t0))
    while pages != baseline:
        assert time.monotonic() < deadline, f"{pages} pages in use, idle baseline {baseline}"
        time.sleep(0.02)
        pages = server.metric("edmm_kv_pages_in_use")

    def leftovers(sessions: Any) -> list[str]:
        sessions.agent.check_integrity()  # no KV tagged for a closed session
        return sessions.agent.session_ids()

    assert server.state.loop.call(leftovers).result(10) == []


SCRIPTS = st.lists(st.tuples(st.sampled_from(ACTIONS), st.integers(0, 2)), min_size=1,
                   max_size=8)


@settings(max_examples=examples(6), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=SCRIPTS)
def test_random_session_scripts_keep_every_owner_consistent(
        server: LiveServer, script: list[tuple[str, int]]) -> None:
    baseline = server.metric("edmm_kv_pages_in_use")
    client = _Client(server)
    conversations = [_Conversation(topic) for topic in range(3)]
    try:
        for action, k in script:
            client.act(action, conversations[k])
            server.state.loop.call(_check).result(10)
    finally:
        _close_all(server, client, baseline)
        client.http.close()
