"""Helpers of the proxy tests: a scripted fake vLLM, shared requests (`loopback.serve_app`
runs it on a port)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from edmm.proxy import Proxy

ARGS = '{"city":"Paris" ,  "unit":"celsius"}'  # as a model may emit it: odd spacing
TOOLS: list[dict[str, Any]] = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                       "required": ["city"]},
    },
}]
QUESTION = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather in Paris today?"}]


def free_port_url() -> str:
    """A loopback URL nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


class FakeVLLM:
    """A scripted upstream that records what it receives.

    Chat: a request with tools whose last message is the user's gets a ``get_weather`` tool
    call (arguments `ARGS`), anything else the text ``done``; model ``broken`` gets a 400
    OpenAI error; a stream of model ``slow`` holds its end until `release` is set.
    Completions (the speculations) answer one token, or 500 for model ``fail``.
    """

    def __init__(self) -> None:
        self.chats: list[dict[str, Any]] = []
        self.completions: list[dict[str, Any]] = []
        self.release = threading.Event()
        self.app = FastAPI()
        self.app.post("/v1/chat/completions")(self._chat)
        self.app.post("/v1/completions")(self._completion)
        self.app.get("/v1/models")(self._models)

    async def _models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "tiny", "object": "model"}]}

    async def _completion(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.completions.append(body)
        if body.get("model") == "fail":
            return JSONResponse({"error": {"message": "boom", "type": "x"}}, status_code=500)
        return JSONResponse({"object": "text_completion",
                             "choices": [{"index": 0, "text": "x", "finish_reason": "length"}]})

    async def _chat(self, request: Request) -> Any:
        body = await request.json()
        self.chats.append({"body": body, "headers": dict(request.headers)})
        if body.get("model") == "broken":
            return JSONResponse({"error": {"message": "no such model", "type": "NotFoundError",
                                           "param": None, "code": 404}}, status_code=404)
        call = bool(body.get("tools")) and body["messages"][-1]["role"] == "user"
        if not body.get("stream"):
            msg: dict[str, Any] = {"role": "assistant", "content": None if call else "done"}
            if call:
                msg["tool_calls"] = [{"id": "call-1", "type": "function", "function": {
                    "name": "get_weather", "arguments": ARGS}}]
            return {"id": "c1", "object": "chat.completion", "choices": [
                {"index": 0, "message": msg,
                 "finish_reason": "tool_calls" if call else "stop"}]}
        return StreamingResponse(self._stream(body, call), media_type="text/event-stream")

    async def _stream(self, body: dict[str, Any], call: bool) -> AsyncIterator[bytes]:
        deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
        if call:
            deltas.append({"tool_calls": [{"index": 0, "id": "call-1", "type": "function",
                                           "function": {"name": "get_weather"}}]})
            deltas += [{"tool_calls": [{"index": 0, "function": {"arguments": ARGS[i:i + 7]}}]}
                       for i in range(0, len(ARGS), 7)]
        else:
            deltas += [{"content": "do"}, {"content": "ne"}]
        for i, delta in enumerate(deltas):
            event = {"id": "c1", "object": "chat.completion.chunk",
                     "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
            yield f"data: {json.dumps(event)}\n\n".encode()
            if i == 0 and body.get("model") == "slow":
                await asyncio.to_thread(self.release.wait, 30)
        yield b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}\n\n'
        yield b"data: [DONE]\n\n"


@dataclass
class Setup:
    """The fake upstream, the proxy object, and the proxy's base URL."""

    fake: FakeVLLM
    proxy: Proxy
    url: str
