"""Adversarial input (issue 16): every bad request is a 4xx with an OpenAI error object, the
server answers a normal request right after, and a costly request never stalls a bystander.

The hardened server of this module enables client chat templates (with a time budget long
enough that a runaway template is still running while a bystander is served), a body limit
of `BODY_LIMIT` and the API docs; the session server of conftest has the defaults (templates
off, docs off).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import (
    MAX_MODEL_LEN,
    MODEL,
    QUESTION,
    WEATHER,
    LiveServer,
    nested_json,
    serve,
    server_config,
)

from edmm.server import ServerState
from edmm.server.templates import TemplateLimits

BODY_LIMIT = 24 << 20
TEMPLATE_TIME_S = 3.0  # the runaway template below runs this long before its 400
BYSTANDER_RATIO = 10.0  # a bystander's latency beside a costly request / its latency alone
HUGE_RATIO = 4.0  # the huge prompt's refusal / the same body's refusal for its model name
USER = [{"role": "user", "content": "hi"}]
BAD = "\ud800"  # a lone surrogate: valid as a JSON escape, not text
RUNAWAY = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
           "{% endfor %}")
COSTLY_PATTERN = "^((a{100}){100}){10}$"


@pytest.fixture(scope="module")
def hardened(tiny_dir: Path) -> Iterator[LiveServer]:
    config = dataclasses.replace(
        server_config(tiny_dir), allow_client_chat_template=True, max_body_bytes=BODY_LIMIT,
        template_limits=TemplateLimits(time_s=TEMPLATE_TIME_S, max_iterations=10**12),
        api_docs=True)
    yield from serve(ServerState(config))


def _post(server: LiveServer, path: str, body: Any, headers: dict[str, str] | None = None,
          timeout: float = 60) -> httpx.Response:
    """POST ``body`` as JSON (Python's encoder: lone surrogates become ``\\ud800`` escapes)."""
    return httpx.post(f"{server.url}{path}", content=json.dumps(body), timeout=timeout,
                      headers={"content-type": "application/json", **(headers or {})})


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, "max_tokens": 2, "temperature": 0, **fields}


def _assert_error(resp: httpx.Response, status: int, param: str | None = None,
                  code: str | None = None) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    message = error["message"]
    assert isinstance(message, str) and message and len(message) < 1000, message
    assert "backtrace" not in message and "Traceback" not in message
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


def _still_serves(server: LiveServer) -> None:
    resp = _post(server, "/v1/chat/completions", _chat())
    assert resp.status_code == 200, resp.text
    server.wait_idle()


def _timed(request: Callable[[], httpx.Response]) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    resp = request()
    return resp, time.monotonic() - t0


def _served_s(server: LiveServer) -> float:
    """Seconds a normal request takes (it must succeed)."""
    resp, seconds = _timed(lambda: _post(server, "/v1/chat/completions", _chat()))
    assert resp.status_code == 200, resp.text
    return seconds


def _bystander_while(server: LiveServer, bad: Callable[[], httpx.Response],
                     still_running: bool = False) -> httpx.Response:
    """Send ``bad`` and, while it is in flight, a normal request: that one takes at most
    `BYSTANDER_RATIO` times as long as alone on the idle server just before (the median of
    three: the machine's load scales both). ``still_running``: check that ``bad`` had not
    finished by then."""
    _still_serves(server)  # warm
    alone = statistics.median(_served_s(server) for _ in range(3))
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(bad)
        time.sleep(0.2)  # the bad request is being rendered / compiled / tokenized
        took = _served_s(server)
        assert took < BYSTANDER_RATIO * alone, (
            f"the bystander took {took:.3f} s beside, {alone:.3f} s alone")
        if still_running:
            assert not future.done(), "the bad request ended before the bystander was served"
        return future.result()


def _tool(name: str = "f", parameters: Any = None, description: str | None = None
          ) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name, "parameters": parameters or {"type": "object"}}
    if description is not None:
        function["description"] = description
    return {"type": "function", "function": function}


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
ASKED = [USER[0], {"role": "assistant", "content": "", "tool_calls": [CALL]}]


def _answer(content: Any = "ok", call_id: str = "call_1") -> list[dict[str, Any]]:
    return [*ASKED, {"role": "tool", "tool_call_id": call_id, "content": content}]


def _called(arguments: str) -> list[dict[str, Any]]:
    call = {**CALL, "function": {"name": "f", "arguments": arguments}}
    return [USER[0], {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]


# ---------------------------------------------------------------------------- chat 400s

CHAT_400 = [
    # client chat templates: keys the server sets, and templates that fail
    *[pytest.param(_chat(chat_template_kwargs={key: value}), "chat_template_kwargs", None,
                   id=f"template-kwarg-{key}")
      for key, value in [("add_generation_prompt", "x"), ("continue_final_message", True),
                         ("return_assistant_tokens_mask", True), ("documents", 5),
                         ("messages", []), ("tokenize", True), ("chat_template", 5),
                         ("chat_template", "")]],
    *[pytest.param(_chat(chat_template_kwargs={"chat_template": source}),
                   "chat_template_kwargs", None, id=f"template-{name}")
      for name, source in [("zero-division", "{{ 1/0 }}"), ("include", "{% include 'x' %}"),
                           ("syntax", "{{ 5 }"), ("raise", "{{ raise_exception('no') }}"),
                           ("huge-string", "{{ 'a' * 10**9 }}"),
                           ("deep-recursion", "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"),
                           ("dunder", "{{ ''.__class__.__mro__[1].__subclasses__() }}"),
                           ("center-bomb", "{{ 'x'|center(10**9) }}")]],
    # lone surrogates, wherever a string reaches the tokenizer
    pytest.param(_chat(messages=[{"role": "user", "content": BAD}]), "messages.0.content", None,
                 id="surrogate-content"),
    pytest.param(_chat(messages=[{"role": "user", "content": [{"type": "text",
                                                                "text": "a" + BAD}]}]),
                 "messages.0.content.0.text", None, id="surrogate-content-part"),
    pytest.param(_chat(messages=[{"role": "system", "content": BAD}, USER[0]]),
                 "messages.0.content", None, id="surrogate-system"),
    pytest.param(_chat(messages=_answer(BAD)), "messages.2.content", None,
                 id="surrogate-tool-message"),
    pytest.param(_chat(messages=_called('{"a": "' + BAD + '"}')),
                 "messages.1.tool_calls.0.function.arguments", None, id="surrogate-arguments"),
    pytest.param(_chat(tools=[_tool(description=BAD)]), "tools.0.function.description", None,
                 id="surrogate-tool-description"),
    pytest.param(_chat(tools=[_tool(parameters={"type": "object", "properties": {
        BAD: {"type": "string"}}})]), "tools.0.function.parameters.properties", None,
                 id="surrogate-schema-key"),
    pytest.param(_chat(stop=[BAD]), "stop.0", None, id="surrogate-stop"),
    pytest.param(_chat(edmm={"predicted_next_messages": [
        USER[0], {"role": "tool", "tool_call_id": "f", "content": BAD}]}),
                 "edmm.predicted_next_messages.1.content", None,
                 id="surrogate-predicted-messages"),
    # grammars
    *[pytest.param(_chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "x-guidance": value}}}), "response_format",
                   None, id=f"x-guidance-{name}")
      for name, value in [("list", [1]), ("int", 5), ("str", "s"), ("null", None)]],
    pytest.param(_chat(tools=[_tool(parameters={"type": "object", "x-guidance": [1]})]),
                 "tools.0", None, id="x-guidance-in-tool"),
    pytest.param(_chat(tools=[_tool(f"t{i}") for i in range(3000)], tool_choice="required"),
                 "tools", None, id="3000-forced-tools"),
    # context
    pytest.param(_chat(max_tokens=MAX_MODEL_LEN), "max_tokens", "context_length_exceeded",
                 id="max-tokens-over-context"),
    pytest.param(_chat(max_tokens=MAX_MODEL_LEN - 4), "messages", "context_length_exceeded",
                 id="max-tokens-leaves-no-room"),
    # conversation and tools
    pytest.param(_chat(messages=[USER[0], {"role": "tool", "tool_call_id": "nope",
                                           "content": "x"}]), "messages.1", None,
                 id="tool-message-answers-no-call"),
    pytest.param(_chat(messages=_answer(call_id="call_2")), "messages.2", None,
                 id="tool-message-answers-another-call"),
    pytest.param(_chat(tools=[_tool("f"), _tool("f")]), "tools.1", None,
                 id="duplicate-tool-names"),
    pytest.param(_chat(tools=[_tool("f"), _tool("f")], tool_choice="required"), "tools.1",
                 None, id="duplicate-tool-names-required"),
    *[pytest.param(_chat(tools=[_tool(parameters=schema)]), "tools.0", None,
                   id=f"tool-schema-{name}")
      for name, schema in [("bad-type", {"type": "nope"}),
                           ("bad-ref", {"$ref": "#/$defs/missing"}),
                           ("min-over-max", {"type": "object", "properties": {
                               "n": {"type": "integer", "minimum": 5, "maximum": 1}}}),
                           ("bad-regex", {"type": "object", "properties": {
                               "s": {"type": "string", "pattern": "(["}}})]],
]


@pytest.mark.parametrize(("body", "param", "code"), CHAT_400)
def test_adversarial_chat_is_400(hardened: LiveServer, body: dict[str, Any],
                                 param: str | None, code: str | None) -> None:
    _assert_error(_post(hardened, "/v1/chat/completions", body), 400, param, code)
    _still_serves(hardened)


@pytest.mark.parametrize("arguments", ["[1]", '"x"', "{a", "", '{"a": [1, "x', "null"],
                         ids=["list", "string", "not-json", "empty", "cut", "null"])
def test_any_arguments_string_is_accepted_in_history(hardened: LiveServer,
                                                     arguments: str) -> None:
    """A call's arguments in an earlier assistant message may be any string (OpenAI accepts
    them; a client echoes back what it got, a call cut short included)."""
    resp = _post(hardened, "/v1/chat/completions", _chat(messages=_called(arguments)))
    assert resp.status_code == 200, resp.text


def _deep_schema(depth: int) -> str:
    schema = '{"type": "object"}'
    for _ in range(depth):
        schema = '{"type": "object", "properties": {"x": ' + schema + "}}"
    return schema


_HEAD = '{"model": "' + MODEL + '", '
_ONE_USER = '"messages": [{"role": "user", "content": "x"}], '


def _tool_schema(schema: str) -> str:
    return (_HEAD + _ONE_USER + '"tools": [{"type": "function", "function": {"name": "f", '
            '"parameters": ' + schema + "}}]}")


@pytest.mark.parametrize(("path", "body"), [
    pytest.param("/v1/chat/completions",
                 _HEAD + '"messages": ' + nested_json(100_000, '{"role": "user", "content": "x"}')
                 + "}", id="chat-messages"),
    pytest.param("/v1/chat/completions", _HEAD + _ONE_USER + '"pad": ' + nested_json(100_000)
                 + "}", id="chat-extra"),
    pytest.param("/v1/chat/completions", _tool_schema(_deep_schema(5_000)), id="tool-schema"),
    pytest.param("/v1/chat/completions", _tool_schema(_deep_schema(300)),
                 id="tool-schema-300"),
    pytest.param("/v1/completions", _HEAD + '"prompt": ' + nested_json(100_000) + "}",
                 id="completion"),
    pytest.param("/v1/edmm/sessions/any/tool_output",
                 '{"tool_call_id": "c", "content": ' + nested_json(100_000) + "}",
                 id="tool-output"),
])
def test_deep_json_is_400(hardened: LiveServer, path: str, body: str) -> None:
    """JSON nested far deeper than any request needs is a 400, never a 500."""
    resp = httpx.post(f"{hardened.url}{path}", content=body, timeout=60,
                      headers={"content-type": "application/json"})
    _assert_error(resp, 400)
    _still_serves(hardened)


@pytest.mark.parametrize("body", [
    pytest.param({"model": MODEL, "prompt": "a" + BAD, "max_tokens": 2}, id="text"),
    pytest.param({"model": MODEL, "prompt": ["ok", BAD], "max_tokens": 2}, id="list"),
])
def test_surrogate_completion_prompt_is_400(hardened: LiveServer, body: Any) -> None:
    _assert_error(_post(hardened, "/v1/completions", body), 400, code="invalid_text")
    _still_serves(hardened)


def test_surrogate_tool_output_is_400(hardened: LiveServer) -> None:
    resp = _post(hardened, "/v1/edmm/sessions/any/tool_output",
                 {"tool_call_id": "call_1", "content": BAD})
    _assert_error(resp, 400, "content", "invalid_text")
    _still_serves(hardened)


def test_client_templates_are_off_by_default(server: LiveServer) -> None:
    body = _chat(chat_template_kwargs={"chat_template": "{{ messages[0].content }}"})
    _assert_error(_post(server, "/v1/chat/completions", body), 400, "chat_template_kwargs",
                  "chat_template_disabled")
    _still_serves(server)


def test_allowed_client_template_is_used(hardened: LiveServer) -> None:
    """A well-behaved client template renders the prompt (the usage counts its tokens)."""
    template = "{% for m in messages %}{{ m.content ~ '\n' }}{% endfor %}"
    body = _chat(messages=[{"role": "user", "content": "one two three"}],
                 chat_template_kwargs={"chat_template": template})
    resp = _post(hardened, "/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text
    tokenizer = hardened.state.engine.tokenizer
    want = len(tokenizer.encode("one two three\n", add_special_tokens=False))
    assert resp.json()["usage"]["prompt_tokens"] == want


# ---------------------------------------------------------------------------- stalls


def test_runaway_template_does_not_stall_others(hardened: LiveServer) -> None:
    body = _chat(chat_template_kwargs={"chat_template": RUNAWAY})
    resp = _bystander_while(hardened, lambda: _post(hardened, "/v1/chat/completions", body),
                            still_running=True)
    _assert_error(resp, 400, "chat_template_kwargs", "chat_template_budget_exceeded")
    assert f"took over {TEMPLATE_TIME_S:g} s" in resp.json()["error"]["message"]  # its budget
    _still_serves(hardened)


def test_huge_prompt_is_refused_before_it_is_tokenized(hardened: LiveServer) -> None:
    """A 20 MB message (millions of tokens) gets its 400 at once: within `HUGE_RATIO` times
    the time the same body takes to be refused for its model name (read and parsed, nothing
    rendered); a bystander meanwhile is served as `_bystander_while` says."""
    huge = _chat(messages=[{"role": "user", "content": "Paris is nice. " * 1_400_000}])
    resp, parsed_s = _timed(lambda: _post(hardened, "/v1/chat/completions",
                                          {**huge, "model": "no-such-model"}))
    _assert_error(resp, 404, code="model_not_found")
    refused: list[float] = []

    def send_huge() -> httpx.Response:
        resp, seconds = _timed(lambda: _post(hardened, "/v1/chat/completions", huge))
        refused.append(seconds)
        return resp

    _assert_error(_bystander_while(hardened, send_huge), 400, code="context_length_exceeded")
    assert refused[0] < HUGE_RATIO * parsed_s, f"{refused[0]:.3f} s, parsed in {parsed_s:.3f} s"
    text = {"model": MODEL, "prompt": "Paris is nice. " * 1_400_000, "max_tokens": 2}
    _assert_error(_post(hardened, "/v1/completions", text), 400, "prompt",
                  "context_length_exceeded")
    _still_serves(hardened)


def test_costly_grammar_does_not_stall_others(hardened: LiveServer) -> None:
    schema = {"type": "object", "required": ["a"], "properties": {
        "a": {"type": "string", "pattern": COSTLY_PATTERN}}}
    body = _chat(max_tokens=64, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema}})
    resp = _bystander_while(hardened, lambda: _post(hardened, "/v1/chat/completions", body))
    _assert_error(resp, 400, "response_format", "grammar_too_costly")
    _still_serves(hardened)


def test_costly_pattern_after_cheap_masks_does_not_stall_others(hardened: LiveServer) -> None:
    """A grammar that passes its first mask but whose mask of "a"'s value would build costly
    lexer states: refused for that pattern alone (and past that check, its mask would go over
    the parser's step fuel: `test_guided`)."""
    schema = {"type": "object", "required": ["x", "a"], "properties": {
        "x": {"type": "string", "maxLength": 2},
        "a": {"type": "string", "pattern": COSTLY_PATTERN}}}
    body = _chat(max_tokens=48, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema}})
    resp = _bystander_while(hardened, lambda: _post(hardened, "/v1/chat/completions", body))
    _assert_error(resp, 400, "response_format", "grammar_too_costly")
    _still_serves(hardened)


# ---------------------------------------------------------------------------- HTTP


def test_body_over_the_limit_is_413(hardened: LiveServer) -> None:
    blob = "x" * (BODY_LIMIT + 1)
    resp = _post(hardened, "/v1/chat/completions", _chat(unknown_field=blob))
    _assert_error(resp, 413, code="request_too_large")

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while it is read
        data = json.dumps(_chat(unknown_field=blob)).encode()
        for i in range(0, len(data), 1 << 20):
            yield data[i:i + (1 << 20)]

    resp = httpx.post(f"{hardened.url}/v1/chat/completions", content=chunks(), timeout=60,
                      headers={"content-type": "application/json"})
    _assert_error(resp, 413, code="request_too_large")
    _still_serves(hardened)


def test_unknown_field_under_the_limit_is_ignored(hardened: LiveServer) -> None:
    resp = _post(hardened, "/v1/chat/completions", _chat(unknown_field="x" * 1000))
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize(("headers", "status", "param", "code"), [
    pytest.param({"X-Session-Id": "s" * 20_000}, 400, "x-session-id", None,
                 id="long-session-header"),
    pytest.param({"X-Session-Id": ""}, 400, "x-session-id", None, id="empty-session-header"),
    pytest.param({"X-Filler": "f" * 70_000}, 431, None, "headers_too_large",
                 id="huge-headers"),
    pytest.param({"Host": "evil.example"}, 400, None, "invalid_host", id="foreign-host"),
    pytest.param({"Host": "evil.example:8000"}, 400, None, "invalid_host",
                 id="foreign-host-port"),
])
def test_bad_headers_are_4xx(server: LiveServer, headers: dict[str, str], status: int,
                             param: str | None, code: str | None) -> None:
    resp = _post(server, "/v1/chat/completions", _chat(), headers=headers)
    _assert_error(resp, status, param, code)
    _still_serves(server)


def test_loopback_names_are_accepted(server: LiveServer) -> None:
    port = server.url.rsplit(":", 1)[1]
    for host in ("localhost", f"localhost:{port}", f"127.0.0.1:{port}"):
        resp = _post(server, "/v1/chat/completions", _chat(), headers={"Host": host})
        assert resp.status_code == 200, (host, resp.text)


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json"])
def test_api_docs_are_off_by_default(server: LiveServer, path: str) -> None:
    _assert_error(httpx.get(f"{server.url}{path}", timeout=10), 404)



# ---------------------------------------------------------------------------- late failures

PICKY_TEMPLATE = ("{% if messages|length > 2 %}{{ 1/0 }}{% endif %}"
                  "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kind", ["template-fails", "over-context"])
def test_predicted_messages_that_fail_late_cost_only_the_hint(hardened: LiveServer,
                                                              stream: bool, kind: str) -> None:
    """Predicted next messages whose rendering fails only once the reply exists (a client
    template raising on them, or longer than the context): the reply is whole, the session
    awaits its tool."""
    tool = {"role": "tool", "tool_call_id": "get_weather", "content": "sunny"}
    if kind == "over-context":
        tool["content"] = "sunny " * 5000
    body = _chat(messages=QUESTION, tools=[WEATHER], tool_choice="required", max_tokens=64,
                 stream=stream, edmm={"predicted_next_messages": [*QUESTION, tool]})
    if kind == "template-fails":
        body["chat_template_kwargs"] = {"chat_template": PICKY_TEMPLATE}
    resp = _post(hardened, "/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text
    session_id = resp.headers["x-session-id"]
    if stream:
        events = [line for line in resp.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and '"error"' not in resp.text
        assert '"finish_reason":"tool_calls"' in resp.text
    else:
        assert resp.json()["choices"][0]["finish_reason"] == "tool_calls"
    state = httpx.get(f"{hardened.url}/v1/edmm/sessions/{session_id}", timeout=10).json()
    assert state["state"] == "awaiting_tool"
    httpx.delete(f"{hardened.url}/v1/edmm/sessions/{session_id}", timeout=10)
    _still_serves(hardened)


def test_a_bad_tool_output_chunk_is_refused_before_it_is_stored(hardened: LiveServer) -> None:
    """A chunk that is not text is a 400 and not kept: the call's later valid chunks are
    accepted."""
    resp = _post(hardened, "/v1/chat/completions",
                 _chat(messages=QUESTION, tools=[WEATHER], tool_choice="required",
                       max_tokens=64))
    assert resp.status_code == 200, resp.text
    session_id = resp.headers["x-session-id"]
    call_id = resp.json()["choices"][0]["message"]["tool_calls"][0]["id"]
    path = f"/v1/edmm/sessions/{session_id}/tool_output"
    _assert_error(_post(hardened, path, {"tool_call_id": call_id, "content": "a" + BAD}), 400,
                  "content", "invalid_text")
    for chunk in ("partial ", "output"):
        ok = _post(hardened, path, {"tool_call_id": call_id, "content": chunk})
        assert ok.status_code == 200, ok.text
    httpx.delete(f"{hardened.url}/v1/edmm/sessions/{session_id}", timeout=10)
    _still_serves(hardened)


def _refs(node: object) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "$ref"] + [
            r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


@pytest.mark.parametrize(("path", "fields"), [
    ("/v1/chat/completions", {"messages", "model", "tools", "stream"}),
    ("/v1/completions", {"prompt", "model", "max_tokens", "stream"}),
    ("/v1/responses", {"input", "model", "tools", "stream"}),
])
def test_api_docs_show_the_bodies(hardened: LiveServer, path: str, fields: set[str]) -> None:
    """With --api-docs the body schemas of the routes that parse their own bodies are
    documented, and every reference in the document resolves."""
    doc = httpx.get(f"{hardened.url}/openapi.json", timeout=10).json()
    assert httpx.get(f"{hardened.url}/docs", timeout=10).status_code == 200
    body = doc["paths"][path]["post"]["requestBody"]
    ref = body["content"]["application/json"]["schema"]["$ref"]
    model = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert fields <= set(model["properties"])
    assert fields & {"messages", "prompt", "input"} <= set(model["required"])
    names = set(doc["components"]["schemas"])
    assert all(r.rsplit("/", 1)[1] in names for r in _refs(doc))
