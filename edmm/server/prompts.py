"""From protocol requests to engine inputs: chat-template prompts and `SamplingParams`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jinja2

from edmm.engine import SamplingParams
from edmm.engine.sampling import InvalidSamplingParams, LogitsProcessor
from edmm.model.prompt_encoder import PromptEncoder
from edmm.server.errors import BadRequestError, ContextLengthError
from edmm.server.protocol import (
    AssistantMessage,
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    SamplingFields,
    SystemMessage,
    ToolMessage,
    UserMessage,
    content_text,
)
from edmm.server.tool_parser import ParsedToolCall

# OpenAI's default temperature (and top_p) when a request sets none.
DEFAULT_TEMPERATURE = 1.0


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template reads them (plain dicts, text content)."""
    return [_template_message(m) for m in messages]


def _template_message(m: ChatMessage) -> dict[str, Any]:
    if isinstance(m, SystemMessage):
        return {"role": "system", "content": content_text(m.content)}
    if isinstance(m, UserMessage):
        return {"role": "user", "content": content_text(m.content)}
    if isinstance(m, ToolMessage):
        return {"role": "tool", "content": content_text(m.content),
                "tool_call_id": m.tool_call_id}
    out: dict[str, Any] = {"role": "assistant", "content": content_text(m.content) or ""}
    if m.reasoning_content is not None:
        out["reasoning_content"] = m.reasoning_content
    if m.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    return out


def assistant_message(content: str | None, calls: Sequence[ParsedToolCall]) -> dict[str, Any]:
    """The template message of a reply, as a client will send it back."""
    out: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}}
                             for c in calls]
    return out


def predicted_messages(predicted: Sequence[ChatMessage],
                       reply: AssistantMessage) -> list[ChatMessage]:
    """A predicted next request's messages (`EdmmExtension.predicted_next_messages`) completed
    with the ``reply`` (as the response carries it): inserted before the trailing tool
    messages, which take the reply's call ids in order."""
    n = len(trailing_tool_results(predicted))
    head, tail = list(predicted[:len(predicted) - n]), list(predicted[len(predicted) - n:])
    ids = [c.id for c in reply.tool_calls or []]
    tail = [m.model_copy(update={"tool_call_id": i}) for m, i in zip(tail, ids, strict=False)
            ] + tail[len(ids):]
    return [*head, reply, *tail]


def template_tools(tools: Sequence[ChatTool] | None) -> list[dict[str, Any]] | None:
    """Tools as the chat template reads them."""
    if not tools:
        return None
    return [t.model_dump(exclude_none=True) for t in tools]


def trailing_tool_results(messages: Sequence[ChatMessage]) -> list[tuple[str, str]]:
    """``(tool_call_id, content)`` of the tool messages that end the conversation."""
    out: list[tuple[str, str]] = []
    for m in reversed(messages):
        if not isinstance(m, ToolMessage):
            break
        out.append((m.tool_call_id, content_text(m.content) or ""))
    return out[::-1]


def render_chat(tokenizer: Any, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None,
                kwargs: dict[str, Any] | None,
                encoder: PromptEncoder | None = None) -> list[int]:
    """Prompt token ids of a conversation, rendered with the tokenizer's chat template
    (encoded through ``encoder``, which reuses recent prompts' ids, when given)."""
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise BadRequestError("this model has no chat template; use /v1/completions",
                              param="messages")
    if kwargs and not kwargs.keys().isdisjoint({"tokenize", "tools", "conversation"}):
        raise BadRequestError("chat_template_kwargs may not set tokenize, tools or conversation",
                              param="chat_template_kwargs")
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=True,
                                             **(kwargs or {}))
    except jinja2.TemplateError as e:
        raise BadRequestError(f"the chat template rejected the messages: {e}",
                              param="messages") from e
    if encoder is not None:
        return encoder.encode(text)
    return list(tokenizer.encode(text, add_special_tokens=False))


def check_chat_options(req: ChatCompletionRequest) -> None:
    """Reject options this server does not implement (rather than ignore them silently)."""
    if req.logprobs or req.top_logprobs:
        raise BadRequestError("logprobs are not supported", param="logprobs")
    choice = req.tool_choice
    if choice is not None and choice != "none" and not req.tools:
        raise BadRequestError("tool_choice needs tools", param="tool_choice")
    if choice is not None and not isinstance(choice, str):
        names = [t.function.name for t in req.tools or []]
        if choice.function.name not in names:
            raise BadRequestError(f"tool_choice names an unknown function "
                                  f"{choice.function.name!r}", param="tool_choice")
    if _is_forced(req) and req.response_format is not None and req.response_format.type != "text":
        raise BadRequestError("response_format cannot be combined with a forced tool choice",
                              param="response_format")


def _is_forced(req: ChatCompletionRequest) -> bool:
    return req.tool_choice is not None and req.tool_choice not in ("none", "auto")


def parses_tools(req: ChatCompletionRequest) -> bool:
    """True when the reply's ``<tool_call>`` blocks become tool calls."""
    return bool(req.tools) and req.tool_choice != "none"


def sampling_params(req: SamplingFields, max_tokens: int | None, prompt_len: int,
                    max_model_len: int,
                    processors: list[LogitsProcessor] | None = None) -> SamplingParams:
    """The engine's params for a request; 400 if it asks for more than the context holds."""
    _check_common_options(req)
    limit = max_model_len - prompt_len
    if limit < 1:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"messages resulted in {prompt_len} tokens, which leaves no room for a completion.")
    if max_tokens is not None and max_tokens > limit:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or "
            "completion.", param="max_tokens")
    try:
        return SamplingParams(
            temperature=DEFAULT_TEMPERATURE if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k, seed=req.seed,
            max_tokens=max_tokens or limit, stop=list(req.stop),
            min_tokens=min(req.min_tokens, max_tokens or limit), ignore_eos=req.ignore_eos,
            logits_processors=list(processors or []))
    except InvalidSamplingParams as e:
        raise BadRequestError(str(e), param=e.field) from e


def _check_common_options(req: SamplingFields) -> None:
    if req.n != 1:
        raise BadRequestError("only n=1 is supported", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise BadRequestError(f"{name} is not supported", param=name)
