"""The OpenAI endpoints' logic, independent of the web framework.

`OpenAIServing` validates a request, renders and tokenizes its prompt on its tokenizing thread
(the `Request` is built once, by the engine's immutable `RequestValidator`), queues it on
the engine thread (through `ServerSessions`, for chat) and turns the engine's outputs into
OpenAI responses or server-sent-event chunks. A chat with no grammar to compile or check
(an agent's resume) is sent to the engine thread by the tokenizing thread itself, without a
hop back to the event loop in between (`OpenAIServing._start_direct`).

Work whose cost the client controls runs where it cannot hold anyone else up: the model's own
chat template and the tokenizer on the one tokenizing thread, with the context check made while
tokenizing (a prompt far over the context is refused before all of it is encoded); a client's
chat template (sandboxed, within its `TemplateLimits`) in a process of its own; a new grammar is
checked in the grammar probe's process (within its `GrammarBudget`), then compiled on a
separate pool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import multiprocessing
import os
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel

from edmm.engine import ContextLengthError as EngineContextLengthError
from edmm.engine import Engine, InvalidRequestError, Request, RequestOutput
from edmm.engine.sampling import LogitsProcessor
from edmm.model.errors import PromptTooLongError
from edmm.model.prompt_encoder import PromptEncoder
from edmm.server.chat_prompts import ChatPrompt, ChatPrompts
from edmm.server.engine_loop import EngineLoop, OutputStream, Submission
from edmm.server.errors import (
    APIError,
    BadRequestError,
    ContextLengthError,
    ModelNotFoundError,
    ServiceUnavailableError,
)
from edmm.server.guided import GrammarLogitsProcessor, GuidedDecoding
from edmm.server.incremental import RenderedPrompt
from edmm.server.metrics import EngineSnapshot, ServerMetrics
from edmm.server.prompts import (
    assistant_message,
    check_chat_options,
    client_template,
    client_template_variables,
    encode_prompt,
    parses_tools,
    predicted_messages,
    prompt_limit,
    prompt_too_long,
    sampling_params,
    template_messages,
    template_tools,
    trailing_tool_results,
)
from edmm.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    Completion,
    CompletionChoice,
    CompletionRequest,
    FinishReason,
    FunctionCall,
    FunctionCallDelta,
    ModelCard,
    ModelList,
    NamedToolChoice,
    ResponseMessage,
    ToolCall,
    ToolCallDelta,
    Usage,
    random_id,
)
from edmm.server.sessions import ANONYMOUS, ServerSessions, Turn, TurnEnd
from edmm.server.stages import StageLog, StageTimer
from edmm.server.templates import TemplateLimits, render_client_template
from edmm.server.tool_parser import ParsedReply, ParsedToolCall, StreamingToolParser, parse_reply
from edmm.server.validation import check_conversation, check_text, check_tool_names

SSE_DONE = "data: [DONE]\n\n"
T = TypeVar("T")
Rendered = tuple[Request, RenderedPrompt | None]  # an engine request and its prompt's handle
logger = logging.getLogger(__name__)
TEMPLATE_NICENESS = 10  # the client-template process yields the CPU to the server


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event carrying ``payload`` as JSON."""
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


@dataclass
class ChatTurn:
    """Everything known about a chat request once it is queued."""

    id: str
    request: ChatCompletionRequest
    engine_request: Request
    session_id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    parse_tools: bool
    stream: OutputStream
    last: RequestOutput | None = None
    content: str = ""  # content sent so far (streaming)
    calls: list[ParsedToolCall] = field(default_factory=list)
    cut: bool = False  # the reply ended inside a tool-call block (see tool_parser)
    stages: StageTimer | None = None  # with $EDMM_STAGE_LOG (edmm.server.stages)
    prompt: RenderedPrompt | None = None  # its prompt's handle (`ChatPrompts.prepare_resume`)


class OpenAIServing:
    """Chat and text completions over an `EngineLoop` running a `ServerSessions`.

    ``client_templates``: the limits of client-supplied chat templates; None: they are refused.
    ``salt_per_key``: every request's prefix-cache salt includes its owner (its API key), so
    clients share no cached KV and ``usage.cached_tokens`` tells nothing across them.
    """

    def __init__(self, loop: EngineLoop[ServerSessions], engine: Engine, tokenizer: Any,
                 model_name: str, metrics: ServerMetrics,
                 guided: GuidedDecoding | None,
                 client_templates: TemplateLimits | None = None,
                 salt_per_key: bool = False) -> None:
        self.loop = loop
        self.salt_per_key = salt_per_key
        self.engine = engine
        # The server's own copy, used only on its one tokenizing thread (tokenizers are not
        # shared between threads): rendering a long conversation never blocks the event loop.
        self.tokenizer = tokenizer
        self.encoder = PromptEncoder(tokenizer) if tokenizer is not None else None
        self.prompts = ChatPrompts(tokenizer, self.encoder)  # tokenizing thread only
        self._tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edmm-tokenize")
        # Grammar compilation: never ahead of others' tokenizing.
        self._isolated = ThreadPoolExecutor(max_workers=2, thread_name_prefix="edmm-isolated")
        # Client templates run pure Python for up to their time budget: in a thread they would
        # hold the GIL against the engine thread, so they render in a process of their own.
        self._templates: ProcessPoolExecutor | None = None
        self.client_templates = client_templates
        self.model_name = model_name
        self.metrics = metrics
        self.guided = guided
        self.max_model_len = engine.max_model_len
        self.validator = engine.validator  # immutable: safe off the engine thread
        self.stages = StageLog.from_env()

    def start(self) -> None:
        """Start the client-template process when client templates are on, and wait until
        it renders (its start-up, which imports the template code, is paid by no request and
        never competes with live traffic); probe the model's template for incremental
        rendering (`ChatPrompts.prepare`) on the tokenizing thread."""
        self._tokenizing.submit(self.prompts.prepare).result()
        if self.client_templates is not None:
            self._template_pool().submit(render_client_template, "{{ 1 }}", {},
                                         self.client_templates).result()

    def _template_pool(self) -> ProcessPoolExecutor:
        if self._templates is None:  # below the server's threads on a busy CPU
            self._templates = ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                initializer=os.nice, initargs=(TEMPLATE_NICENESS,))
        return self._templates

    def close(self) -> None:
        """Stop the tokenizing threads (after the work queued on them)."""
        self._tokenizing.shutdown(wait=True)
        self._isolated.shutdown(wait=True)
        if self._templates is not None:
            self._templates.shutdown(wait=True, cancel_futures=True)

    async def _tokenize(self, fn: Callable[..., T], *args: Any) -> T:
        """Run tokenizer work (chat rendering, encoding) on the tokenizing thread."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, fn, *args)

    async def _isolate(self, fn: Callable[..., T], *args: Any) -> T:
        """Run work a client's input may make costly (its chat template, its grammars) on the
        isolated pool."""
        return await asyncio.get_running_loop().run_in_executor(self._isolated, fn, *args)

    async def _chat_ids(self, timer: StageTimer | None, messages: list[dict[str, Any]],
                        tools: list[dict[str, Any]] | None, kwargs: dict[str, Any] | None,
                        limit: int, awaited: bool = False) -> Sequence[int]:
        """Prompt ids of a conversation, refused past ``limit`` tokens; a client's template
        renders on the isolated pool (which reads the tokenizer's special tokens, never runs
        it), the model's on the tokenizing thread (``awaited``: kept for the resume that
        sends it, `ChatPrompts.render`)."""
        if client_template(kwargs, self.client_templates) is None:
            rendered = await self._tokenize(self._render_chat, timer, messages, tools, kwargs,
                                            limit, awaited)
            return rendered.ids
        text = await self._client_template(messages, tools, kwargs)
        return await self._tokenize(encode_prompt, self.tokenizer, self.encoder, text, limit)

    async def _client_template(self, messages: list[dict[str, Any]],
                               tools: list[dict[str, Any]] | None,
                               kwargs: dict[str, Any] | None) -> str:
        """Render a client's chat template in the template process (started on first use;
        restarted if a render killed it, which is a 400 for that request)."""
        source = client_template(kwargs, self.client_templates)
        assert source is not None and self.client_templates is not None
        variables = client_template_variables(self.tokenizer, messages, tools, kwargs)
        pool = self._template_pool()
        try:
            return await asyncio.get_running_loop().run_in_executor(
                pool, render_client_template, source, variables, self.client_templates)
        except BrokenProcessPool:
            if self._templates is pool:
                self._templates = None
            raise BadRequestError("the chat template's render was killed",
                                  param="chat_template_kwargs",
                                  code="chat_template_budget_exceeded") from None

    # ------------------------------------------------------------------ models, metrics
    def models(self) -> ModelList:
        """``GET /v1/models``."""
        return ModelList(data=[ModelCard(id=self.model_name, max_model_len=self.max_model_len)])

    def check_model(self, model: str) -> None:
        """404 unless ``model`` is the served model."""
        if model != self.model_name:
            raise ModelNotFoundError(model)

    async def render_metrics(self) -> bytes:
        """``GET /metrics``: a snapshot from the engine thread, rendered."""
        loop = self.loop
        snap = await loop.run(lambda b: EngineSnapshot.take(b, loop.num_steps, loop.num_streams))
        return self.metrics.render(snap)

    # ------------------------------------------------------------------ chat
    async def start_chat(self, req: ChatCompletionRequest, session_header: str | None,
                         owner: str = ANONYMOUS, timer: StageTimer | None = None,
                         surrogate_free: bool = False) -> ChatTurn:
        """Validate, render and queue a chat request (any error is raised before queuing);
        ``timer``: its stage marks (`OpenAIServing.stages`); ``surrogate_free``: no string of
        ``req`` can hold a lone surrogate (`edmm.server.body`), so `check_text` is
        skipped."""
        _mark(timer, "parsed")
        self.check_model(req.model)
        if not surrogate_free:
            check_text(req.model_dump(by_alias=True, exclude_defaults=True))
        check_chat_options(req)
        check_conversation(req.messages)
        check_tool_names(req.tools)
        messages = template_messages(req.messages)
        tools = template_tools(req.tools)
        _mark(timer, "validated")
        if self._goes_direct(req):
            return await self._start_direct(req, messages, tools, session_header, owner, timer)
        # The grammars compile on the isolated pool while the prompt renders (neither needs
        # the other); a rendering error is still the one reported.
        processors = asyncio.ensure_future(self._chat_processors(req))
        try:
            rendered = await self._chat_request(timer, req, messages, tools)
        except BaseException:
            _discard(processors)
            raise
        _mark(timer, "back")
        procs = await processors  # its error comes before the request's
        if isinstance(rendered, APIError):
            raise rendered
        made, prompt = rendered
        if procs:
            params = sampling_params(req, req.completion_limit,
                                     len(made.prompt_token_ids), self.max_model_len, procs)
            made = dataclasses.replace(made, params=params)
        request = self._salted(made, req.cache_salt, owner)
        _mark(timer, "request_made")
        turn = _turn(req, request, session_header, owner)
        session_id, stream = await self.loop.submit(request.request_id,
                                                    lambda b: _begin(b, turn, timer))
        _mark(timer, "submitted")
        return ChatTurn(random_id("chatcmpl"), req, request, session_id, messages, tools,
                        parses_tools(req), stream, stages=timer, prompt=prompt)

    def _goes_direct(self, req: ChatCompletionRequest) -> bool:
        """Whether `_start_direct` may queue ``req``: the model's template renders it, and it
        has no grammar to enforce or to check (none, or only checks passed before)."""
        if client_template(req.chat_template_kwargs, self.client_templates) is not None:
            return False
        if self.guided is None:
            return not _constrains(req)  # else the usual way refuses it
        try:
            return self.guided.known_to_pass(self.guided.chat_grammars(req))
        except APIError:  # the usual way reports it, in its order
            return False

    async def _start_direct(self, req: ChatCompletionRequest, messages: list[dict[str, Any]],
                            tools: list[dict[str, Any]] | None, session_header: str | None,
                            owner: str, timer: StageTimer | None) -> ChatTurn:
        """`start_chat` for a request `_goes_direct` admits: the tokenizing thread makes the
        engine request and sends it to the engine thread itself (`_queue_rendered`), with no
        hop back to the event loop between; an error of the rendering, the request or its
        session is raised here, and nothing stays queued."""
        submission: Submission[ServerSessions, str] = Submission(self.loop,
                                                                 _new_request_id())
        limit = prompt_limit(self.max_model_len, req.completion_limit)
        try:
            rendered = await self._tokenize(self._queue_rendered, submission, timer, req,
                                            messages, tools, limit, session_header, owner)
            if isinstance(rendered, APIError):
                raise rendered
            made, prompt = rendered
            session_id, stream = await submission.result()
        except BaseException:
            submission.cancel()
            raise
        _mark(timer, "submitted")
        return ChatTurn(random_id("chatcmpl"), req, made, session_id, messages, tools,
                        parses_tools(req), stream, stages=timer, prompt=prompt)

    def _queue_rendered(self, submission: Submission[ServerSessions, str],
                        timer: StageTimer | None, req: ChatCompletionRequest,
                        messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                        limit: int, session_header: str | None,
                        owner: str) -> Rendered | APIError:
        """On the tokenizing thread: `_rendered_request`, salted, sent to the engine thread
        (`_begin`); or the error it gets instead, and nothing is sent."""
        rendered = self._rendered_request(timer, req, messages, tools, limit,
                                          submission.request_id)
        if isinstance(rendered, APIError):
            return rendered
        request = self._salted(rendered[0], req.cache_salt, owner)
        _mark(timer, "request_made")
        turn = _turn(req, request, session_header, owner)
        submission.send(lambda b: _begin(b, turn, timer))
        return request, rendered[1]

    async def _chat_request(self, timer: StageTimer | None, req: ChatCompletionRequest,
                            messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                            ) -> Rendered | APIError:
        """The engine request of a chat (without its grammars) and its prompt's handle, made
        on the tokenizing thread with its prompt ids (no list of ids crosses threads but the
        request's); a rendering error is raised, an error of the request's options or ids
        returned (it comes after the grammars' errors)."""
        kwargs = req.chat_template_kwargs
        limit = prompt_limit(self.max_model_len, req.completion_limit)
        if client_template(kwargs, self.client_templates) is None:
            return await self._tokenize(self._rendered_request, timer, req, messages, tools,
                                        limit)
        text = await self._client_template(messages, tools, kwargs)
        made = await self._tokenize(self._encoded_request, req, text, limit)
        return made if isinstance(made, APIError) else (made, None)

    def _rendered_request(self, timer: StageTimer | None, req: ChatCompletionRequest,
                          messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                          limit: int, request_id: str | None = None) -> Rendered | APIError:
        rendered = self._render_chat(timer, messages, tools, req.chat_template_kwargs, limit)
        made = self._request_of(req, rendered.ids, request_id)
        return made if isinstance(made, APIError) else (made, rendered.prompt)

    def _encoded_request(self, req: ChatCompletionRequest, text: str,
                         limit: int) -> Request | APIError:
        return self._request_of(req, encode_prompt(self.tokenizer, self.encoder, text, limit))

    def _request_of(self, req: ChatCompletionRequest, ids: Sequence[int],
                    request_id: str | None = None) -> Request | APIError:
        """The validated request of ``ids`` (no grammars), or the 400 it gets."""
        try:
            params = sampling_params(req, req.completion_limit, len(ids), self.max_model_len)
            return self._make_request(ids, params, request_id)
        except APIError as e:
            return e

    def _render_chat(self, timer: StageTimer | None, messages: list[dict[str, Any]],
                     tools: list[dict[str, Any]] | None,
                     kwargs: dict[str, Any] | None, limit: int,
                     awaited: bool = False) -> ChatPrompt:
        """`ChatPrompts.render` on the tokenizing thread (incremental where exact; refused
        past ``limit`` tokens); timed when ``timer`` is given."""
        return self.prompts.render(messages, tools, kwargs, limit, timer, awaited)

    async def chat_completion(self, turn: ChatTurn) -> ChatCompletion:
        """Run a queued chat turn to the end: the whole response."""
        try:
            async for out in self._outputs(turn.stream):
                _mark_first_output(turn, out)
                turn.last = out
                _check_grammar(turn.engine_request)
        except BaseException:
            turn.stream.abort()  # no-op once finished
            raise
        reply = self._reply(turn)
        turn.calls, turn.cut = reply.tool_calls, reply.cut
        finish = await self._finish_chat(turn, reply.content)
        message = ResponseMessage(content=reply.content, tool_calls=_tool_calls(reply.tool_calls))
        response = ChatCompletion(id=turn.id, model=self.model_name,
                                  choices=[ChatChoice(index=0, message=message,
                                                      finish_reason=finish)],
                                  usage=self._usage(turn.engine_request, turn.last))
        _mark(turn.stages, "first_event")
        self.stages.write(turn.stages, turn.id, False, len(turn.engine_request.prompt_token_ids))
        return response

    async def chat_stream(self, turn: ChatTurn) -> AsyncIterator[str]:
        """Run a queued chat turn as server-sent events (aborted if the client leaves); an
        error after the stream started is sent as an error event."""
        try:
            async for event in self._chat_events(turn):
                yield event
        except APIError as e:
            yield sse(e.body())
        yield SSE_DONE

    async def _chat_events(self, turn: ChatTurn) -> AsyncIterator[str]:
        yield self._chunk(turn, ChatDelta(role="assistant", content=""))
        parser = StreamingToolParser() if turn.parse_tools else None
        sent = 0
        async for out in self._outputs(turn.stream):
            _mark_first_output(turn, out)
            turn.last = out
            _check_grammar(turn.engine_request)
            text = _stable_text(out, turn.engine_request.params.stop)  # all of it at the end
            delta, sent = self._chat_delta(turn, parser, text, sent)
            if delta is not None:
                event = self._chunk(turn, delta)
                _mark(turn.stages, "first_event")
                yield event
        if parser is not None and turn.last is not None:
            rest = parser.finish(turn.last.outputs[0].text)  # an unclosed or invalid block
            turn.calls, turn.cut = list(parser.calls), parser.cut
            if rest:
                turn.content += rest
                yield self._chunk(turn, ChatDelta(content=rest))
        finish = await self._finish_chat(turn, turn.content or None)
        yield self._chunk(turn, ChatDelta(), finish)
        self.stages.write(turn.stages, turn.id, True, len(turn.engine_request.prompt_token_ids))
        opts = turn.request.stream_options
        if opts is not None and opts.include_usage:
            yield sse(ChatCompletionChunk(id=turn.id, model=self.model_name, choices=[],
                                          usage=self._usage(turn.engine_request, turn.last)))

    def _chat_delta(self, turn: ChatTurn, parser: StreamingToolParser | None, text: str,
                    sent: int) -> tuple[ChatDelta | None, int]:
        """The delta for the stable ``text`` so far, and how much of it is sent."""
        if parser is None:
            if len(text) <= sent:
                return None, sent
            turn.content += text[sent:]
            return ChatDelta(content=text[sent:]), len(text)
        content, fragments = parser.feed(text)
        turn.content += content
        if not content and not fragments:
            return None, sent
        # "type" on every piece: the openai SDK's accumulation overwrites it with each one's.
        deltas = [ToolCallDelta(index=f.index, id=f.id, type="function",
                                function=FunctionCallDelta(name=f.name, arguments=f.arguments))
                  for f in fragments]
        return ChatDelta(content=content or None, tool_calls=deltas or None), sent

    def _chunk(self, turn: ChatTurn, delta: ChatDelta,
               finish: FinishReason | None = None) -> str:
        choice = ChatChunkChoice(index=0, delta=delta, finish_reason=finish)
        return sse(ChatCompletionChunk(id=turn.id, model=self.model_name, choices=[choice]))

    def _reply(self, turn: ChatTurn) -> ParsedReply:
        text = turn.last.outputs[0].text if turn.last is not None else ""
        return parse_reply(text) if turn.parse_tools else ParsedReply(text, [])

    async def _finish_chat(self, turn: ChatTurn, content: str | None) -> FinishReason:
        """Report the turn's end to its session (tool calls: AWAITING_TOOL, speculation
        starts) before the client sees it; return the finish reason."""
        out = turn.last
        assert out is not None
        completion = out.outputs[0]
        awaits = bool(turn.calls) and not turn.cut  # a cut call is not run: no tool window
        if awaits:
            # Shielded: once the reply exists its session must await the calls, even if the
            # client leaves now.
            await asyncio.shield(self._end_turn(turn, content))
        else:  # its KV is no longer held for tool calls; nothing waits for that
            end = TurnEnd(session_id=turn.session_id,
                          request_id=turn.engine_request.request_id, tool_calls=())
            with contextlib.suppress(ServiceUnavailableError):  # the server is closing
                self.loop.call(lambda b: b.end(end)).add_done_callback(_log_failure)
        reason = "tool_calls" if awaits else _reason(completion.finish_reason)
        self._count_finished(out, reason)
        return reason

    async def _end_turn(self, turn: ChatTurn, content: str | None) -> None:
        """Put the turn's session in awaiting-tool (its speculation starts)."""
        ext = turn.request.edmm
        predicted = await self._predicted_prompt(turn, content)
        end = TurnEnd(
            session_id=turn.session_id, request_id=turn.engine_request.request_id,
            tool_calls=turn.calls,
            messages=[*turn.messages, assistant_message(content, turn.calls)],
            tools=turn.tools,
            expected_duration_s=ext.expected_tool_duration_s if ext else None,
            predictions=ext.predicted_tool_results if ext else {},
            predicted_prompt=predicted)
        await self.loop.run(lambda b: b.end(end))
        # While the tool runs: the resume's text around its results, the rest encoded.
        with contextlib.suppress(RuntimeError):  # the server is closing
            self._tokenizing.submit(self.prompts.prepare_resume,
                                    turn.prompt or turn.messages,
                                    assistant_message(content, turn.calls))

    async def _predicted_prompt(self, turn: ChatTurn, content: str | None) -> Sequence[int]:
        """Token ids of the client's predicted next request with this turn's reply
        (`EdmmExtension.predicted_next_messages`), rendered as that request will be; empty
        without one, or when it fails in any way (its text was checked with the request; the
        reply exists already, so only speculation may be lost)."""
        ext = turn.request.edmm
        if ext is None or ext.predicted_next_messages is None:
            return []
        reply = AssistantMessage(role="assistant", content=content,
                                 tool_calls=_tool_calls(turn.calls))
        messages = template_messages(predicted_messages(ext.predicted_next_messages, reply))
        try:
            return await self._chat_ids(None, messages, turn.tools,
                                        turn.request.chat_template_kwargs, self.max_model_len,
                                        awaited=True)
        except Exception as e:  # a hint that fails costs the hint only
            logger.info("session %s: predicted_next_messages ignored: %s", turn.session_id,
                        getattr(e, "message", None) or type(e).__name__)
            return []

    async def _chat_processors(self, req: ChatCompletionRequest) -> list[LogitsProcessor]:
        """Grammar constraints: forced tool calls, or a JSON response format (every tool's
        schema is checked, whatever the choice). New grammars are checked in the probe
        process; the enforced one is then compiled on the isolated pool."""
        if self.guided is None:
            if _constrains(req):
                self._guided()  # the 400
            return []
        guided = self.guided
        grammars = guided.chat_grammars(req)
        await guided.check_isolated(grammars)
        enforced = [g for g in grammars if g.enforced]
        if not enforced:
            return []
        return [await self._isolate(guided.processor, g) for g in enforced]

    def _guided(self) -> GuidedDecoding:
        if self.guided is None:
            raise BadRequestError("constrained decoding needs a model with a tokenizer",
                                  param="tool_choice")
        return self.guided

    # ------------------------------------------------------------------ completions
    async def start_completion(self, req: CompletionRequest, owner: str = ANONYMOUS,
                               ) -> list[tuple[Request, OutputStream]]:
        """Validate and queue every prompt of a text-completion request."""
        self.check_model(req.model)
        check_text(req.model_dump(exclude_defaults=True))
        if req.echo or req.logprobs is not None or req.suffix is not None:
            raise BadRequestError("echo, logprobs and suffix are not supported")
        if req.best_of not in (None, 1):
            raise BadRequestError("best_of is not supported", param="best_of")
        requests = [self._salted(await self._tokenize(self._completion_request, req, p),
                                 req.cache_salt, owner) for p in self._prompts(req.prompt)]
        queued: list[tuple[Request, OutputStream]] = []
        try:
            for request in requests:
                queued.append((request, await self._queue(request)))
        except BaseException:
            for _, stream in queued:
                stream.abort()
            raise
        return queued

    async def completion(self, req: CompletionRequest,
                         queued: list[tuple[Request, OutputStream]]) -> Completion:
        """Run queued prompts to the end: one choice per prompt."""
        choices, usage = [], Usage.of(0, 0, 0)
        try:
            for index, (request, stream) in enumerate(queued):
                last = None
                async for out in self._outputs(stream):
                    last = out
                assert last is not None
                reason = _reason(last.outputs[0].finish_reason)
                self._count_finished(last, reason)
                choices.append(CompletionChoice(index=index, text=last.outputs[0].text,
                                                finish_reason=reason))
                usage = _add_usage(usage, self._usage(request, last))
        finally:  # an error or a client that left: the other prompts stop too
            for _, stream in queued:
                stream.abort()
        return Completion(id=random_id("cmpl"), model=self.model_name, choices=choices,
                          usage=usage)

    async def completion_stream(self, req: CompletionRequest,
                                queued: list[tuple[Request, OutputStream]],
                                ) -> AsyncIterator[str]:
        """Server-sent events of queued prompts, one after the other."""
        cid, usage = random_id("cmpl"), Usage.of(0, 0, 0)
        try:
            for index, (request, stream) in enumerate(queued):
                async for event, last in self._completion_events(cid, index, request, stream):
                    yield event
                    if last is not None:
                        usage = _add_usage(usage, self._usage(request, last))
        except APIError as e:
            yield sse(e.body())
        else:
            if req.stream_options is not None and req.stream_options.include_usage:
                yield sse(Completion(id=cid, model=self.model_name, choices=[], usage=usage))
        finally:
            for _, stream in queued:
                stream.abort()
        yield SSE_DONE

    async def _completion_events(self, cid: str, index: int, request: Request,
                                 stream: OutputStream,
                                 ) -> AsyncIterator[tuple[str, RequestOutput | None]]:
        sent = 0
        async for out in self._outputs(stream):
            text = _stable_text(out, request.params.stop)
            reason = _reason(out.outputs[0].finish_reason) if out.finished else None
            if reason is not None:
                self._count_finished(out, reason)
            if len(text) > sent or reason is not None:
                choice = CompletionChoice(index=index, text=text[sent:], finish_reason=reason)
                yield sse(Completion(id=cid, model=self.model_name, choices=[choice])), (
                    out if out.finished else None)
                sent = len(text)

    def _prompts(self, prompt: str | list[str] | list[int] | list[list[int]],
                 ) -> list[str | list[int]]:
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise BadRequestError("prompt is empty", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]

    def _completion_request(self, req: CompletionRequest, prompt: str | list[int]) -> Request:
        """A validated request of one prompt (on the tokenizing thread)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise BadRequestError("this model has no tokenizer; send token ids",
                                      param="prompt")
            if self.encoder is not None:
                try:  # refused before all of a far too long prompt is encoded
                    self.encoder.check_fits(prompt, prompt_limit(self.max_model_len,
                                                                 req.max_tokens))
                except PromptTooLongError as e:
                    raise prompt_too_long(e, "prompt") from None
            ids = list(self.tokenizer.encode(prompt))
        else:
            ids = prompt
        if not ids:
            raise BadRequestError("prompt is empty", param="prompt")
        params = sampling_params(req, req.max_tokens, len(ids), self.max_model_len)
        return self._make_request(ids, params)

    async def _queue(self, request: Request) -> OutputStream:
        _, stream = await self.loop.submit(request.request_id, lambda b: b.submit(request))
        return stream

    # ------------------------------------------------------------------ shared
    def _salted(self, request: Request, salt: str | None, owner: str) -> Request:
        """``request`` with its prefix-cache salt: the client's ``cache_salt``, and its owner
        when salting per key (joined by a NUL, which no owner contains: unambiguous)."""
        if self.salt_per_key:
            salt = f"{owner}\x00{salt or ''}"
        return request if salt is None else dataclasses.replace(request, cache_salt=salt)

    def _make_request(self, ids: Sequence[int], params: Any,
                      request_id: str | None = None) -> Request:
        """Validate a tokenized request (token ids in the vocabulary, length; a new id unless
        ``request_id``); any thread."""
        try:
            return self.validator.make(request_id or _new_request_id(), ids, params)
        except EngineContextLengthError as e:
            raise ContextLengthError(str(e)) from e
        except InvalidRequestError as e:
            raise BadRequestError(str(e), param="prompt") from e

    async def _outputs(self, stream: OutputStream) -> AsyncIterator[RequestOutput]:
        """The stream's outputs; a request left unfinished is counted as aborted."""
        try:
            async for out in stream.outputs():
                yield out
        finally:
            if stream.aborted:
                self.metrics.requests.finished["abort"] += 1

    def _count_finished(self, out: RequestOutput, reason: str) -> None:
        counters = self.metrics.requests
        counters.finished[reason] += 1
        counters.generation_tokens += len(out.outputs[0].token_ids)

    @staticmethod
    def _usage(request: Request, out: RequestOutput | None) -> Usage:
        completion = len(out.outputs[0].token_ids) if out is not None else 0
        cached = out.num_cached_tokens if out is not None else 0
        return Usage.of(len(request.prompt_token_ids), completion, cached)


def _check_grammar(request: Request) -> None:
    """400 once a grammar of ``request`` stopped over its budget (leaving the output stream
    aborts the request)."""
    for processor in request.params.logits_processors:
        if isinstance(processor, GrammarLogitsProcessor) and processor.failure is not None:
            raise BadRequestError(processor.failure, param=processor.param,
                                  code="grammar_too_costly")


def _log_failure(future: concurrent.futures.Future[Any]) -> None:
    """Log the error of a call on the engine thread that nobody waits for."""
    if not future.cancelled() and (error := future.exception()) is not None:
        logger.warning("engine call failed: %r", error)


def _discard(future: asyncio.Future[Any]) -> None:
    """Cancel ``future``, or if it is done, retrieve its error (none is logged as lost)."""
    if not future.cancel() and not future.cancelled():
        future.exception()


def _mark(timer: StageTimer | None, stage: str) -> None:
    if timer is not None:
        timer.mark(stage)


def _new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def _constrains(req: ChatCompletionRequest) -> bool:
    """Whether ``req`` asks for constrained decoding (a forced tool call or JSON)."""
    return req.tool_choice == "required" or isinstance(req.tool_choice, NamedToolChoice) or (
        req.response_format is not None and req.response_format.type != "text")


def _turn(req: ChatCompletionRequest, request: Request, session_header: str | None,
          owner: str) -> Turn:
    """The `Turn` that names ``request``'s session (the header first, then the body's)."""
    ext = req.edmm
    return Turn(request, session_header or (ext.session_id if ext else None),
                trailing_tool_results(req.messages), owner)


def _mark_first_output(turn: ChatTurn, out: RequestOutput) -> None:
    """Mark the first output's arrival on the event loop, and (first) the engine thread's
    times of its steps (`OutputStream.engine_ns`) and the scheduler's of ``out`` (its first
    admission, its steps waiting for memory: `RequestTiming`)."""
    timer = turn.stages
    if timer is None or "first_output" in timer.marks:
        return
    for stage, ns in zip(("step_start", "output_put"), turn.stream.engine_ns, strict=True):
        if ns is not None:
            timer.marks.setdefault(stage, ns)
    if out.timing is not None:
        if out.timing.first_scheduled_ns is not None:
            timer.marks.setdefault("scheduled", out.timing.first_scheduled_ns)
        timer.counts["memory_wait_steps"] = out.timing.memory_wait_steps
    timer.mark("first_output")


def _begin(backend: ServerSessions, turn: Turn, timer: StageTimer | None) -> Any:
    """``backend.begin(turn)`` on the engine thread, timed when ``timer`` is given."""
    _mark(timer, "engine_picked")
    result = backend.begin(turn)
    _mark(timer, "begun")
    return result


def _reason(value: str | None) -> FinishReason:
    """An engine finish reason as the protocol's (None: stopped)."""
    if value in ("stop", "length", "abort"):
        return value  # type: ignore[return-value]
    return "stop"


def _tool_calls(calls: Sequence[ParsedToolCall]) -> list[ToolCall]:
    return [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in calls]


def _add_usage(a: Usage, b: Usage) -> Usage:
    return Usage.of(a.prompt_tokens + b.prompt_tokens, a.completion_tokens + b.completion_tokens,
                    a.prompt_tokens_details.cached_tokens + b.prompt_tokens_details.cached_tokens)


def _stable_text(out: RequestOutput, stop: Sequence[str]) -> str:
    """The text that can be sent now: all of it once finished; while running, without the
    tail that could still turn out to be the start of a stop string (it would be cut)."""
    text = out.outputs[0].text
    if out.finished or not stop:
        return text
    return text[:max(0, len(text) - (max(map(len, stop)) - 1))]
