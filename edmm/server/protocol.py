"""Pydantic models of the OpenAI-compatible protocol (the subset this server implements).

Unknown fields are treated as vLLM's server treats them, everywhere (a request body, a message,
``stream_options``, the ``edmm`` extension): ignored, and named in a debug log line. The fields
a request model declares are validated: a wrong type or a value out of range is a 400. A field
that OpenAI or vLLM defines and this server cannot honour is a 400 naming it whenever it asks
for something (`UNSUPPORTED_FIELDS`; its neutral values pass), never silently ignored. vLLM's
extra sampling fields (``top_k``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``cache_salt``) and the ``edmm`` extension are accepted too.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------- shared pieces


class _Lenient(BaseModel):
    """An object of a request: unknown fields are dropped, as vLLM's server does, and named in
    a debug log line."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="wrap")
    @classmethod
    def _log_unknown(cls, data: Any, handler: Any) -> Any:
        if isinstance(data, dict):
            known = {f.alias or name for name, f in cls.model_fields.items()} | set(
                cls.model_fields)
            unknown = [k for k in data if k not in known]
            if unknown:
                logger.debug("%s: ignored unknown fields %s", cls.__name__, unknown)
        return handler(data)


_Strict = _Lenient  # one rule for every object of a request (the module docstring)


class _RequestBody(BaseModel):
    """A top-level request body: unknown fields are kept aside (``model_extra``, for
    `unsupported_field`) and otherwise ignored, as vLLM's server does."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _log_unknown(self) -> _RequestBody:
        if self.model_extra:
            logger.debug("%s: ignored unknown fields %s", type(self).__name__,
                         sorted(self.model_extra))
        return self

# Fields OpenAI or vLLM defines that this server does not implement, with the values that ask
# for nothing (a request may send those); any other value is a 400 naming the field.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "functions": (None, []), "function_call": (None, "none", "auto"),  # legacy: use tools
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
    "web_search_options": (None,), "use_beam_search": (None, False), "min_p": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0), "length_penalty": (None, 1, 1.0),
    "include_stop_str_in_output": (None, False), "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True), "truncate_prompt_tokens": (None,),
    "prompt_logprobs": (None,), "logprob_token_ids": (None,), "allowed_token_ids": (None,),
    "bad_words": (None, []), "add_generation_prompt": (None, True),
    "continue_final_message": (None, False), "add_special_tokens": (None, False),
    "documents": (None,), "chat_template": (None,), "mm_processor_kwargs": (None,),
    "media_io_kwargs": (None,), "structured_outputs": (None,), "guided_json": (None,),
    "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "return_tokens_as_token_ids": (None, False), "return_token_ids": (None, False),
    "return_token_offsets": (None, False), "return_prompt_text": (None, False),
    "return_assistant_tokens_mask": (None, False), "kv_transfer_params": (None,),
    "ec_transfer_params": (None,), "vllm_xargs": (None,), "repetition_detection": (None,),
    "thinking_token_budget": (None,), "priority": (None, 0), "echo": (None, False),
    "suffix": (None,), "best_of": (None, 1), "prompt_embeds": (None,),
}


def unsupported_field(extra: dict[str, Any] | None) -> tuple[str, Any] | None:
    """The first of a request's unknown fields (``model_extra``) that `UNSUPPORTED_FIELDS`
    names with a value asking for something, and that value; None if there is none."""
    for name, value in (extra or {}).items():
        neutral = UNSUPPORTED_FIELDS.get(name)
        if neutral is not None and not any((value == v and type(value) is type(v))
                                           or value is v for v in neutral):
            return name, value
    return None


def random_id(prefix: str) -> str:
    """An OpenAI-style object id, e.g. ``chatcmpl-5f0c...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """Unix time in seconds (the ``created`` field)."""
    return int(time.time())


class TextPart(_Strict):
    """A text content part; other part types (images, audio) are not supported."""

    type: Literal["text"]
    text: str


Content = str | list[TextPart]


def content_text(content: Content | None) -> str | None:
    """The text of a message content: the string, or its text parts joined."""
    if content is None or isinstance(content, str):
        return content
    return "".join(part.text for part in content)


# ---------------------------------------------------------------------------- tools


class FunctionDefinition(_Lenient):
    """A function a tool exposes; ``parameters`` is a JSON schema of its arguments."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Lenient):
    """``{"type": "function", "function": {...}}``."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(_Strict):
    """The function of a named tool choice."""

    name: str


class NamedToolChoice(_Strict):
    """``{"type": "function", "function": {"name": ...}}``: call exactly this function."""

    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Lenient):
    """A call's function name and its arguments as a JSON string."""

    name: str
    arguments: str


class ToolCall(_Lenient):
    """A tool call in an assistant message or a response."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


# ---------------------------------------------------------------------------- messages


class SystemMessage(_Lenient):
    role: Literal["system", "developer"]
    content: Content
    name: str | None = None


class UserMessage(_Lenient):
    role: Literal["user"]
    content: Content
    name: str | None = None


class AssistantMessage(_Lenient):
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None
    name: str | None = None


class ToolMessage(_Lenient):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


ChatMessage = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage,
                        Field(discriminator="role")]


# ---------------------------------------------------------------------------- request options


class StreamOptions(_Strict):
    """``include_usage``: send a last chunk with the usage and no choices;
    ``continuous_usage_stats`` (vLLM's): every chunk carries the usage so far;
    ``include_obfuscation`` (OpenAI's): every delta chunk carries an ``obfuscation`` field of
    random characters that hides the length of its content (off unless asked for, as vLLM's
    server sends none)."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False
    include_obfuscation: bool | None = False


class JsonSchemaSpec(_Lenient):
    """The ``json_schema`` of a ``response_format``."""

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class ResponseFormat(_Strict):
    """``text``, ``json_object`` (any JSON object) or ``json_schema`` (constrained decoding)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class EdmmExtension(_Strict):
    """The ``edmm`` extra body field: hints for execution-aware sessions.

    The predictions are hints: they are sent on the request whose response will carry tool
    calls, prefilled speculatively while the tools run, and at resume only the longest common
    token prefix of the real prompt with them is reused. A wrong prediction costs speculation
    only, never a different output; they are ignored when the response has no tool calls.

    Attributes:
        session_id: the agent session this request continues (same as the ``X-Session-Id``
            header; the header wins).
        predicted_tool_results: tool_call_id (or tool name) -> the result the client expects
            that call to return, rendered as the tool message appended after the reply.
        predicted_next_messages: the ``messages`` the client expects to send on the request
            that returns this response's tool results, when they differ from this request's
            by more than appended tool messages (e.g. a result inserted into an earlier
            message, as a memory block). The list is that whole request's messages *without*
            the reply (unknown yet): the conversation, then one ``tool`` message per call. The
            server inserts its reply (the assistant message as the response carries it) before
            the trailing tool messages, which take the reply's call ids in order (their
            ``tool_call_id`` may be anything, e.g. the tool name), and renders the result with
            the chat template exactly as a real request with this request's ``tools`` and
            ``chat_template_kwargs``. A malformed list is a 400; one the chat template
            rejects, or longer than the context, is ignored.
        expected_tool_duration_s: how long the client expects the tools of this response to
            run; guides whether the session's KV is kept, offloaded or dropped meanwhile.
        discard_pending_calls: the session this request names awaits tool results that the
            request does not carry: drop those calls and start a new turn (without it, such
            a request is a 409 and the session keeps waiting for them).
    """

    session_id: str | None = Field(default=None, min_length=1, max_length=256)
    predicted_tool_results: dict[str, str] = Field(default_factory=dict)
    predicted_next_messages: list[ChatMessage] | None = None
    expected_tool_duration_s: float | None = Field(default=None, ge=0)
    discard_pending_calls: bool = False

    @field_validator("predicted_next_messages")
    @classmethod
    def _ends_in_tool_messages(cls, v: list[ChatMessage] | None) -> list[ChatMessage] | None:
        if v is not None and (not v or not isinstance(v[-1], ToolMessage)
                              or all(isinstance(m, ToolMessage) for m in v)):
            raise ValueError("predicted_next_messages must be a conversation followed by the "
                             "tool messages of this response's calls")
        return v


class SamplingFields(_RequestBody):
    """Fields shared by chat and text completions."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=128)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stop: list[str] = Field(default_factory=list)  # a string or null is accepted too
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)  # KV scope
    top_k: int | None = Field(default=None, ge=-1)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be defined when stream is true")
        return self

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else [] if v is None else v

    @field_validator("stop")
    @classmethod
    def _stop_limits(cls, v: list[str]) -> list[str]:
        if len(v) > 16 or any(not s for s in v):
            raise ValueError("stop must be at most 16 non-empty strings")
        return v


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = True
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0)
    chat_template_kwargs: dict[str, Any] | None = None
    edmm: EdmmExtension | None = None

    @property
    def completion_limit(self) -> int | None:
        """``max_completion_tokens``, else ``max_tokens`` (deprecated by OpenAI, still common)."""
        return self.max_completion_tokens or self.max_tokens


# Smart-mode union: the exact match wins whatever the order, but each member that fails costs
# a full pass with an error per item; token ids first (the long case: 8K ids 1.8 -> 0.3 ms).
Prompt = list[int] | str | list[str] | list[list[int]]


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: a text prompt or token ids (or a list of either)."""

    prompt: Prompt
    logprobs: int | None = Field(default=None, ge=0)


# ---------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    """``cached_tokens``: prompt tokens whose KV was reused instead of computed."""

    cached_tokens: int = 0


class Usage(BaseModel):
    """Token counts of a response."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int) -> Usage:
        """Usage of ``prompt`` + ``completion`` tokens, ``cached`` of them reused."""
        return cls(prompt_tokens=prompt, completion_tokens=completion,
                   total_tokens=prompt + completion,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class ResponseMessage(BaseModel):
    """The assistant message of a chat completion choice (``tool_calls`` left out when there
    are none, as OpenAI does)."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=lambda v: not v)


FinishReason = Literal["stop", "length", "tool_calls", "abort"]


class TopLogprob(BaseModel):
    """One of the most likely tokens at a place: its text, log probability and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    """A generated token's log probability, with the most likely tokens at its place."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """A chat choice's ``logprobs``: one entry per generated token."""

    content: list[TokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """A text completion choice's ``logprobs`` (the legacy format)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(BaseModel):
    """A non-streamed chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A piece of a tool call in a streamed chunk: the first has ``id``, ``type`` and the
    function's ``name`` (``arguments`` ""), the next ones pieces of ``arguments``."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: FinishReason | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion (``obfuscation``: only with
    ``stream_options.include_obfuscation``)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    obfuscation: str | None = Field(default=None, exclude_if=lambda v: v is None)


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    """A text completion (streamed chunks have the same shape)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    obfuscation: str | None = Field(default=None, exclude_if=lambda v: v is None)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "edmm"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ToolOutputRequest(_Strict):
    """``POST /v1/edmm/sessions/{id}/tool_output``: a chunk of a pending call's output.

    ``final`` marks the last chunk (the output is complete; the next request carries it).
    """

    tool_call_id: str
    content: str
    final: bool = False
