"""Stand-in OpenAI-compatible servers for the client-side benches and the agent replay's peer
tests. Their timings are known, so a bench's TTFT and inter-token figures can be checked against
them. Both serve ``/v1/models`` and ``GET /stats`` (counters of what they served).

    python tests/bench/standin_server.py --port 8123 [--first-ms 30] [--token-ms 5]
        [--prefill-us-per-token 500]
    python tests/bench/standin_server.py --chat --port 8123 [--first-ms 30] [--token-ms 2]

The completions server (`build`) streams ``/v1/completions`` with one chunk per token every
``--token-ms`` after ``--first-ms``. With ``--prefill-us-per-token`` it models a prefix cache:
the first token also waits that long per prompt token past the longest prefix shared with any
earlier prompt, and ``cached_tokens`` is that prefix (otherwise half the prompt). ``/stats``
counts the requests it served.

The chat server (`build_chat`, ``--chat``) streams ``/v1/chat/completions`` (a named
``tool_choice`` answers with one tool call; otherwise ``max_tokens`` content chunks; a request
that is not streamed gets the same reply in one message after the same waits; a body with
EDMM's ``edmm`` extension is refused with a 400, which vLLM would ignore), keeps a
prefix cache over whitespace-separated words (``usage`` reports the words of the rendered
messages as prompt tokens and the longest prefix shared with an earlier prompt as cached), and
serves vLLM-style ``/metrics``. It waits ``--first-ms`` before the first chunk and ``--token-ms``
between content chunks. ``/stats`` counts the chat requests, those with a named tool choice, and
any other request (an EDMM-only endpoint called against a peer would show up there). Options it
does not know are ignored: `write_fake_vllm` passes it ``vllm serve``'s own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse


def common_prefix(a: Sequence[object], b: Sequence[object]) -> int:
    """How many leading items ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def stub_app(served: dict[str, int]) -> FastAPI:
    """An app serving ``GET /v1/models`` (one model, ``standin``) and ``GET /stats`` (``served``
    as it is at the time of the request: the caller's routes count into it)."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "standin", "object": "model"}]})

    @app.get("/stats")
    async def stats() -> JSONResponse:
        return JSONResponse(served)

    return app


def build(first_ms: float, token_ms: float, prefill_us: float = 0.0) -> FastAPI:
    served = {"requests": 0}
    app = stub_app(served)
    seen: list[list[int]] = []

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        served["requests"] += 1
        n, prompt = int(body["max_tokens"]), body["prompt"]
        cached = len(prompt) // 2
        if prefill_us > 0:
            cached = max((common_prefix(prompt, p) for p in seen), default=0)
            seen.append(prompt)

        async def events() -> AsyncIterator[str]:
            await asyncio.sleep(first_ms / 1e3 + (len(prompt) - cached) * prefill_us / 1e6)
            for i in range(n):
                if i:
                    await asyncio.sleep(token_ms / 1e3)
                chunk = {"choices": [{"index": 0, "text": f" t{i}",
                                      "finish_reason": "length" if i == n - 1 else None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            usage = {"prompt_tokens": len(prompt), "completion_tokens": n,
                     "prompt_tokens_details": {"cached_tokens": cached}}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def words_of(body: dict[str, Any]) -> list[str]:
    """The prompt as words: every message's role and content, and the tools' JSON."""
    out = [w for t in body.get("tools") or () for w in json.dumps(t, sort_keys=True).split()]
    for m in body["messages"]:
        out.append(f"<{m['role']}>")
        out += (m.get("content") or "").split()
        for call in m.get("tool_calls") or ():
            out += [call["function"]["name"], call["function"]["arguments"]]
    return out


def build_chat(first_ms: float, token_ms: float) -> FastAPI:
    served = {"chat": 0, "forced": 0, "other": 0, "running": 0}
    app = stub_app(served)
    cache = {"queries": 0, "hits": 0}
    prompts: list[list[str]] = []

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
    async def chat(request: Request) -> Response:
        body = await request.json()
        if "edmm" in body:  # vLLM would ignore it; refused, so that a test sees it reach a peer
            served["other"] += 1
            return JSONResponse({"error": {"message": "unknown field: edmm"}}, status_code=400)
        served["chat"] += 1
        words = words_of(body)
        cached = max((common_prefix(words, p) for p in prompts), default=0)
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

        async def whole() -> JSONResponse:  # not streamed: the same reply in one message
            chunks = [json.loads(e[6:]) async for e in events() if e != "data: [DONE]\n\n"]
            deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]  # the last: the usage
            text = "".join(d.get("content") or "" for d in deltas)
            calls = [{k: v for k, v in call.items() if k != "index"}
                     for d in deltas for call in d.get("tool_calls") or ()]
            message: dict[str, Any] = {"role": "assistant", "content": text or None,
                                       **({"tool_calls": calls} if calls else {})}
            finish = chunks[-2]["choices"][0]["finish_reason"]
            return JSONResponse({"id": "c", "object": "chat.completion", "created": 0,
                                 "model": "standin", "usage": chunks[-1]["usage"],
                                 "choices": [{"index": 0, "message": message,
                                              "finish_reason": finish}]})

        if not body.get("stream"):
            return await whole()
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
    "--enforce-eager", "--structured-outputs-config"})


def write_fake_vllm(root: Path) -> Path:
    """A ``vllm`` package under ``root`` (returned: a ``PYTHONPATH`` entry) whose CLI appends its
    arguments to the file ``$FAKE_VLLM_ARGV``, refuses options not in `VLLM_FLAGS` (exit 2, as
    argparse does) and serves the stand-in chat server."""
    cli = root / "vllm" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    for d in (root / "vllm", root / "vllm" / "entrypoints", cli):
        (d / "__init__.py").write_text("")
    (cli / "main.py").write_text(
        "import json, os, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from standin_server import VLLM_FLAGS, main\n"
        "with open(os.environ['FAKE_VLLM_ARGV'], 'a') as f:\n"
        "    f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
        "bad = [a for a in sys.argv[3:] if a.startswith('--') and a not in VLLM_FLAGS]\n"
        "if sys.argv[1] != 'serve' or bad:\n"
        "    sys.exit(f'vllm: error: unrecognized arguments: {bad}')\n"
        "main(['--chat', *sys.argv[3:]])\n")
    return root


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--first-ms", type=float, default=30.0)
    p.add_argument("--token-ms", type=float, help="default 5, or 2 with --chat")
    p.add_argument("--prefill-us-per-token", type=float, default=0.0,
                   help="the completions server's prefix cache (not with --chat)")
    p.add_argument("--chat", action="store_true",
                   help="serve chat completions; options it does not know are ignored")
    a, unknown = p.parse_known_args(argv)
    if a.chat:
        app = build_chat(a.first_ms, 2.0 if a.token_ms is None else a.token_ms)
    elif unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    else:
        app = build(a.first_ms, 5.0 if a.token_ms is None else a.token_ms,
                    a.prefill_us_per_token)
    uvicorn.run(app, host="127.0.0.1", port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
