"""`edmm.server.body`: the one-pass parse gives FastAPI's request and FastAPI's errors."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from server_helpers import AUTH, MODEL, LiveServer
from tiers import examples

from edmm.server.app import _add_error_handlers
from edmm.server.body import is_json, parse_body
from edmm.server.protocol import ChatCompletionRequest, CompletionRequest
from edmm.server.validation import lone_surrogate

USER = [{"role": "user", "content": "hi"}]


def _reference() -> TestClient:
    """FastAPI's own parsing of the chat and completion bodies (the routes as they were), with
    the server's error handlers: what `parse_body`'s errors must equal."""
    app = FastAPI()
    _add_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest) -> JSONResponse:
        return JSONResponse({"parsed": True})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> JSONResponse:
        return JSONResponse({"parsed": True})

    return TestClient(app)


BAD_BODIES = [
    pytest.param(b"{not json", "application/json", id="not-json"),
    pytest.param(b'{"model": "m", "messages": [', "application/json", id="truncated"),
    pytest.param(b"", "application/json", id="empty"),
    pytest.param(b'{"model": "m"}', "application/json", id="no-messages"),
    pytest.param(b'{"model": "m", "messages": []}', "application/json", id="no-message"),
    pytest.param(b'{"model": 1, "messages": [{"role": "user", "content": "x"}]}',
                 "application/json", id="model-not-string"),
    pytest.param(b'{"model": "m", "messages": [{"role": "robot", "content": "x"}]}',
                 "application/json", id="unknown-role"),
    pytest.param(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], '
                 b'"max_tokens": -1}', "application/json", id="negative-max-tokens"),
    pytest.param(b"[1, 2]", "application/json", id="array"),
    pytest.param(b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}',
                 "text/plain", id="text-plain"),
    pytest.param(b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}', None,
                 id="no-content-type"),
    pytest.param(b'{"model": "\xff"}', "application/json", id="not-utf8"),
    pytest.param(b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}], '
                 b'"n": "x"}', "application/json", id="surrogate-and-bad-field"),
]

COMPLETION_BAD_BODIES = [
    pytest.param(b"{not json", "application/json", id="not-json"),
    pytest.param(b'{"model": "m"}', "application/json", id="no-prompt"),
    pytest.param(b'{"model": "m", "prompt": [1, "x", 3]}', "application/json", id="mixed-ids"),
    pytest.param(b'{"model": "m", "prompt": [1, 2], "max_tokens": -1}', "application/json",
                 id="negative-max-tokens"),
    pytest.param(b'{"model": "m", "prompt": [1, 2]}', "text/plain", id="text-plain"),
    pytest.param(b"", "application/json", id="empty"),
]


@pytest.mark.parametrize(("path", "body", "content_type"), [
    *(pytest.param("/v1/chat/completions", *p.values, id=f"chat-{p.id}") for p in BAD_BODIES),
    *(pytest.param("/v1/completions", *p.values, id=f"completion-{p.id}")
      for p in COMPLETION_BAD_BODIES)])
def test_bad_body_gets_fastapi_s_error(server: LiveServer, path: str, body: bytes,
                                       content_type: str | None) -> None:
    """Status and OpenAI error JSON as the route with FastAPI's body parameter answered (the
    chat and completion routes parse their own bodies)."""
    headers = dict(AUTH, **({"Content-Type": content_type} if content_type else {}))
    want = _reference().post(path, content=body, headers=headers)
    got = httpx.post(f"{server.url}{path}", content=body, headers=headers, timeout=30)
    assert want.status_code in (400, 422) and "parsed" not in want.text
    assert (got.status_code, got.json()) == (want.status_code, want.json())


def test_completion_lone_surrogate_is_named(server: LiveServer) -> None:
    """A completion's lone surrogate escape takes FastAPI's way and `check_text` names it."""
    body = json.dumps({"model": MODEL, "prompt": ["ok", "a\ud800"], "max_tokens": 1})
    r = httpx.post(f"{server.url}/v1/completions", content=body, timeout=30,
                   headers=dict(AUTH, **{"Content-Type": "application/json"}))
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_text"
    assert r.json()["error"]["param"] == "prompt.1"


@pytest.mark.parametrize(("prompt", "parsed"), [
    ("x", "x"), ([5, 6], [5, 6]), (["1", "2"], ["1", "2"]), ([True], [1]), ([1.0], [1]),
    ([[1], [2, 3]], [[1], [2, 3]]), (["1", 2], [1, 2]),
])
def test_prompt_union_keeps_its_choice(prompt: object, parsed: object) -> None:
    """Token ids first in `Prompt` (for speed) keeps pydantic's smart-mode choice: text stays
    text, even text of digits."""
    body = json.dumps({"model": "m", "prompt": prompt}).encode()
    assert parse_body(CompletionRequest, body, "application/json").value.prompt == parsed


def test_lone_surrogate_is_still_named(server: LiveServer) -> None:
    """A lone surrogate escape takes FastAPI's way (the one-pass parser refuses it as JSON)
    and `check_text` names it, as before."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a\ud800"}]})
    r = httpx.post(f"{server.url}/v1/chat/completions", content=body, timeout=30,
                   headers=dict(AUTH, **{"Content-Type": "application/json"}))
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_text"
    assert r.json()["error"]["param"] == "messages.0.content"


@pytest.mark.parametrize(("value", "where"), [
    ({"prompt": [5, 6, 7]}, None),  # token ids: skipped whole
    ({"prompt": [5, 6, "a\ud800"]}, "prompt.2"),
    ({"prompt": [[1, 2], [3, 4, "\udc00"]]}, "prompt.1.2"),
    ({"stop": ["ok", None, "x\udfff"], "n": 1}, "stop.2"),
    ([1.5, True, None, {"k\ud800": 1}], "3"),
    ({"a": [1, {"b": ["fine"]}], "c": "\ud800"}, "c"),
])
def test_lone_surrogate_paths_through_lists(value: object, where: str | None) -> None:
    """`lone_surrogate` skips lists that hold no text (a prompt's token ids) and still names
    the first string holding one among numbers."""
    assert lone_surrogate(value) == where


@pytest.mark.parametrize("escape", ["\\ud800", "\\udc00", "a\\udc00b", "\\ud800\\ud800",
                                    "\\udfff\\ud800", "\\ud800\\u0041", "\\uDBFF"])
def test_lone_surrogates_leave_the_one_pass_parse(escape: str) -> None:
    """What `ParsedBody.surrogate_free` rests on: the one-pass parser refuses every lone
    surrogate escape (FastAPI's way then parses it and `check_text` names it)."""
    body = b'{"model": "m", "messages": [{"role": "user", "content": "' + escape.encode() + b'"}]}'
    parsed = parse_body(ChatCompletionRequest, body, "application/json")
    assert not parsed.surrogate_free
    content = parsed.value.messages[0].content
    assert isinstance(content, str) and any(0xD800 <= ord(c) <= 0xDFFF for c in content)


def test_text_takes_the_one_pass_parse() -> None:
    for ascii_only in (True, False):  # a pair of surrogate escapes is one character
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "é ✓ 😀"}]},
                          ensure_ascii=ascii_only).encode()
        parsed = parse_body(ChatCompletionRequest, body, "application/json")
        assert parsed.surrogate_free and parsed.value.messages[0].content == "é ✓ 😀"


def test_content_types() -> None:
    assert is_json("application/json") and is_json("application/json; charset=utf-8")
    assert is_json("application/vnd.api+json")
    assert not is_json("text/plain") and not is_json(None) and not is_json("")


_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]), "content": _text}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(
        st.fixed_dictionaries({"type": st.just("text"), "text": _text}), min_size=1,
        max_size=3)}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.none() | _text},
                          optional={"tool_calls": st.lists(st.fixed_dictionaries({
                              "id": st.text("abc123", min_size=1, max_size=8),
                              "type": st.just("function"),
                              "function": st.fixed_dictionaries({
                                  "name": st.text("abcdef_", min_size=1, max_size=8),
                                  "arguments": st.just('{"k": 1}')})}), max_size=2)}),
    st.fixed_dictionaries({"role": st.just("tool"), "tool_call_id": st.just("abc"),
                           "content": _text}),
)
_request = st.fixed_dictionaries(
    {"model": _text, "messages": st.lists(_message, min_size=1, max_size=6)},
    optional={"max_tokens": st.integers(1, 10**6), "temperature": st.floats(0, 2),
              "stream": st.booleans(), "stop": st.none() | _text | st.lists(_text, max_size=3),
              "seed": st.integers(-2**40, 2**40), "ignore_eos": st.booleans(),
              "extra_field": _text})


@settings(max_examples=examples(150), deadline=None)
@given(_request, st.booleans())
def test_one_pass_parse_equals_fastapi_s(request: dict[str, Any], ascii_only: bool) -> None:
    """Whatever the request, the one-pass parse gives the model FastAPI's two passes give."""
    body = json.dumps(request, ensure_ascii=ascii_only).encode()
    try:
        reference = ChatCompletionRequest.model_validate(json.loads(body))
    except ValidationError:
        with pytest.raises(RequestValidationError):
            parse_body(ChatCompletionRequest, body, "application/json")
        return
    parsed = parse_body(ChatCompletionRequest, body, "application/json")
    assert parsed.value == reference and parsed.surrogate_free


def test_a_large_body_is_parsed_off_the_event_loop_with_the_same_errors(
        server: LiveServer) -> None:
    """A body over `INLINE_PARSE_BYTES` (parsed on a worker thread) reaches the request's own
    checks when valid (here: far over the context) and gets FastAPI's error when not."""
    from edmm.server.app import INLINE_PARSE_BYTES

    text = "word " * (INLINE_PARSE_BYTES // 5 + 1000)
    headers = dict(AUTH, **{"Content-Type": "application/json"})
    good = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}]})
    assert len(good) > INLINE_PARSE_BYTES
    r = httpx.post(f"{server.url}/v1/chat/completions", content=good, headers=headers,
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    bad = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}],
                      "max_tokens": "many"}).encode()
    want = _reference().post("/v1/chat/completions", content=bad, headers=headers)
    got = httpx.post(f"{server.url}/v1/chat/completions", content=bad, headers=headers,
                     timeout=60)
    assert want.status_code == 400
    assert (got.status_code, got.json()) == (want.status_code, want.json())
