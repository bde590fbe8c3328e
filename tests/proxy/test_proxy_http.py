"""``edmm proxy`` over HTTP against a fake vLLM: passthrough, tagging, tool calls, speculation,
errors."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from loopback import serve_app
from proxy_helpers import ARGS, QUESTION, TOOLS, FakeVLLM, Setup, free_port_url

from edmm.model.loader import load_tokenizer
from edmm.proxy import Proxy, ProxyConfig, build_app

TURN = {"model": "tiny", "messages": QUESTION, "tools": TOOLS, "temperature": 0}
HEADERS = {"X-Session-Id": "agent-7"}


def _wait(cond: Callable[[], object], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _stream(url: str, body: Mapping[str, Any], headers: Mapping[str, str] = HEADERS,
            ) -> list[bytes]:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True},
                      headers=dict(headers), timeout=30) as r:
        assert r.status_code == 200
        return list(r.iter_bytes())


def _resume(message: Mapping[str, Any], result: str = "Sunny, 21 C") -> list[dict[str, Any]]:
    """The client's next messages: tool-call arguments re-serialised with ``json.dumps``."""
    calls = [{**tc, "function": {**tc["function"], "arguments": json.dumps(
        json.loads(tc["function"]["arguments"]))}} for tc in message["tool_calls"]]
    return [*QUESTION, {"role": "assistant", "content": message.get("content"),
                        "tool_calls": calls},
            {"role": "tool", "tool_call_id": calls[0]["id"], "content": result}]


def test_non_stream_passthrough_and_tagging(setup: Setup) -> None:
    body = {"model": "tiny", "messages": QUESTION}
    r = httpx.post(f"{setup.url}/v1/chat/completions", json=body, headers=HEADERS, timeout=30)
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == "done"
    sent = setup.fake.chats[-1]["body"]
    assert sent["kv_transfer_params"] == {"edmm_session": "agent-7", "edmm_tool_s": 7.0,
                                          "edmm_awaiting_tool": False}
    assert {k: v for k, v in sent.items() if k != "kv_transfer_params"} == body
    assert setup.proxy.metrics.value("edmm_proxy_tool_calls_total") == 0
    assert not setup.fake.completions


def test_stream_passthrough_is_unchanged_and_unbuffered(setup: Setup) -> None:
    """The first chunk reaches the client while the upstream still holds the stream open."""
    with httpx.stream("POST", f"{setup.url}/v1/chat/completions", headers=HEADERS, timeout=30,
                      json={"model": "slow", "messages": QUESTION, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = r.iter_bytes()
        first = next(chunks)
        assert first.startswith(b"data: ") and b'"role": "assistant"' in first
        setup.fake.release.set()
        rest = b"".join(chunks)
    assert rest.endswith(b"data: [DONE]\n\n") and b'"content": "ne"' in rest


def test_client_tags_win_and_derived_sessions_are_stable(setup: Setup) -> None:
    own = {"edmm_session": "mine", "edmm_tool_s": 2}
    httpx.post(f"{setup.url}/v1/chat/completions", timeout=30,
               json={"model": "tiny", "messages": QUESTION, "kv_transfer_params": own})
    assert setup.fake.chats[-1]["body"]["kv_transfer_params"] == {**own,
                                                                  "edmm_awaiting_tool": False}
    ids = []
    for messages in (QUESTION, [*QUESTION, {"role": "assistant", "content": "hi"},
                                {"role": "user", "content": "and tomorrow?"}]):
        httpx.post(f"{setup.url}/v1/chat/completions", timeout=30,
                   json={"model": "tiny", "messages": messages})
        ids.append(setup.fake.chats[-1]["body"]["kv_transfer_params"]["edmm_session"])
    assert ids[0] == ids[1] and ids[0].startswith("auto-")
    other = [{"role": "user", "content": "something else"}]
    httpx.post(f"{setup.url}/v1/chat/completions", json={"model": "tiny", "messages": other},
               timeout=30)
    assert setup.fake.chats[-1]["body"]["kv_transfer_params"]["edmm_session"] != ids[0]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_tool_call_is_seen_and_speculated_as_the_resume_prefix(
    setup: Setup, tiny_dir: Path, stream: bool
) -> None:
    """The speculation's token ids are the resume prompt's, up to the tool result."""
    if stream:
        events = b"".join(_stream(setup.url, TURN)).split(b"\n\n")
        chunks = [json.loads(e[6:]) for e in events if e.startswith(b"data: {")]
        message = {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call-1", "type": "function", "function": {
                "name": "get_weather",
                "arguments": "".join(tc["function"].get("arguments", "") for c in chunks
                                     for tc in c["choices"][0]["delta"].get("tool_calls", []))}}]}
    else:
        r = httpx.post(f"{setup.url}/v1/chat/completions", json=TURN, headers=HEADERS,
                       timeout=30)
        message = r.json()["choices"][0]["message"]
    assert message["tool_calls"][0]["function"]["arguments"] == ARGS
    assert setup.fake.chats[-1]["body"]["kv_transfer_params"]["edmm_awaiting_tool"] is True
    _wait(lambda: setup.proxy.metrics.value("edmm_proxy_speculations_total",
                                            outcome="sent") == 1)
    assert setup.proxy.metrics.value("edmm_proxy_tool_calls_total") == 1
    (spec,) = setup.fake.completions
    assert spec["max_tokens"] == 1 and spec["model"] == "tiny"
    assert spec["kv_transfer_params"] == {"edmm_session": "agent-7", "edmm_tool_s": 7.0,
                                          "edmm_awaiting_tool": True}
    tok = load_tokenizer(tiny_dir)
    text = tok.apply_chat_template(_resume(message), tools=TOOLS, add_generation_prompt=True,
                                   tokenize=False)
    real = tok.encode(text, add_special_tokens=False)
    head = tok.encode(text[: text.index("Sunny")], add_special_tokens=False)
    assert spec["prompt"] == real[: len(spec["prompt"])]
    assert len(spec["prompt"]) == len(head) - 1  # all but the token next to the result
    assert "get_weather" in tok.decode(spec["prompt"][-30:])  # the assistant message is in
    metrics = httpx.get(f"{setup.url}/metrics", timeout=10).text
    assert 'edmm_proxy_speculations_total{outcome="sent"} 1.0' in metrics
    assert f"edmm_proxy_speculated_tokens_total {float(len(spec['prompt']))}" in metrics


def test_resume_before_the_speculation_is_sent_cancels_it(
    fake: tuple[FakeVLLM, str],
) -> None:
    upstream, upstream_url = fake
    rendering, release = threading.Event(), threading.Event()

    def slow_render(body: Mapping[str, Any], message: Mapping[str, Any]) -> list[int]:
        rendering.set()
        release.wait(30)
        return [1, 2, 3]

    proxy = Proxy(ProxyConfig(upstream=upstream_url), render=slow_render)
    with serve_app(build_app(proxy)) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json=TURN, headers=HEADERS, timeout=30)
        assert r.status_code == 200 and rendering.wait(30)
        resume = {**TURN, "messages": _resume(r.json()["choices"][0]["message"])}
        assert httpx.post(f"{url}/v1/chat/completions", json=resume, headers=HEADERS,
                          timeout=30).status_code == 200
        release.set()
        _wait(lambda: proxy.metrics.value("edmm_proxy_speculations_total",
                                          outcome="cancelled") == 1)
        time.sleep(0.1)
    assert not upstream.completions


def test_failed_and_unrenderable_speculations_are_counted(setup: Setup) -> None:
    httpx.post(f"{setup.url}/v1/chat/completions", json={**TURN, "model": "fail"},
               headers=HEADERS, timeout=30)
    _wait(lambda: setup.proxy.metrics.value("edmm_proxy_speculations_total",
                                            outcome="failed") == 1)
    httpx.post(f"{setup.url}/v1/chat/completions", headers={"X-Session-Id": "b"}, timeout=30,
               json={**TURN, "chat_template_kwargs": {"enable_thinking": False}})
    _wait(lambda: setup.proxy.metrics.value("edmm_proxy_speculations_total",
                                            outcome="skipped") == 1)
    assert setup.proxy.metrics.value("edmm_proxy_tool_calls_total") == 2


def test_completions_and_models_pass_through(setup: Setup) -> None:
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1}
    r = httpx.post(f"{setup.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "x"
    assert setup.fake.completions == [body]  # untouched
    r = httpx.get(f"{setup.url}/v1/models", timeout=30)
    assert r.json()["data"][0]["id"] == "tiny"


def test_upstream_errors_pass_through(setup: Setup) -> None:
    for stream in (False, True):
        r = httpx.post(f"{setup.url}/v1/chat/completions", timeout=30,
                       json={"model": "broken", "messages": QUESTION, "stream": stream})
        assert r.status_code == 404
        assert r.json()["error"]["message"] == "no such model"


def test_bad_requests_are_400_and_the_proxy_keeps_running(setup: Setup) -> None:
    for raw in (b"{not json", b"[1, 2]"):
        r = httpx.post(f"{setup.url}/v1/chat/completions", content=raw, timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400
        assert r.json()["error"]["type"] == "invalid_request_error"
    for params in ([1], {"edmm_tool_s": "soon"}):
        r = httpx.post(f"{setup.url}/v1/chat/completions", timeout=30,
                       json={"model": "tiny", "messages": QUESTION,
                             "kv_transfer_params": params})
        assert r.status_code == 400
    assert not setup.fake.chats
    r = httpx.post(f"{setup.url}/v1/chat/completions", json={"model": "tiny",
                                                              "messages": QUESTION}, timeout=30)
    assert r.status_code == 200


def test_upstream_down_is_a_502_error_object() -> None:
    proxy = Proxy(ProxyConfig(upstream=free_port_url()))
    with serve_app(build_app(proxy)) as url:
        for method, path, body in (("POST", "/v1/chat/completions", {"messages": QUESTION}),
                                   ("POST", "/v1/completions", {"prompt": "x"}),
                                   ("GET", "/v1/models", None)):
            r = httpx.request(method, f"{url}{path}", json=body, timeout=30)
            assert r.status_code == 502, path
            err = r.json()["error"]
            assert err["type"] == "upstream_error" and "unreachable" in err["message"]
        assert httpx.get(f"{url}/metrics", timeout=10).status_code == 200
