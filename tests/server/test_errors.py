"""Bad input: OpenAI-style error objects with the right status, and a server that carries on."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from server_helpers import MAX_MODEL_LEN, MODEL, LiveServer

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _post(server: LiveServer, path: str, body: Any) -> httpx.Response:
    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
    return httpx.post(f"{server.url}{path}", timeout=30, **kwargs)  # type: ignore[arg-type]


def _assert_error(resp: httpx.Response, status: int, param: str | None = None) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param


def _still_serves(server: LiveServer) -> None:
    resp = _post(server, "/v1/chat/completions",
                 {"model": MODEL, "messages": USER, "max_tokens": 2, "temperature": 0})
    assert resp.status_code == 200, resp.text
    server.wait_idle()


@pytest.mark.parametrize(("body", "param"), [
    pytest.param("{not json", None, id="malformed-json"),
    pytest.param([1, 2], None, id="not-an-object"),
    pytest.param({"messages": USER}, "model", id="missing-model"),
    pytest.param({"model": MODEL}, "messages", id="missing-messages"),
    pytest.param({"model": MODEL, "messages": []}, "messages", id="empty-messages"),
    pytest.param({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
                 "messages.0", id="unknown-role"),
    pytest.param({"model": MODEL, "messages": [{"role": "user"}]}, "messages.0",
                 id="no-content"),
    pytest.param({"model": MODEL, "messages": [USER[0], {"role": "tool", "content": "x"}]},
                 "messages.1", id="tool-without-call-id"),
    pytest.param({"model": MODEL, "messages": USER, "temperature": -1}, "temperature",
                 id="negative-temperature"),
    pytest.param({"model": MODEL, "messages": USER, "top_p": 0}, "top_p", id="zero-top-p"),
    pytest.param({"model": MODEL, "messages": USER, "max_tokens": 0}, "max_tokens",
                 id="zero-max-tokens"),
    pytest.param({"model": MODEL, "messages": USER, "max_tokens": "many"}, "max_tokens",
                 id="string-max-tokens"),
    pytest.param({"model": MODEL, "messages": USER, "n": 0}, "n", id="n-0"),
    pytest.param({"model": MODEL, "messages": USER, "n": 2, "tools": [TOOL],
                  "tool_choice": "required"}, "n", id="n-2-with-a-grammar"),
    pytest.param({"model": MODEL, "messages": USER, "stop": [""]}, "stop", id="empty-stop"),
    pytest.param({"model": MODEL, "messages": USER, "tool_choice": "required"}, "tool_choice",
                 id="required-without-tools"),
    pytest.param({"model": MODEL, "messages": USER, "tools": [TOOL],
                  "tool_choice": {"type": "function", "function": {"name": "g"}}},
                 "tool_choice", id="unknown-named-tool"),
    pytest.param({"model": MODEL, "messages": USER, "tool_choice": "sometimes",
                  "tools": [TOOL]}, None, id="bad-tool-choice"),
    pytest.param({"model": MODEL, "messages": USER, "tools": [{"type": "function",
                  "function": {"name": "bad name!"}}]}, "tools.0", id="bad-function-name"),
    pytest.param({"model": MODEL, "messages": USER, "top_logprobs": 2}, "top_logprobs",
                 id="top-logprobs-without-logprobs"),
    pytest.param({"model": MODEL, "messages": USER, "logprobs": True, "top_logprobs": 21},
                 "top_logprobs", id="top-logprobs-past-20"),
    pytest.param({"model": MODEL, "messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
                 "response_format", id="invalid-json-schema"),
    pytest.param({"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, None, id="image-part"),
])
def test_invalid_chat_body_is_400(server: LiveServer, body: Any, param: str | None) -> None:
    _assert_error(_post(server, "/v1/chat/completions", body), 400, param)
    _still_serves(server)


@pytest.mark.parametrize(("body", "param"), [
    pytest.param({"model": MODEL, "prompt": []}, "prompt", id="empty-prompt"),
    pytest.param({"model": MODEL, "prompt": [1, 10**6]}, "prompt", id="id-past-vocab"),
    pytest.param({"model": MODEL, "prompt": [1, -2]}, "prompt", id="negative-id"),
    pytest.param({"model": MODEL, "prompt": {"text": "x"}}, "prompt", id="prompt-object"),
    pytest.param({"model": MODEL, "prompt": "x", "echo": True}, None, id="echo"),
])
def test_invalid_completion_body_is_400(server: LiveServer, body: Any,
                                        param: str | None) -> None:
    _assert_error(_post(server, "/v1/completions", body), 400, param)
    _still_serves(server)


def test_unknown_model_is_404(server: LiveServer, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-9", messages=USER)  # type: ignore[arg-type]
    assert info.value.code == "model_not_found"
    _assert_error(_post(server, "/v1/completions", {"model": "gpt-9", "prompt": "x"}), 404,
                  "model")
    _still_serves(server)


def test_prompt_over_context_limit_is_400(server: LiveServer, client: openai.OpenAI) -> None:
    long = [{"role": "user", "content": "Paris " * (MAX_MODEL_LEN + 10)}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=long)  # type: ignore[arg-type]
    assert info.value.code == "context_length_exceeded"
    _assert_error(_post(server, "/v1/completions",
                        {"model": MODEL, "prompt": [5] * MAX_MODEL_LEN}), 400)
    with pytest.raises(openai.BadRequestError) as info:  # prompt + max_tokens too long
        client.completions.create(model=MODEL, prompt=[5] * 10, max_tokens=MAX_MODEL_LEN)
    assert info.value.code == "context_length_exceeded"
    _still_serves(server)


def test_unknown_route_and_method(server: LiveServer) -> None:
    _assert_error(httpx.get(f"{server.url}/v1/nothing"), 404)
    _assert_error(httpx.get(f"{server.url}/v1/chat/completions"), 405)
