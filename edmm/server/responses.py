"""``POST /v1/responses``: OpenAI's Responses API for function-calling agents (what the OpenAI
Agents SDK's default model class sends), served as a chat turn.

A request becomes a `ChatCompletionRequest` (`to_chat`): ``instructions`` a system message;
``input`` a user message (a string) or its items in order: messages (``input_text`` /
``output_text`` parts), ``function_call`` items (consecutive ones one assistant message with
those calls, joined to the assistant message just before), ``function_call_output`` items
(tool messages); ``reasoning`` items are dropped. Function tools, ``tool_choice``,
``parallel_tool_calls``, ``temperature``, ``top_p``, ``max_output_tokens``, ``text.format``
(JSON schema) and ``top_logprobs`` map to the chat fields; the turn then runs as any chat turn
(its agent session, its KV reuse). Nothing is stored: ``store`` is accepted and has no effect,
``previous_response_id`` and ``conversation`` are a 400 (send the whole input), as are
non-function tools and other item types.

The reply is a ``response`` object whose ``output`` holds a ``message`` item (the text) and one
``function_call`` item per tool call; streamed, the Responses events (``response.created``,
``response.output_item.added``, ``response.output_text.delta``,
``response.function_call_arguments.delta`` ... ``response.completed``), made from the chat
turn's own chunks.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import Field

from edmm.server.errors import BadRequestError
from edmm.server.protocol import (
    ChatCompletion,
    ChatCompletionRequest,
    StreamOptions,
    Usage,
    _Lenient,
    _RequestBody,
    now,
    random_id,
)

Item = dict[str, Any]


class ResponseTextFormat(_Lenient):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (name, schema, strict)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "response"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseText(_Lenient):
    format: ResponseTextFormat = Field(default_factory=ResponseTextFormat)


class ResponsesRequest(_RequestBody):
    """``POST /v1/responses`` (the fields this server reads; see the module docstring)."""

    model: str
    input: str | list[Item]
    instructions: str | None = None
    tools: list[Item] | None = None
    tool_choice: str | Item | None = None
    parallel_tool_calls: bool | None = True
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_output_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | Item | None = None
    text: ResponseText | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    metadata: dict[str, str] | None = None
    user: str | None = None


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request of a Responses request (400 for what it cannot carry)."""
    if req.previous_response_id is not None or req.conversation is not None:
        param = "previous_response_id" if req.previous_response_id else "conversation"
        raise BadRequestError("this server stores no responses: send the whole input",
                              param=param)
    body: dict[str, Any] = {
        "model": req.model, "messages": _messages(req), "stream": False,
        "temperature": req.temperature, "top_p": req.top_p,
        "max_completion_tokens": req.max_output_tokens,
        "parallel_tool_calls": req.parallel_tool_calls, "user": req.user,
        **({"tools": [_tool(t, i) for i, t in enumerate(req.tools)]} if req.tools else {}),
        **_tool_choice(req.tool_choice), **_format(req.text),
        **({"logprobs": True, "top_logprobs": req.top_logprobs}
           if req.top_logprobs is not None else {}),
    }
    for name, value in (req.model_extra or {}).items():  # vLLM's extras, the edmm hints
        body.setdefault(name, value)
    return ChatCompletionRequest.model_validate(body)


def _messages(req: ResponsesRequest) -> list[Item]:
    messages: list[Item] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    for index, item in enumerate(req.input):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            messages.append({"role": role, "content": _text(item.get("content"), index)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"),
                                 "arguments": item.get("arguments", "{}")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": _text(item.get("output"), index)})
        elif kind != "reasoning":
            raise BadRequestError(f"input item type {kind!r} is not supported (messages, "
                                  "function_call and function_call_output are)",
                                  param=f"input.{index}")
    return messages


def _text(content: Any, index: int) -> str:
    """A message's text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("input_text",
                                                                      "output_text", "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequestError(f"content part {kind!r} is not supported (text parts "
                                      "are)", param=f"input.{index}")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise BadRequestError("a message needs text content", param=f"input.{index}")


def _tool(tool: Item, index: int) -> Item:
    if tool.get("type") != "function":
        raise BadRequestError(f"tool type {tool.get('type')!r} is not supported (function "
                              "tools are)", param=f"tools.{index}")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _tool_choice(choice: str | Item | None) -> Item:
    if choice is None:
        return {}
    if isinstance(choice, str):
        return {"tool_choice": choice}
    if choice.get("type") == "function":
        return {"tool_choice": {"type": "function", "function": {"name": choice.get("name")}}}
    raise BadRequestError(f"tool_choice {choice!r} is not supported", param="tool_choice")


def _format(text: ResponseText | None) -> Item:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return {}
    if fmt.type == "json_object":
        return {"response_format": {"type": "json_object"}}
    spec = {"name": fmt.name, "schema": fmt.schema_ or {}, "strict": fmt.strict}
    return {"response_format": {"type": "json_schema", "json_schema": spec}}


# ---------------------------------------------------------------------------- responses


def response_object(req: ResponsesRequest, rid: str, created: int, status: str,
                    output: list[Item], usage: Usage | None, incomplete: bool = False,
                    ) -> Item:
    """A ``response`` object (``status``: ``in_progress``, ``completed``, ``incomplete``)."""
    return {
        "id": rid, "object": "response", "created_at": created, "status": status,
        "model": req.model, "output": output, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": req.instructions, "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "temperature": req.temperature, "top_p": req.top_p,
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": req.tools or [], "max_output_tokens": req.max_output_tokens,
        "previous_response_id": None, "store": False, "truncation": "disabled",
        "text": {"format": {"type": "text"}}, "reasoning": None, "user": req.user,
        "usage": _usage(usage),
    }


def _usage(usage: Usage | None) -> Item | None:
    if usage is None:
        return None
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.prompt_tokens_details.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens}


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> Item:
    """An assistant ``message`` output item."""
    return {"type": "message", "id": item_id or random_id("msg"), "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}] if status == "completed" or text else []}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed",
              item_id: str | None = None) -> Item:
    """A ``function_call`` output item."""
    return {"type": "function_call", "id": item_id or random_id("fc"), "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


def from_chat(req: ResponsesRequest, chat: ChatCompletion) -> Item:
    """The ``response`` object of a finished chat turn."""
    choice = chat.choices[0]
    output: list[Item] = []
    if choice.message.content:
        output.append(message_item(choice.message.content))
    for call in choice.message.tool_calls or []:
        output.append(call_item(call.id, call.function.name, call.function.arguments))
    incomplete = choice.finish_reason == "length"
    return response_object(req, random_id("resp"), now(), "incomplete" if incomplete
                           else "completed", output, chat.usage, incomplete)


class ResponseEvents:
    """The Responses stream of a chat turn's chunk events (`events`), numbered in order."""

    def __init__(self, req: ResponsesRequest) -> None:
        self.req = req
        self.rid, self.created = random_id("resp"), now()
        self.seq = 0
        self.output: list[Item] = []
        self.text_item: Item | None = None  # the message being streamed
        self.text = ""
        self.calls: dict[int, Item] = {}  # tool call index -> its item, streaming
        self.usage: Usage | None = None
        self.finish: str | None = None

    def _event(self, kind: str, **fields: Any) -> str:
        self.seq += 1
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    async def events(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        """The events of the turn whose chat SSE ``chunks`` these are (an error event ends
        the stream as a ``response.failed``)."""
        start = response_object(self.req, self.rid, self.created, "in_progress", [], None)
        yield self._event("response.created", response=start)
        yield self._event("response.in_progress", response=start)
        async for chunk in chunks:
            if not chunk.startswith("data: ") or chunk.startswith("data: [DONE]"):
                continue
            data = json.loads(chunk[len("data: "):])
            if "error" in data:
                failed = response_object(self.req, self.rid, self.created, "failed",
                                         self.output, None)
                failed["error"] = data["error"]
                yield self._event("response.failed", response=failed)
                return
            for event in self._chunk(data):
                yield event
        for event in self._close_text():
            yield event
        for index in sorted(self.calls):
            for event in self._close_call(index):
                yield event
        incomplete = self.finish == "length"
        done = response_object(self.req, self.rid, self.created,
                               "incomplete" if incomplete else "completed", self.output,
                               self.usage, incomplete)
        yield self._event("response.incomplete" if incomplete else "response.completed",
                          response=done)

    def _chunk(self, data: Item) -> list[str]:
        if data.get("usage") is not None and not data.get("choices"):
            self.usage = Usage.model_validate(data["usage"])
        events: list[str] = []
        for choice in data.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call_delta(call)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return events

    def _text_delta(self, text: str) -> list[str]:
        events = []
        if self.text_item is None:
            self.text_item = message_item("", "in_progress")
            self.output.append(self.text_item)
            events.append(self._event("response.output_item.added",
                                      output_index=len(self.output) - 1, item=self.text_item))
            events.append(self._event(
                "response.content_part.added", item_id=self.text_item["id"],
                output_index=len(self.output) - 1, content_index=0,
                part={"type": "output_text", "text": "", "annotations": []}))
        self.text += text
        events.append(self._event("response.output_text.delta", item_id=self.text_item["id"],
                                  output_index=self.output.index(self.text_item),
                                  content_index=0, delta=text, logprobs=[]))
        return events

    def _close_text(self) -> list[str]:
        item = self.text_item
        if item is None:
            return []
        index = self.output.index(item)
        done = message_item(self.text, item_id=item["id"])
        self.output[index] = done
        part = done["content"][0]
        self.text_item = None
        return [self._event("response.output_text.done", item_id=item["id"],
                            output_index=index, content_index=0, text=self.text, logprobs=[]),
                self._event("response.content_part.done", item_id=item["id"],
                            output_index=index, content_index=0, part=part),
                self._event("response.output_item.done", output_index=index, item=done)]

    def _call_delta(self, call: Item) -> list[str]:
        events = []
        index = call.get("index", 0)
        function = call.get("function") or {}
        item = self.calls.get(index)
        if item is None:
            events += self._close_text()  # the text before the calls is complete
            item = call_item(call.get("id") or random_id("call"), function.get("name") or "",
                             "", "in_progress")
            self.calls[index] = item
            self.output.append(item)
            events.append(self._event("response.output_item.added",
                                      output_index=len(self.output) - 1, item=dict(item)))
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=item["id"], output_index=self.output.index(item),
                                      delta=function["arguments"]))
        return events

    def _close_call(self, index: int) -> list[str]:
        item = self.calls[index]
        item["status"] = "completed"
        position = self.output.index(item)
        return [self._event("response.function_call_arguments.done", item_id=item["id"],
                            output_index=position, name=item["name"],
                            arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=position,
                            item=dict(item))]


STREAM_USAGE = StreamOptions(include_usage=True)  # a streamed turn's options (for its usage)
