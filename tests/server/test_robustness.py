"""Clients that leave mid-request, and several clients at once."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from server_helpers import AUTH, MODEL, QUESTION, WEATHER, LiveServer

from edmm.server.chat_prompts import ChatPrompts
from edmm.server.sessions import ServerSessions
from edmm.server.turns import ChatTurns

USER = [{"role": "user", "content": "Tell me a long story about a robot."}]
LONG: dict[str, object] = {"model": MODEL, "messages": USER, "max_tokens": 1500,
                           "temperature": 0, "ignore_eos": True}


def _aborted(server: LiveServer) -> float:
    return server.metric("edmm_requests_finished_total", finish_reason="abort")


def test_stream_disconnect_frees_the_request(server: LiveServer) -> None:
    server.wait_idle()
    before = _aborted(server)
    with httpx.stream("POST", f"{server.url}/v1/chat/completions",
                      json={**LONG, "stream": True}, timeout=30) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few events, then hang up
        assert any(line.startswith("data: ") for line in got)
    server.wait_idle(timeout=10)
    assert _aborted(server) == before + 1
    server.state.engine.check_integrity()


def test_non_streamed_disconnect_frees_the_request(server: LiveServer) -> None:
    server.wait_idle()
    before = _aborted(server)
    with httpx.Client(timeout=0.5) as client:
        try:
            client.post(f"{server.url}/v1/chat/completions", json=LONG)
        except httpx.ReadTimeout:
            pass  # the client gave up and closed its connection
        else:
            raise AssertionError("the long request finished before the client left")
    server.wait_idle(timeout=10)
    assert _aborted(server) == before + 1


def test_concurrent_clients(server: LiveServer) -> None:
    def one(i: int) -> tuple[int, str]:
        client = server.client()
        if i % 3 == 0:
            stream = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Question {i}?"}],
                max_tokens=16, temperature=0, stream=True)
            return i, "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        if i % 3 == 1:
            out = client.completions.create(model=MODEL, prompt=f"Story {i}:", max_tokens=16,
                                            temperature=0.7, seed=i)
            return i, out.choices[0].text
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Question {i}?"}],
            max_tokens=16, temperature=0)
        return i, chat.choices[0].message.content or ""

    with ThreadPoolExecutor(max_workers=12) as pool:
        results = dict(pool.map(one, range(24)))
    assert sorted(results) == list(range(24))
    # Batched runs give the batch-independent answers: a greedy request alone matches.
    alone = one(2)[1]
    assert results[2] == alone
    server.wait_idle()


def test_same_conversation_from_two_clients_at_once(server: LiveServer) -> None:
    """Two identical conversations in flight: they get two sessions, neither is refused."""
    barrier = threading.Barrier(2)

    def one(_: int) -> str:
        client = server.client()
        barrier.wait()
        resp = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=USER, max_tokens=24, temperature=0,
            extra_body={"ignore_eos": True})
        assert resp.parse().usage.completion_tokens == 24
        return resp.headers["x-session-id"]

    with ThreadPoolExecutor(max_workers=2) as pool:
        sessions = list(pool.map(one, range(2)))
    assert len(set(sessions)) == 2


def test_named_session_is_busy_while_generating(server: LiveServer) -> None:
    headers = {"X-Session-Id": "busy-session"}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", headers=headers,
                      json={**LONG, "stream": True}, timeout=30) as resp:
        lines = (line for line in resp.iter_lines() if line.startswith("data: {"))
        for _ in range(3):  # the role chunk, then content: the first turn is generating
            assert '"error"' not in next(lines)
        second = httpx.post(f"{server.url}/v1/chat/completions", headers=headers,
                            json={**LONG, "max_tokens": 2}, timeout=30)
        assert second.status_code == 409, second.text
        assert second.json()["error"]["code"] == "session_busy"
    server.wait_idle()
    free = httpx.post(f"{server.url}/v1/chat/completions", headers=headers,
                      json={**LONG, "max_tokens": 2}, timeout=30)
    assert free.status_code == 200 and free.headers["x-session-id"] == "busy-session"


def test_rendering_does_not_block_the_event_loop(server: LiveServer,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow chat rendering (a long conversation) runs on the tokenizing thread: meanwhile
    the server still answers other requests at once. The rendering is held until the other
    request is answered: had that one queued behind it, the rendering would have ended by its
    own timeout first."""
    original = ChatPrompts.render
    rendering = threading.Event()
    answered = threading.Event()
    held_until_answered: list[bool] = []

    def slow(*args: Any, **kwargs: Any) -> Any:
        rendering.set()
        held_until_answered.append(answered.wait(10))
        return original(*args, **kwargs)

    monkeypatch.setattr(ChatPrompts, "render", slow)
    body = {"model": MODEL, "messages": USER, "max_tokens": 2, "temperature": 0}
    with ThreadPoolExecutor(1) as pool:
        slow_reply = pool.submit(httpx.post, f"{server.url}/v1/chat/completions", json=body,
                                 timeout=30)
        assert rendering.wait(10)
        assert httpx.get(f"{server.url}/v1/models", timeout=30).status_code == 200
        answered.set()
        assert slow_reply.result().status_code == 200
    assert held_until_answered == [True]  # answered while the rendering was still running


def test_plain_chat_is_queued_by_the_tokenizing_thread(server: LiveServer,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A chat with no grammar goes from the tokenizing thread straight to the engine thread
    (`ChatTurns._made_and_sent`); a forced tool call goes back to the event loop first (its
    grammar compiles meanwhile). Both are answered."""
    threads: list[str] = []
    original = ChatTurns._made_and_sent

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ChatTurns, "_made_and_sent", spy)
    url = f"{server.url}/v1/chat/completions"
    body = {"model": MODEL, "messages": USER, "max_tokens": 2, "temperature": 0}
    assert httpx.post(url, json=body, timeout=30).status_code == 200
    assert len(threads) == 1 and threads[0].startswith("edmm-tokenize")
    tool = {"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}
    forced = {**body, "max_tokens": 30, "tools": [tool],
              "tool_choice": {"type": "function", "function": {"name": "f"}}}
    reply = httpx.post(url, json=forced, timeout=30)
    assert reply.status_code == 200, reply.text
    assert len(threads) == 1  # not the direct way


def test_a_predicted_next_request_is_rendered_and_ended_by_the_tokenizing_thread(
        server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A turn that ends in a tool call with a predicted next request: the tokenizing thread
    renders the prediction and sends the turn's end to the engine thread itself
    (`ChatTurns._predicted_and_sent`), and the response comes once the session awaits the
    call, with the prediction rendered."""
    if not server.state.execution_aware:
        pytest.skip("needs the agent layer")
    threads: list[str] = []
    ended: list[tuple[str, int]] = []  # (session, predicted prompt tokens) of each end
    original, end = ChatTurns._predicted_and_sent, ServerSessions.end

    def spy(self: Any, *args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return original(self, *args)

    def spy_end(self: Any, turn: Any) -> None:  # an earlier test's turn may end meanwhile
        ended.append((turn.session_id, len(turn.predicted_prompt)))
        end(self, turn)

    monkeypatch.setattr(ChatTurns, "_predicted_and_sent", spy)
    monkeypatch.setattr(ServerSessions, "end", spy_end)
    predicted = [*QUESTION, {"role": "tool", "tool_call_id": "get_weather", "content": "Sun."}]
    body = {"model": MODEL, "messages": QUESTION, "tools": [WEATHER], "tool_choice": "required",
            "parallel_tool_calls": False, "max_tokens": 100, "temperature": 0,
            "edmm": {"predicted_next_messages": predicted}}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=AUTH,
                       timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["finish_reason"] == "tool_calls"
    assert len(threads) == 1 and threads[0].startswith("edmm-tokenize")
    sid = reply.headers["x-session-id"]
    mine = [n for session, n in ended if session == sid]
    assert len(mine) == 1 and mine[0] > 0
    state = httpx.get(f"{server.url}/v1/edmm/sessions/{sid}", headers=AUTH, timeout=10)
    assert state.json()["state"] == "awaiting_tool"
