"""Pydantic models of the OpenAI-compatible protocol (the subset this server implements).

Request models ignore unknown top-level fields (SDKs send many optional ones) but validate the
ones they declare: a field of the wrong type or out of range is a 400. vLLM's extra sampling
fields (``top_k``, ``min_tokens``, ``ignore_eos``) and the ``edmm`` extension are accepted too.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# ---------------------------------------------------------------------------- shared pieces


class _Strict(BaseModel):
    """A nested object: unknown fields are errors (they usually mean a typo)."""

    model_config = ConfigDict(extra="forbid")


class _Lenient(BaseModel):
    """A top-level request body or message: unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")


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
    """``include_usage``: send a last chunk with the usage and no choices."""

    include_usage: bool = False


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


class SamplingFields(_Lenient):
    """Fields shared by chat and text completions."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)  # a string or null is accepted too
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    user: str | None = None
    # vLLM extras
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)  # KV scope
    top_k: int | None = Field(default=None, ge=-1)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False

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
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    edmm: EdmmExtension | None = None

    @property
    def completion_limit(self) -> int | None:
        """``max_completion_tokens``, else ``max_tokens`` (deprecated by OpenAI, still common)."""
        return self.max_completion_tokens or self.max_tokens


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: a text prompt or token ids (or a list of either)."""

    prompt: Prompt
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


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
    """The assistant message of a chat completion choice."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


FinishReason = Literal["stop", "length", "tool_calls", "abort"]


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    finish_reason: FinishReason | None
    logprobs: None = None


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
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: None = None


class Completion(BaseModel):
    """A text completion (streamed chunks have the same shape)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


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
