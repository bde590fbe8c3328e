"""The serving path renders an agent's resume incrementally, and falls back to full renders."""

from __future__ import annotations

from typing import Any

import httpx
from server_helpers import AUTH, MODEL, TOOLS, LiveServer

from edmm.server.incremental import RenderStats
from edmm.server.prompts import render_chat, template_tools
from edmm.server.protocol import ChatTool


def _conversation() -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful agent."}]
    for i in range(12):
        msgs += [{"role": "user", "content": f"Background note {i}: the sky is blue."},
                 {"role": "assistant", "content": "Noted."}]
    msgs.append({"role": "user", "content": "What is the weather in Paris today?"})
    return msgs


def _chat(server: LiveServer, messages: list[dict[str, Any]]) -> int:
    """Send a chat request; its prompt tokens."""
    body = {"model": MODEL, "messages": messages, "tools": TOOLS, "max_tokens": 1,
            "temperature": 0}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens"])


def _stats(server: LiveServer) -> RenderStats:
    pipeline = server.state.serving.pipeline
    return pipeline.tokenizing.submit(lambda: pipeline.prompts.stats).result()


def _full_tokens(server: LiveServer, messages: list[dict[str, Any]]) -> int:
    """Prompt tokens of a full render, with the tools as the server reads them."""
    tools = template_tools([ChatTool.model_validate(t) for t in TOOLS])
    return len(render_chat(server.state.engine.tokenizer, messages, tools, None))


def test_a_resume_takes_the_incremental_route(server: LiveServer) -> None:
    pipeline = server.state.serving.pipeline
    assert pipeline.tokenizing.submit(pipeline.prompts.prepare).result()
    convo = _conversation()
    assert _chat(server, convo) == _full_tokens(server, convo)
    before = _stats(server)
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_w", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    resume = [*convo, call, {"role": "tool", "tool_call_id": "call_w", "content": "Sunny."}]
    assert _chat(server, resume) == _full_tokens(server, resume)
    after = _stats(server)
    assert after.full_renders == before.full_renders  # no full render of the resume
    assert after.reused_messages - before.reused_messages == len(convo) - 2
    # Rendered: the system message and the query, then with the call and its result.
    assert after.rendered_messages - before.rendered_messages == (1 + 1) + (1 + 3)


def test_a_changed_prefix_falls_back_to_a_full_render(server: LiveServer) -> None:
    convo = _conversation()
    _chat(server, convo)
    before = _stats(server)
    changed = [dict(m) for m in convo]
    changed[0]["content"] = "You are a different agent."  # the header: nothing is shared
    changed.append({"role": "assistant", "content": "Let me check."})
    assert _chat(server, changed) == _full_tokens(server, changed)
    after = _stats(server)
    assert after.full_renders == before.full_renders + 1
    assert after.reused_messages == before.reused_messages


def test_a_resume_answering_the_calls_runs_no_template(server: LiveServer) -> None:
    """A turn that ends in a tool call prepares its resume while the tool runs: the resume
    that sends the reply back as the response gave it, with the result, is joined from the
    prepared pieces (no template runs, nothing rendered), with a full render's tokens."""
    convo = _conversation()
    body = {"model": MODEL, "messages": convo, "tools": TOOLS, "tool_choice": "required",
            "parallel_tool_calls": False, "max_tokens": 48, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    reply = r.json()["choices"][0]["message"]
    assert reply["tool_calls"]
    sid = r.headers["x-session-id"]
    # The preparation is queued on the tokenizing thread once the turn ended.
    server.state.serving.pipeline.tokenizing.submit(lambda: None).result()
    before = _stats(server)
    results = [{"role": "tool", "tool_call_id": c["id"], "content": " Sunny, 21 C.\n"}
               for c in reply["tool_calls"]]
    resume = [*convo, reply, *results]
    assert _chat(server, resume) == _full_tokens(server, resume)
    after = _stats(server)
    assert after.slot_renders == before.slot_renders + 1
    assert after.rendered_messages == before.rendered_messages
    assert after.full_renders == before.full_renders
    assert httpx.delete(f"{server.url}/v1/edmm/sessions/{sid}", headers=AUTH,
                        timeout=30).status_code == 200
