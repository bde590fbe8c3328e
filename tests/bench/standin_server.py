"""A stand-in OpenAI-compatible server for the client-side benches: ``/v1/models`` and streamed
``/v1/completions`` that emit one chunk per token every ``--token-ms`` after ``--first-ms``.

    python tests/bench/standin_server.py --port 8123 [--first-ms 30] [--token-ms 5]
        [--prefill-us-per-token 500]

Its timings are known, so a bench's TTFT and inter-token figures can be checked against them.
With ``--prefill-us-per-token`` it models a prefix cache: the first token also waits that long
per prompt token past the longest prefix shared with any earlier prompt, and ``cached_tokens``
is that prefix (otherwise half the prompt). It counts the requests it served (``GET /stats``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def build(first_ms: float, token_ms: float, prefill_us: float = 0.0) -> FastAPI:
    app = FastAPI()
    served = {"requests": 0}
    seen: list[list[int]] = []

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "standin", "object": "model"}]})

    @app.get("/stats")
    async def stats() -> JSONResponse:
        return JSONResponse(served)

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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--first-ms", type=float, default=30.0)
    p.add_argument("--token-ms", type=float, default=5.0)
    p.add_argument("--prefill-us-per-token", type=float, default=0.0)
    a = p.parse_args()
    uvicorn.run(build(a.first_ms, a.token_ms, a.prefill_us_per_token), host="127.0.0.1",
                port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
