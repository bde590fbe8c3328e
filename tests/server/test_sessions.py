"""Execution-aware sessions over HTTP: awaiting tool, resume, extensions, partial output."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import httpx
import openai
import pytest
from server_helpers import AUTH, MODEL, QUESTION, TOOLS, WEATHER, LiveServer, agent_id

RESULT = json.dumps({"temp": 21, "sky": "sunny"})


@pytest.fixture
def server(fresh_server: LiveServer) -> LiveServer:
    """This module's own server: speculation competes with no other test's sessions."""
    return fresh_server


@pytest.fixture
def client(server: LiveServer) -> openai.OpenAI:
    """A client of this module's server."""
    return server.client()


def _state(server: LiveServer, session_id: str) -> str:
    resp = httpx.get(f"{server.url}/v1/edmm/sessions/{session_id}", headers=AUTH)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["state"])


def _call(client: openai.OpenAI, **extra: Any) -> tuple[str, Any, Any]:
    """A forced weather call: (session id, assistant message, usage)."""
    resp = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=QUESTION, tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=100, **extra)
    out = resp.parse()
    assert out.choices[0].finish_reason == "tool_calls"
    return resp.headers["x-session-id"], out.choices[0].message, out.usage


def _resume(client: openai.OpenAI, message: Any, result: str = RESULT,
            **extra: Any) -> tuple[str, Any]:
    messages = [*QUESTION, message.model_dump(exclude_none=True),
                *[{"role": "tool", "tool_call_id": c.id, "content": result}
                  for c in message.tool_calls]]
    resp = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, tools=[WEATHER], temperature=0, max_tokens=4, **extra)
    return resp.headers["x-session-id"], resp.parse().usage


def _wait_speculation(server: LiveServer, timeout: float = 10.0) -> None:
    """Let the tool window's speculative prefill run (the engine runs it in the background)."""
    deadline = time.monotonic() + timeout
    if not server.state.execution_aware:
        return
    while server.state.loop.call(lambda b: b.has_unfinished()).result():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_tool_call_awaits_and_results_resume(server: LiveServer,
                                             client: openai.OpenAI) -> None:
    resumes = server.metric("edmm_session_resumes_total")
    session_id, message, first = _call(client)
    assert _state(server, session_id) == "awaiting_tool"
    _wait_speculation(server)
    resumed_id, usage = _resume(client, message)  # no header: found by its tool call ids
    assert resumed_id == session_id
    assert _state(server, session_id) == "finished"
    assert server.metric("edmm_session_resumes_total") == resumes + 1
    assert usage.prompt_tokens_details.cached_tokens >= first.prompt_tokens - 1
    assert server.metric("edmm_prefix_hit_tokens_total") > 0


def test_speculation_prefills_the_next_prompt(server: LiveServer,
                                              client: openai.OpenAI) -> None:
    if not server.state.execution_aware:
        pytest.skip("needs the agent layer")
    outcomes = sum(server.metric("edmm_speculation_outcomes_total", outcome=o)
                   for o in ("hit", "partial", "miss"))
    result = json.dumps({"temp": 21, "nonce": uuid.uuid4().hex})  # never seen before
    _, message, _ = _call(client, extra_body={"edmm": {
        "predicted_tool_results": {"get_weather": result}, "expected_tool_duration_s": 0.5}})
    _wait_speculation(server)
    _, usage = _resume(client, message, result)
    # The predicted result was exact: the whole prompt but its last token was prefilled.
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    after = sum(server.metric("edmm_speculation_outcomes_total", outcome=o)
                for o in ("hit", "partial", "miss"))
    assert after == outcomes + 1
    assert server.metric("edmm_speculation_outcomes_total", outcome="hit") >= 1
    assert server.metric("edmm_speculated_tokens_total") > 0


def test_partial_tool_output(server: LiveServer, client: openai.OpenAI) -> None:
    result = json.dumps({"temp": 21, "nonce": uuid.uuid4().hex})  # never seen before
    session_id, message, _ = _call(client)
    call_id = message.tool_calls[0].id
    url = f"{server.url}/v1/edmm/sessions/{session_id}/tool_output"
    for chunk in (result[:10], result[10:]):
        resp = httpx.post(url, headers=AUTH, json={"tool_call_id": call_id, "content": chunk})
        assert resp.status_code == 200, resp.text
    unknown = httpx.post(url, headers=AUTH, json={"tool_call_id": "call_nope", "content": "x"})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "tool_call_id"
    nobody = httpx.post(f"{server.url}/v1/edmm/sessions/nobody/tool_output", headers=AUTH,
                        json={"tool_call_id": call_id, "content": "x"})
    assert nobody.status_code == 404
    bad = httpx.post(url, headers=AUTH, json={"content": "x"})
    assert bad.status_code == 400
    _wait_speculation(server)
    resumed_id, usage = _resume(client, message, result)
    assert resumed_id == session_id
    if server.state.execution_aware:  # the streamed output was prefilled during the window
        assert usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 16
    late = httpx.post(url, headers=AUTH, json={"tool_call_id": call_id, "content": "x"})
    assert late.status_code == 404  # the call is no longer pending


def test_explicit_session_and_prefix_lookup(server: LiveServer, client: openai.OpenAI) -> None:
    first = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=6,
        extra_headers={"X-Session-Id": "my-session"})
    assert first.headers["x-session-id"] == "my-session"
    reply = first.parse().choices[0].message.content or ""
    follow = [*QUESTION, {"role": "assistant", "content": reply},
              {"role": "user", "content": "And tomorrow?"}]
    second = client.chat.completions.with_raw_response.create(  # no header: by prefix
        model=MODEL, messages=follow, temperature=0, max_tokens=4)
    assert second.headers["x-session-id"] == "my-session"
    assert second.parse().usage.prompt_tokens_details.cached_tokens > 0
    by_body = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=2,
        extra_body={"edmm": {"session_id": "body-session"}})
    assert by_body.headers["x-session-id"] == "body-session"
    assert _state(server, "body-session") == "finished"
    assert httpx.get(f"{server.url}/v1/edmm/sessions/unknown", headers=AUTH).status_code == 404


def _held(server: LiveServer, session_id: str) -> bool:
    """Whether the session's KV is held above plain cache entries (retained)."""
    from edmm.agent import SessionTag
    from edmm.engine import EntryRank

    def held(b: Any) -> bool:
        kv = b.engine.kv
        slots = kv.tagged(SessionTag.session(agent_id(session_id)))
        plain = set(kv.entry_slots(max_rank=EntryRank.PLAIN))
        return bool(slots) and not set(slots) <= plain

    return bool(server.state.loop.call(held).result(10))


@pytest.mark.parametrize("stream", [False, True])
def test_a_turn_without_tool_calls_releases_its_hold(server: LiveServer,
                                                     client: openai.OpenAI,
                                                     stream: bool) -> None:
    """The agent layer holds a finished turn's KV until the server reports how it ended
    (`AgentConfig.report_window_s`): with tool calls it stays held (awaiting them), without
    it becomes a plain cache entry right after the reply, not a window later."""
    if not server.state.execution_aware:
        pytest.skip("needs the agent layer")
    sid = f"plain-{stream}"
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=4, stream=stream,
        extra_headers={"X-Session-Id": sid})
    if stream:
        for _ in reply:  # type: ignore[attr-defined]
            pass
    deadline = time.monotonic() + 10
    while _held(server, sid):  # the release is queued after the reply, not awaited
        assert time.monotonic() < deadline, "the finished turn stayed held"
        time.sleep(0.01)
    assert _state(server, sid) == "finished"
    called, _, _ = _call(client)
    assert _state(server, called) == "awaiting_tool" and _held(server, called)


def test_sessions_by_state_metric(server: LiveServer, client: openai.OpenAI) -> None:
    before = server.metric("edmm_sessions", state="awaiting_tool")
    _call(client)
    assert server.metric("edmm_sessions", state="awaiting_tool") == before + 1
    assert server.metric("edmm_kv_pages_in_use") > 0
    assert server.metric("edmm_kv_pages_total") >= server.metric("edmm_kv_pages_in_use")


def test_bad_extension_is_400(server: LiveServer) -> None:
    body = {"model": MODEL, "messages": QUESTION, "tools": TOOLS,
            "edmm": {"expected_tool_duration_s": -1}}
    resp = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, json=body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "edmm"
    # an unknown field is ignored here as anywhere in a request (vLLM's rule)
    body["edmm"] = {"unknown_hint": 1}
    body["max_tokens"] = 2
    resp = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, json=body, timeout=30)
    assert resp.status_code == 200, resp.text


def test_close_session_releases_it(server: LiveServer, client: openai.OpenAI) -> None:
    session_id, message, _ = _call(client)
    url = f"{server.url}/v1/edmm/sessions/{session_id}"
    assert httpx.delete(url, headers=AUTH).json() == {"id": session_id, "object": "edmm.session",
                                        "deleted": True}
    assert httpx.get(url, headers=AUTH).status_code == 404
    assert httpx.delete(url, headers=AUTH).status_code == 404
    resumed_id, _ = _resume(client, message)  # the conversation goes on in a new session
    assert resumed_id != session_id
    server.state.loop.call(lambda b: b.engine.check_integrity()).result(10)


def test_recomputed_tokens_count_a_lost_context(server: LiveServer,
                                                client: openai.OpenAI) -> None:
    if server.state.execution_aware:
        pytest.skip("the agent layer owns its retained KV; dropping it is a plain-engine test")
    before = server.metric("edmm_recomputed_tokens_total")
    _, message, first = _call(client)
    server.state.loop.call(lambda b: b.engine.reset_prefix_cache()).result(10)  # evicted
    _, usage = _resume(client, message)
    assert usage.prompt_tokens_details.cached_tokens == 0
    recomputed = server.metric("edmm_recomputed_tokens_total") - before
    assert recomputed >= first.prompt_tokens  # the whole first turn was computed again


def _with_memory(result: str) -> list[dict[str, Any]]:
    """QUESTION with ``result`` inserted mid-prompt, as a memory block in the user message."""
    system, user = QUESTION
    return [system, {**user, "content": f"{user['content']}\n\n<memory>\n{result}\n</memory>"}]


def _resume_mid_prompt(client: openai.OpenAI, message: Any, result: str) -> Any:
    """The resume with ``result`` in the memory block (the tool message only points to it)."""
    messages = [*_with_memory(result), message.model_dump(exclude_none=True),
                *[{"role": "tool", "tool_call_id": c.id, "content": "Stored in <memory>."}
                  for c in message.tool_calls]]
    return client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none", temperature=0,
        max_tokens=6, extra_body={"ignore_eos": True})


def _predict_mid_prompt(result: str) -> dict[str, Any]:
    """``extra_body`` predicting `_resume_mid_prompt`'s messages (the reply left out)."""
    tool = {"role": "tool", "tool_call_id": "get_weather", "content": "Stored in <memory>."}
    return {"edmm": {"predicted_next_messages": [*_with_memory(result), tool]}}


def _outcomes(server: LiveServer) -> dict[str, float]:
    return {o: server.metric("edmm_speculation_outcomes_total", outcome=o)
            for o in ("hit", "partial", "miss")}


def test_predicted_next_messages_prefill_a_mid_prompt_result(server: LiveServer,
                                                             client: openai.OpenAI) -> None:
    if not server.state.execution_aware:
        pytest.skip("needs the agent layer")
    result = json.dumps({"temp": 21, "nonce": uuid.uuid4().hex})  # never seen before
    before = _outcomes(server)
    _, message, first = _call(client, extra_body=_predict_mid_prompt(result))
    _wait_speculation(server)
    usage = _resume_mid_prompt(client, message, result).usage
    # The result sits before the reply, yet only the last prompt token was prefilled at resume.
    assert usage.prompt_tokens > first.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    after = _outcomes(server)
    assert after["hit"] == before["hit"] + 1 and sum(after.values()) == sum(before.values()) + 1


def test_wrong_predicted_next_messages_change_no_output(server: LiveServer,
                                                        client: openai.OpenAI) -> None:
    result = json.dumps({"temp": 21, "nonce": uuid.uuid4().hex})
    replies, cached = [], []
    for extra in ({}, {"extra_body": _predict_mid_prompt("wrong " + result)},
                  {"extra_body": _predict_mid_prompt(result)}):
        server.state.loop.call(lambda b: b.engine.reset_prefix_cache()).result(10)  # no
        _, message, _ = _call(client, **extra)  # reuse of the previous iteration's resume
        _wait_speculation(server)
        resumed = _resume_mid_prompt(client, message, result)
        replies.append((message.tool_calls[0].function.arguments,
                        resumed.choices[0].message.content))
        cached.append(resumed.usage.prompt_tokens_details.cached_tokens)
    assert replies[0] == replies[1] == replies[2]  # greedy: identical, right or wrong
    if server.state.execution_aware:  # only the right prediction prefilled past the insertion
        assert cached[1] < cached[2] and cached[0] < cached[2]


@pytest.mark.parametrize("predicted", [
    "not a list",
    [{"role": "user", "content": "no tool message at the end"}],
    [{"role": "tool", "tool_call_id": "x", "content": "only tool messages"}],
    [{"role": "user", "content": "q"}, {"role": "tool", "content": "no tool_call_id"}],
    [{"role": "oracle", "content": "q"}, {"role": "tool", "tool_call_id": "x", "content": "r"}],
])
def test_malformed_predicted_next_messages_is_400(server: LiveServer, client: openai.OpenAI,
                                                  predicted: Any) -> None:
    session_id, message, _ = _call(client)  # a session awaiting its tool: nothing may be lost
    body = {"model": MODEL, "messages": QUESTION, "tools": TOOLS,
            "edmm": {"predicted_next_messages": predicted}}
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=body,
                      headers={**AUTH, "X-Session-Id": session_id})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "edmm"
    assert _state(server, session_id) == "awaiting_tool"
    resumed_id, usage = _resume(client, message)
    assert resumed_id == session_id and usage.prompt_tokens_details.cached_tokens > 0
