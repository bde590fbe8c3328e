"""From protocol requests to engine inputs: chat-template prompts and `SamplingParams`."""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from typing import Any

from edmm.agent.render import template_view
from edmm.engine import SamplingParams
from edmm.engine.sampling import MAX_LOGPROBS, InvalidSamplingParams, LogitsProcessor
from edmm.model.errors import PromptTooLongError
from edmm.model.prompt_encoder import EncodedText, PromptEncoder, TokenIds
from edmm.server.errors import BadRequestError, ContextLengthError
from edmm.server.protocol import (
    AssistantMessage,
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    FunctionCall,
    SamplingFields,
    SystemMessage,
    ToolCall,
    ToolMessage,
    UserMessage,
    content_text,
    unsupported_field,
)
from edmm.server.templates import TemplateLimits, render_client_template
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


def response_tool_calls(calls: Sequence[ParsedToolCall]) -> list[ToolCall]:
    """Parsed calls as a response carries them."""
    return [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in calls]


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


# Arguments of `apply_chat_template` (and the template's own variables) that
# ``chat_template_kwargs`` may not set: the server sets them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs"})
CLIENT_TEMPLATE_KEY = "chat_template"


def client_template(kwargs: dict[str, Any] | None,
                    limits: TemplateLimits | None) -> str | None:
    """The client's own chat template in ``kwargs`` (None: the model's); 400 for a key the
    server sets, or a template when client templates are off (``limits`` None)."""
    if not kwargs:
        return None
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise BadRequestError(f"chat_template_kwargs may not set {', '.join(reserved)}",
                              param="chat_template_kwargs")
    if CLIENT_TEMPLATE_KEY not in kwargs:
        return None
    if limits is None:
        raise BadRequestError("client chat templates are disabled on this server (the "
                              "operator enables them with --allow-client-chat-template)",
                              param="chat_template_kwargs", code="chat_template_disabled")
    source = kwargs[CLIENT_TEMPLATE_KEY]
    if not isinstance(source, str) or not source:
        raise BadRequestError("chat_template must be a non-empty string",
                              param="chat_template_kwargs")
    return source


def client_template_variables(tokenizer: Any, messages: list[dict[str, Any]],
                              tools: list[dict[str, Any]] | None,
                              kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """What a client's chat template sees (plain data: it can be sent to another process)."""
    rest = {k: v for k, v in (kwargs or {}).items() if k != CLIENT_TEMPLATE_KEY}
    return {**dict(tokenizer.special_tokens_map), **rest, "messages": messages,
            "tools": tools, "add_generation_prompt": True}


def chat_text(tokenizer: Any, messages: list[dict[str, Any]],
              tools: list[dict[str, Any]] | None, kwargs: dict[str, Any] | None,
              limits: TemplateLimits | None = None) -> str:
    """The prompt text of a conversation: the model's chat template (`template_text`), or the
    client's (``chat_template_kwargs.chat_template``, sandboxed within ``limits``) when
    allowed.

    Raises:
        BadRequestError: no template, a key the server sets, a client template while they are
            off, or any failure of the template.
    """
    _require_template(tokenizer)
    source = client_template(kwargs, limits)
    if source is None:
        return template_text(tokenizer, messages, tools, kwargs)
    assert limits is not None
    return render_client_template(
        source, client_template_variables(tokenizer, messages, tools, kwargs), limits)


def template_text(tokenizer: Any, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None, kwargs: dict[str, Any] | None,
                  add_generation_prompt: bool = True) -> str:
    """The model's chat template rendered (``kwargs``: ``chat_template_kwargs`` without a
    client template); with ``add_generation_prompt`` False, the messages alone (a part of a
    prompt, `edmm.server.incremental`).

    Raises:
        BadRequestError: no template, or any failure of the template.
    """
    _require_template(tokenizer)
    try:
        text = tokenizer.apply_chat_template(template_view(tokenizer, messages), tools=tools,
                                             tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             **(kwargs or {}))
    except Exception as e:  # what the input made the template do: a 400
        raise BadRequestError(f"the chat template rejected the messages: "
                              f"{type(e).__name__}: {e}", param="messages") from None
    if not isinstance(text, str):
        raise BadRequestError("the chat template did not render text", param="messages")
    return text


def _require_template(tokenizer: Any) -> None:
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise BadRequestError("this model has no chat template; use /v1/completions",
                              param="messages")


def encode_prompt(tokenizer: Any, encoder: PromptEncoder | None, text: str,
                  limit: int | None = None) -> TokenIds:
    """Prompt token ids of a rendered chat ``text`` (`TokenIds`: bounds checked at C speed by
    the engine's validator, the shared prefix's ints reused); with a ``limit``, 400 as soon as
    it is certainly over ``limit`` tokens (the whole text is not tokenized then)."""
    return encode_prompt_text(tokenizer, encoder, text, limit)[0]


def encode_prompt_text(tokenizer: Any, encoder: PromptEncoder | None, text: str,
                       limit: int | None = None, hint: EncodedText | None = None,
                       keep: bool = True) -> tuple[TokenIds, EncodedText | None]:
    """`encode_prompt` and the handle of the text's ids (`PromptEncoder.encode_text`, whose
    ``hint`` and ``keep`` these are; None without an incremental encoder)."""
    try:
        if encoder is not None:
            return encoder.encode_text(text, limit, hint, keep)
        ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    except PromptTooLongError as e:
        raise prompt_too_long(e) from None
    if limit is not None and len(ids) > limit:
        raise prompt_too_long(PromptTooLongError(limit, len(ids)))
    return TokenIds(ids, array("q", ids)), None


def prompt_too_long(e: PromptTooLongError, param: str = "messages") -> ContextLengthError:
    """The 400 of a prompt over its token limit."""
    return ContextLengthError(
        f"This model's context leaves at most {e.limit} tokens for the prompt (with the "
        f"requested completion). However, your prompt has at least {e.at_least} tokens.",
        param=param)


def prompt_limit(max_model_len: int, completion_limit: int | None) -> int:
    """The most prompt tokens a request may have: the context less its completion (less one
    token when the completion alone does not fit: `sampling_params` then says so)."""
    completion = completion_limit or 1
    return max_model_len - (completion if completion < max_model_len else 1)


def render_chat(tokenizer: Any, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None,
                kwargs: dict[str, Any] | None,
                encoder: PromptEncoder | None = None, limit: int | None = None,
                limits: TemplateLimits | None = None) -> list[int]:
    """Prompt token ids of a conversation rendered whole (`chat_text`, then `encode_prompt`,
    which stops past ``limit`` tokens when one is given)."""
    text = chat_text(tokenizer, messages, tools, kwargs, limits)
    return list(encode_prompt(tokenizer, encoder, text, limit))


def check_chat_options(req: ChatCompletionRequest) -> None:
    """Reject options this server does not implement (rather than ignore them silently), and
    combinations that ask for nothing meaningful."""
    check_known_fields(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise BadRequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
    if req.top_logprobs is not None and req.top_logprobs > MAX_LOGPROBS:
        raise BadRequestError(f"top_logprobs must be at most {MAX_LOGPROBS}",
                              param="top_logprobs")
    if req.n > 1 and _constrains(req):
        raise BadRequestError("n > 1 cannot be combined with constrained decoding (a forced "
                              "tool choice or a JSON response format)", param="n")
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


def _constrains(req: ChatCompletionRequest) -> bool:
    return _is_forced(req) or (req.response_format is not None
                               and req.response_format.type != "text")


def check_known_fields(req: SamplingFields) -> None:
    """400 naming the first field OpenAI or vLLM defines that this server does not implement,
    when the request asks for something with it (`UNSUPPORTED_FIELDS`)."""
    found = unsupported_field(req.model_extra)
    if found is not None:
        name, value = found
        hint = " (use tools and tool_choice)" if name in ("functions", "function_call") else ""
        raise BadRequestError(f"{name} is not supported by this server{hint}; got "
                              f"{_short(value)}", param=name, code="unsupported_parameter")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def chat_logprobs(req: ChatCompletionRequest) -> int | None:
    """The top log probabilities a chat asks for per token (None: no logprobs)."""
    return (req.top_logprobs or 0) if req.logprobs else None


def parses_tools(req: ChatCompletionRequest) -> bool:
    """True when the reply's ``<tool_call>`` blocks become tool calls."""
    return bool(req.tools) and req.tool_choice != "none"


def sampling_params(req: SamplingFields, max_tokens: int | None, prompt_len: int,
                    max_model_len: int,
                    processors: list[LogitsProcessor] | None = None, *,
                    logprobs: int | None = None, ban: Sequence[int] = (),
                    stop_token_ids: Sequence[int] = ()) -> SamplingParams:
    """The engine's params for a request; 400 if it asks for more than the context holds or
    for a value the engine refuses. ``logprobs``: top log probabilities per token (None:
    none); ``ban``: token ids the reply may not contain (besides the request's
    ``logit_bias``); ``stop_token_ids``: besides the request's."""
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
            logits_processors=list(processors or []),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            logit_bias={**logit_bias(req), **dict.fromkeys(ban, -math.inf)},
            logprobs=logprobs,
            stop_token_ids=[*(req.stop_token_ids or []), *stop_token_ids])
    except InvalidSamplingParams as e:
        param = {"logprobs": "top_logprobs" if isinstance(req, ChatCompletionRequest)
                 else "logprobs"}.get(e.field, e.field)
        raise BadRequestError(str(e), param=param) from e


def logit_bias(req: SamplingFields) -> dict[int, float]:
    """The request's ``logit_bias`` with token-id keys (OpenAI sends them as strings)."""
    out: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        try:
            out[int(key)] = value
        except ValueError:
            raise BadRequestError(f"logit_bias keys must be token ids, got {key!r}",
                                  param="logit_bias") from None
    return out
