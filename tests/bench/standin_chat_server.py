"""A stand-in OpenAI-compatible chat server for the agent replay's peer tests: ``/v1/models``,
streamed ``/v1/chat/completions`` (a named ``tool_choice`` answers with one tool call; otherwise
``max_tokens`` content chunks), a prefix cache over whitespace-separated words (``usage``
reports the words of the rendered messages as prompt tokens and the longest prefix shared with
an earlier prompt as cached), and vLLM-style ``/metrics``. It waits ``--first-ms`` before the
first chunk and ``--token-ms`` between content chunks.

    python tests/bench/standin_chat_server.py --port 8123 [--first-ms 30] [--token-ms 2]

``GET /stats`` counts the chat requests, those with a named tool choice, and any other request
(an EDMM-only endpoint called against a peer would show up there).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse


def words_of(body: dict[str, Any]) -> list[str]:
    """The prompt as words: every message's role and content, and the tools' JSON."""
    out = [w for t in body.get("tools") or () for w in json.dumps(t, sort_keys=True).split()]
    for m in body["messages"]:
        out.append(f"<{m['role']}>")
        out += (m.get("content") or "").split()
        for call in m.get("tool_calls") or ():
            out += [call["function"]["name"], call["function"]["arguments"]]
    return out


def common(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def build(first_ms: float, token_ms: float) -> FastAPI:
    app = FastAPI()
    served = {"chat": 0, "forced": 0, "other": 0, "running": 0}
    cache = {"queries": 0, "hits": 0}
    prompts: list[list[str]] = []

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "standin", "object": "model"}]})

    @app.get("/stats")
    async def stats() -> JSONResponse:
        return JSONResponse(served)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        lab = '{engine="0",model_name="standin"}'
        return PlainTextResponse("\n".join([
            "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in tokens.",
            f"vllm:prefix_cache_queries_total{lab} {float(cache['queries'])}",
            f"vllm:prefix_cache_hits_total{lab} {float(cache['hits'])}",
            f"vllm:kv_cache_usage_perc{lab} {min(1.0, served['running'] / 4)}",
            f"vllm:num_requests_running{lab} {float(served['running'])}"]) + "\n")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        body = await request.json()
        served["chat"] += 1
        words = words_of(body)
        cached = max((common(words, p) for p in prompts), default=0)
        prompts.append(words)
        cache["queries"] += len(words)
        cache["hits"] += cached
        choice = body.get("tool_choice")
        forced = isinstance(choice, dict)
        served["forced"] += forced
        n = int(body["max_tokens"])

        def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
            return "data: " + json.dumps({"id": "c", "object": "chat.completion.chunk",
                                          "created": 0, "model": "standin",
                                          "choices": [{"index": 0, "delta": delta,
                                                       "finish_reason": finish}]}) + "\n\n"

        async def events() -> AsyncIterator[str]:
            served["running"] += 1
            try:
                await asyncio.sleep(first_ms / 1e3)
                if forced:
                    name = choice["function"]["name"]
                    call = {"index": 0, "id": f"call{served['chat']}", "type": "function",
                            "function": {"name": name, "arguments": '{"key": "record"}'}}
                    yield chunk({"role": "assistant", "tool_calls": [call]}, "tool_calls")
                    out = 5
                else:
                    for i in range(n):
                        if i:
                            await asyncio.sleep(token_ms / 1e3)
                        yield chunk({"content": f" t{i}"}, "length" if i == n - 1 else None)
                    out = n
                usage = {"prompt_tokens": len(words), "completion_tokens": out,
                         "total_tokens": len(words) + out,
                         "prompt_tokens_details": {"cached_tokens": cached}}
                yield "data: " + json.dumps({"id": "c", "object": "chat.completion.chunk",
                                             "created": 0, "model": "standin", "choices": [],
                                             "usage": usage}) + "\n\n"
                yield "data: [DONE]\n\n"
            finally:
                served["running"] -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def other(path: str) -> JSONResponse:
        served["other"] += 1
        return JSONResponse({"error": {"message": f"no {path}"}}, status_code=404)

    return app


# The ``vllm serve`` options `edmm.bench.peers.vllm_spec` and the agent replay pass (each one in
# vLLM 0.26's ``vllm serve --help``): the fake ``vllm`` refuses any other, as vLLM would.
VLLM_FLAGS = frozenset({
    "--host", "--port", "--served-model-name", "--load-format", "--enable-prefix-caching",
    "--enable-auto-tool-choice", "--tool-call-parser", "--enable-prompt-tokens-details",
    "--disable-uvicorn-access-log", "--kv-cache-memory-bytes", "--max-model-len",
    "--kv-offloading-size", "--kv-cache-dtype", "--max-num-seqs", "--max-num-batched-tokens",
    "--enforce-eager"})


def write_fake_vllm(root: Path) -> Path:
    """A ``vllm`` package under ``root`` (returned: a ``PYTHONPATH`` entry) whose CLI appends its
    arguments to the file ``$FAKE_VLLM_ARGV``, refuses options not in `VLLM_FLAGS` (exit 2, as
    argparse does) and serves this stand-in."""
    cli = root / "vllm" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    for d in (root / "vllm", root / "vllm" / "entrypoints", cli):
        (d / "__init__.py").write_text("")
    (cli / "main.py").write_text(
        "import json, os, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from standin_chat_server import VLLM_FLAGS, main\n"
        "with open(os.environ['FAKE_VLLM_ARGV'], 'a') as f:\n"
        "    f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
        "bad = [a for a in sys.argv[3:] if a.startswith('--') and a not in VLLM_FLAGS]\n"
        "if sys.argv[1] != 'serve' or bad:\n"
        "    sys.exit(f'vllm: error: unrecognized arguments: {bad}')\n"
        "main(sys.argv[3:])\n")
    return root


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--first-ms", type=float, default=30.0)
    p.add_argument("--token-ms", type=float, default=2.0)
    a, _ = p.parse_known_args(argv)
    uvicorn.run(build(a.first_ms, a.token_ms), host="127.0.0.1", port=a.port,
                log_level="warning")


if __name__ == "__main__":
    main()
