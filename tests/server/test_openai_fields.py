"""The OpenAI request fields a vLLM user sends: each supported one has its effect, each refused
one is a 400 naming it; unknown fields are ignored as vLLM ignores them."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_helpers import AUTH, MODEL, QUESTION, TOOLS, LiveServer
from transformers import AutoTokenizer

HI = [{"role": "user", "content": "Say hello."}]


def _chat(server: LiveServer, **body: Any) -> httpx.Response:
    return httpx.post(f"{server.base_url}/chat/completions", headers=AUTH, timeout=60,
                      json={"model": MODEL, "messages": HI, **body})


def _sse(response: httpx.Response) -> list[dict[str, Any]]:
    """The JSON chunks of an SSE body (``[DONE]`` last, checked)."""
    lines = [ln[len("data: "):] for ln in response.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_n_returns_n_choices(server: LiveServer) -> None:
    reply = _chat(server, n=3, max_tokens=6, temperature=1.0).json()
    assert sorted(c["index"] for c in reply["choices"]) == [0, 1, 2]
    assert 3 <= reply["usage"]["completion_tokens"] <= 18  # the choices' tokens together
    streamed = _sse(_chat(server, n=2, max_tokens=4, stream=True))
    assert {c["index"] for chunk in streamed for c in chunk["choices"]} == {0, 1}
    finished = [c["index"] for chunk in streamed for c in chunk["choices"] if c["finish_reason"]]
    assert sorted(finished) == [0, 1]


def test_logprobs_and_top_logprobs(server: LiveServer) -> None:
    reply = _chat(server, logprobs=True, top_logprobs=3, max_tokens=5, temperature=0).json()
    content = reply["choices"][0]["logprobs"]["content"]
    assert len(content) == reply["usage"]["completion_tokens"]
    for entry in content:
        tops = entry["top_logprobs"]
        assert len(tops) == 3 and entry["logprob"] <= 0
        assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
        # greedy: the chosen token is the most likely one
        assert entry["logprob"] == pytest.approx(tops[0]["logprob"], abs=1e-4)
        assert entry["bytes"] == list(entry["token"].encode())
    plain = _chat(server, max_tokens=2).json()
    assert plain["choices"][0].get("logprobs") is None
    legacy = httpx.post(f"{server.base_url}/completions", headers=AUTH, timeout=60,
                        json={"model": MODEL, "prompt": "Hello", "max_tokens": 3,
                              "logprobs": 2, "temperature": 0}).json()
    lp = legacy["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 3
    assert all(len(top) <= 2 for top in lp["top_logprobs"])
    bad = _chat(server, top_logprobs=3)  # top_logprobs needs logprobs
    assert bad.status_code == 400 and "logprobs" in bad.json()["error"]["message"]


def _tokens(reply: dict[str, Any]) -> list[dict[str, Any]]:
    return list(reply["choices"][0]["logprobs"]["content"])


def test_logit_bias_forces_and_bans_tokens(server: LiveServer, tiny_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    target = tok.encode(" the", add_special_tokens=False)[0]
    forced = _chat(server, max_tokens=4, temperature=0, logit_bias={str(target): 100},
                   logprobs=True).json()
    assert [e["token"] for e in _tokens(forced)] == [tok.decode([target])] * 4
    plain = _chat(server, max_tokens=1, temperature=0, logprobs=True).json()
    first = _tokens(plain)[0]["token"]
    (first_id,) = tok.encode(first, add_special_tokens=False)
    banned = _chat(server, max_tokens=1, temperature=0, logprobs=True,
                   logit_bias={str(first_id): -100}).json()
    assert _tokens(banned)[0]["token"] != first
    for bad in ({"1": 101}, {"x": 1}, {str(10**9): 1}):
        response = _chat(server, logit_bias=bad)
        assert response.status_code == 400, bad
        assert "logit_bias" in json.dumps(response.json()["error"])


def test_penalties_steer_greedy_decoding(server: LiveServer) -> None:
    """Greedy with penalties picks, at each step, the token of the highest raw log
    probability (what ``logprobs`` report) minus ``frequency * count + presence * (count >
    0)`` over the tokens generated so far: checked over each step's top 20."""
    presence, frequency = 1.5, 0.7
    reply = _chat(server, max_tokens=16, temperature=0, logprobs=True, top_logprobs=20,
                  presence_penalty=presence, frequency_penalty=frequency).json()
    counts: Counter[str] = Counter()
    steered = 0
    for entry in _tokens(reply):
        def score(token: str, logprob: float) -> float:
            n = counts[token]
            return logprob - frequency * n - presence * (n > 0)

        # byte-fallback tokens all read "\ufffd": their counts are unknown, leave them out
        known = [score(t["token"], t["logprob"]) for t in entry["top_logprobs"]
                 if "\ufffd" not in t["token"]]
        if "\ufffd" not in entry["token"]:
            assert score(entry["token"], entry["logprob"]) >= max(known) - 1e-3
        steered += entry["token"] != entry["top_logprobs"][0]["token"]
        counts[entry["token"]] += 1
    unpenalized = _tokens(_chat(server, max_tokens=16, temperature=0, logprobs=True).json())
    assert steered or max(Counter(e["token"] for e in unpenalized).values()) == 1
    for name in ("presence_penalty", "frequency_penalty"):
        response = _chat(server, **{name: 2.5})
        assert response.status_code == 400 and response.json()["error"]["param"] == name


def test_stream_options(server: LiveServer) -> None:
    chunks = _sse(_chat(server, max_tokens=5, stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True, "include_obfuscation": True}))
    with_choices = [c for c in chunks if c["choices"]]
    assert with_choices and all(c.get("usage") for c in with_choices)
    completions = [c["usage"]["completion_tokens"] for c in with_choices]
    assert completions == sorted(completions)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert all(isinstance(c.get("obfuscation"), str) for c in with_choices)
    quiet = _sse(_chat(server, max_tokens=3, stream=True))
    assert all(c.get("usage") is None and "obfuscation" not in c for c in quiet)
    # stream_options without stream is OpenAI's 400
    bad = _chat(server, max_tokens=3, stream_options={"include_usage": True})
    assert bad.status_code == 400 and "stream_options" in json.dumps(bad.json())


def test_tool_choice_none_decodes_without_tools(server: LiveServer) -> None:
    for _ in range(3):
        reply = _chat(server, messages=QUESTION, tools=TOOLS, tool_choice="none",
                      max_tokens=48, temperature=1.0).json()
        message = reply["choices"][0]["message"]
        assert "tool_calls" not in message
        assert "<tool_call>" not in (message["content"] or "")
        assert reply["choices"][0]["finish_reason"] in ("stop", "length")


def test_parallel_tool_calls_false_stops_after_one_call(server: LiveServer) -> None:
    for parallel, most in ((False, 1), (True, None)):
        reply = _chat(server, messages=QUESTION, tools=TOOLS, tool_choice="required",
                      parallel_tool_calls=parallel, max_tokens=200, temperature=0).json()
        calls = reply["choices"][0]["message"]["tool_calls"]
        assert calls and (most is None or len(calls) <= most)
        assert reply["choices"][0]["finish_reason"] == "tool_calls"


def test_no_empty_tool_calls_in_a_reply(server: LiveServer) -> None:
    reply = _chat(server, max_tokens=3).json()
    assert "tool_calls" not in reply["choices"][0]["message"]


def test_models_by_id(server: LiveServer) -> None:
    client = server.client()
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_unknown_fields_ignored_known_unsupported_refused(server: LiveServer) -> None:
    ok = _chat(server, max_tokens=2, no_such_field=1, messages=[
        {"role": "user", "content": "hi", "mystery": True}])
    assert ok.status_code == 200
    assert _chat(server, max_tokens=2, functions=[], min_p=0.0).status_code == 200  # neutral
    for field, value in (("functions", [{"name": "f", "parameters": {}}]), ("min_p", 0.1),
                         ("use_beam_search", True), ("prompt_logprobs", 1)):
        response = _chat(server, max_tokens=2, **{field: value})
        assert response.status_code == 400, field
        assert response.json()["error"]["param"] == field
