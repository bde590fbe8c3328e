"""The OpenAI endpoints' logic, independent of the web framework: request models in,
responses and server-sent events out.

`OpenAIServing` validates a request, hands it on (a chat turn to `edmm.server.turns.ChatTurns`,
which renders, queues, streams and ends it; a text completion's prompts to the
`RequestPipeline`) and turns the engine's outputs into OpenAI responses or server-sent-event
chunks, counting them in the server's metrics.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from pydantic import BaseModel

from edmm.engine import Engine, Request, RequestOutput
from edmm.server.engine_loop import EngineLoop, OutputStream
from edmm.server.errors import APIError, BadRequestError, ModelNotFoundError
from edmm.server.guided import GuidedDecoding
from edmm.server.metrics import EngineSnapshot, ServerMetrics
from edmm.server.pipeline import RequestPipeline
from edmm.server.prompts import check_chat_options, parses_tools, response_tool_calls
from edmm.server.protocol import (
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
    FunctionCallDelta,
    ModelCard,
    ModelList,
    ResponseMessage,
    ToolCallDelta,
    Usage,
    random_id,
)
from edmm.server.sessions import ANONYMOUS, ServerSessions
from edmm.server.stages import NO_TRACE, StageLog, Tracer
from edmm.server.templates import TemplateLimits
from edmm.server.tool_parser import ParsedReply, StreamingToolParser, parse_reply
from edmm.server.turns import ChatTurns, Turn
from edmm.server.validation import check_conversation, check_text, check_tool_names

SSE_DONE = "data: [DONE]\n\n"


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event carrying ``payload`` as JSON."""
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


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
        self.pipeline = RequestPipeline(loop, engine, tokenizer, metrics.requests, guided,
                                        client_templates, salt_per_key)
        self.turns = ChatTurns(self.pipeline)
        self.model_name = model_name
        self.metrics = metrics
        self.max_model_len = engine.max_model_len
        self.stages = StageLog.from_env()

    def start(self) -> None:
        """Start the request pipeline (`RequestPipeline.start`)."""
        self.pipeline.start()

    def close(self) -> None:
        """Stop the request pipeline's threads (after the work queued on them)."""
        self.pipeline.close()

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
                         owner: str = ANONYMOUS, trace: Tracer = NO_TRACE,
                         surrogate_free: bool = False) -> Turn:
        """Validate a chat request and queue its turn (`ChatTurns.start`; any error is raised
        before queuing); ``trace``: its stage marks (`OpenAIServing.stages`);
        ``surrogate_free``: no string of ``req`` can hold a lone surrogate
        (`edmm.server.body`), so `check_text` is skipped."""
        trace.mark("parsed")
        self.check_model(req.model)
        if not surrogate_free:
            check_text(req.model_dump(by_alias=True, exclude_defaults=True))
        check_chat_options(req)
        check_conversation(req.messages)
        check_tool_names(req.tools)
        return await self.turns.start(req, session_header, owner, trace)

    def abort(self, turn: Turn) -> None:
        """Abort a queued turn's request (no-op once it finished)."""
        if turn.stream is not None:
            turn.stream.abort()

    async def chat_completion(self, req: ChatCompletionRequest, turn: Turn) -> ChatCompletion:
        """Run a queued chat turn to the end: the whole response."""
        last = None
        async for out in self.turns.outputs(turn):
            last = out
        text = last.outputs[0].text if last is not None else ""
        reply = parse_reply(text) if parses_tools(req) else ParsedReply(text, [])
        finish = await self._finish(turn, last, reply)
        message = ResponseMessage(content=reply.content,
                                  tool_calls=response_tool_calls(reply.tool_calls))
        response = ChatCompletion(id=random_id("chatcmpl"), model=self.model_name,
                                  choices=[ChatChoice(index=0, message=message,
                                                      finish_reason=finish)],
                                  usage=_usage(turn.request, last))
        turn.trace.mark("first_event")
        turn.trace.finish(response.id, False, len(turn.request.prompt_token_ids))
        return response

    async def chat_stream(self, req: ChatCompletionRequest,
                          turn: Turn) -> AsyncIterator[str]:
        """Run a queued chat turn as server-sent events (aborted if the client leaves); an
        error after the stream started is sent as an error event."""
        try:
            async for event in self._chat_events(req, turn, random_id("chatcmpl")):
                yield event
        except APIError as e:
            yield sse(e.body())
        yield SSE_DONE

    async def _chat_events(self, req: ChatCompletionRequest, turn: Turn,
                           cid: str) -> AsyncIterator[str]:
        yield self._chunk(cid, ChatDelta(role="assistant", content=""))
        parser = StreamingToolParser() if parses_tools(req) else None
        sent, content, last = 0, "", None
        async for out in self.turns.outputs(turn):
            last = out
            text = _stable_text(out, turn.request.params.stop)  # all of it at the end
            delta, sent = _chat_delta(parser, text, sent)
            if delta is not None:
                content += delta.content or ""
                event = self._chunk(cid, delta)
                turn.trace.mark("first_event")
                yield event
        reply = ParsedReply(content or None, [])
        if parser is not None and last is not None:
            rest = parser.finish(last.outputs[0].text)  # an unclosed or invalid block
            if rest:
                content += rest
                yield self._chunk(cid, ChatDelta(content=rest))
            reply = ParsedReply(content or None, list(parser.calls), parser.cut)
        yield self._chunk(cid, ChatDelta(), await self._finish(turn, last, reply))
        turn.trace.finish(cid, True, len(turn.request.prompt_token_ids))
        opts = req.stream_options
        if opts is not None and opts.include_usage:
            yield sse(ChatCompletionChunk(id=cid, model=self.model_name, choices=[],
                                          usage=_usage(turn.request, last)))

    def _chunk(self, cid: str, delta: ChatDelta, finish: FinishReason | None = None) -> str:
        choice = ChatChunkChoice(index=0, delta=delta, finish_reason=finish)
        return sse(ChatCompletionChunk(id=cid, model=self.model_name, choices=[choice]))

    async def _finish(self, turn: Turn, last: RequestOutput | None,
                      reply: ParsedReply) -> FinishReason:
        """End the turn (`ChatTurns.end`: its session awaits the reply's tool calls, if any,
        before the client sees it); count and return its finish reason."""
        assert last is not None
        awaits = await self.turns.end(turn, reply)
        reason = "tool_calls" if awaits else _reason(last.outputs[0].finish_reason)
        self._count_finished(last, reason)
        return reason

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
        requests = await self.pipeline.completion_requests(req, owner)
        queued: list[tuple[Request, OutputStream]] = []
        try:
            for request in requests:
                queued.append((request, await self.pipeline.queue(request)))
        except BaseException:
            abort_all([stream for _, stream in queued])
            raise
        return queued

    async def completion(self, req: CompletionRequest,
                         queued: list[tuple[Request, OutputStream]]) -> Completion:
        """Run queued prompts to the end: one choice per prompt."""
        choices, usage = [], Usage.of(0, 0, 0)
        try:
            for index, (request, stream) in enumerate(queued):
                last = None
                async for out in self.pipeline.outputs(stream):
                    last = out
                assert last is not None
                reason = _reason(last.outputs[0].finish_reason)
                self._count_finished(last, reason)
                choices.append(CompletionChoice(index=index, text=last.outputs[0].text,
                                                finish_reason=reason))
                usage = _add_usage(usage, _usage(request, last))
        finally:  # an error or a client that left: the other prompts stop too
            abort_all([stream for _, stream in queued])
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
                        usage = _add_usage(usage, _usage(request, last))
        except APIError as e:
            yield sse(e.body())
        else:
            if req.stream_options is not None and req.stream_options.include_usage:
                yield sse(Completion(id=cid, model=self.model_name, choices=[], usage=usage))
        finally:
            abort_all([stream for _, stream in queued])
        yield SSE_DONE

    async def _completion_events(self, cid: str, index: int, request: Request,
                                 stream: OutputStream,
                                 ) -> AsyncIterator[tuple[str, RequestOutput | None]]:
        sent = 0
        async for out in self.pipeline.outputs(stream):
            text = _stable_text(out, request.params.stop)
            reason = _reason(out.outputs[0].finish_reason) if out.finished else None
            if reason is not None:
                self._count_finished(out, reason)
            if len(text) > sent or reason is not None:
                choice = CompletionChoice(index=index, text=text[sent:], finish_reason=reason)
                yield sse(Completion(id=cid, model=self.model_name, choices=[choice])), (
                    out if out.finished else None)
                sent = len(text)

    # ------------------------------------------------------------------ shared
    def _count_finished(self, out: RequestOutput, reason: str) -> None:
        counters = self.metrics.requests
        counters.finished[reason] += 1
        counters.generation_tokens += len(out.outputs[0].token_ids)


def abort_all(streams: Sequence[OutputStream]) -> None:
    """Abort every request of ``streams`` (no-op for the finished ones)."""
    for stream in streams:
        stream.abort()


def _chat_delta(parser: StreamingToolParser | None, text: str,
                sent: int) -> tuple[ChatDelta | None, int]:
    """The delta for the stable ``text`` so far, and how much of it is sent."""
    if parser is None:
        if len(text) <= sent:
            return None, sent
        return ChatDelta(content=text[sent:]), len(text)
    content, fragments = parser.feed(text)
    if not content and not fragments:
        return None, sent
    # "type" on every piece: the openai SDK's accumulation overwrites it with each one's.
    deltas = [ToolCallDelta(index=f.index, id=f.id, type="function",
                            function=FunctionCallDelta(name=f.name, arguments=f.arguments))
              for f in fragments]
    return ChatDelta(content=content or None, tool_calls=deltas or None), sent


def _usage(request: Request, out: RequestOutput | None) -> Usage:
    completion = len(out.outputs[0].token_ids) if out is not None else 0
    cached = out.num_cached_tokens if out is not None else 0
    return Usage.of(len(request.prompt_token_ids), completion, cached)


def _reason(value: str | None) -> FinishReason:
    """An engine finish reason as the protocol's (None: stopped)."""
    if value in ("stop", "length", "abort"):
        return value  # type: ignore[return-value]
    return "stop"


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
