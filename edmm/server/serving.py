"""The OpenAI endpoints' logic, independent of the web framework: request models in,
responses and server-sent events out.

`OpenAIServing` validates a request, hands it on (a chat turn to `edmm.server.turns.ChatTurns`,
which renders, queues, streams and ends it; a text completion's prompts to the
`RequestPipeline`) and turns the engine's outputs into OpenAI responses or server-sent-event
chunks, counting them in the server's metrics.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import secrets
from collections.abc import AsyncIterator, Sequence
from typing import Any

from pydantic import BaseModel

from edmm.engine import Engine, Request, RequestOutput, TokenLogprobs
from edmm.engine.sampling import MAX_LOGPROBS
from edmm.server.engine_loop import EngineLoop, OutputStream
from edmm.server.errors import APIError, BadRequestError, ModelNotFoundError
from edmm.server.guided import GuidedDecoding
from edmm.server.metrics import EngineSnapshot, ServerMetrics
from edmm.server.pipeline import RequestPipeline, new_request_id
from edmm.server.prompts import (
    check_chat_options,
    check_known_fields,
    parses_tools,
    response_tool_calls,
)
from edmm.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    FinishReason,
    FunctionCallDelta,
    ModelCard,
    ModelList,
    ResponseMessage,
    StreamOptions,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
    Usage,
    random_id,
)
from edmm.server.sessions import ANONYMOUS, ServerSessions
from edmm.server.stages import NO_TRACE, StageLog, Tracer
from edmm.server.templates import TemplateLimits
from edmm.server.tool_parser import (
    CallFragment,
    ParsedReply,
    StreamingToolParser,
    parse_reply,
)
from edmm.server.turns import ChatTurns, Turn
from edmm.server.validation import check_conversation, check_text, check_tool_names

SSE_DONE = "data: [DONE]\n\n"
TOKEN_TEXT_CACHE = 1 << 16  # token texts kept for log probabilities
OBFUSCATION_MAX = 24  # most bytes of one chunk's obfuscation (before base64)


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event carrying ``payload`` as JSON."""
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


class OpenAIServing:
    """Chat and text completions over an `EngineLoop` running a `ServerSessions`.

    ``client_templates``: the limits of client-supplied chat templates; None: they are refused.
    ``salt_per_key``: every request's prefix-cache salt includes its owner (its API key), so
    clients share no cached KV and ``usage.cached_tokens`` tells nothing across them.
    ``aliases``: further names clients may send for the model (the first name, ``model_name``,
    is the one responses carry). ``force_include_usage``: every stream ends with a usage
    chunk, asked for or not (vLLM's ``--enable-force-include-usage``).
    """

    def __init__(self, loop: EngineLoop[ServerSessions], engine: Engine, tokenizer: Any,
                 model_name: str, metrics: ServerMetrics,
                 guided: GuidedDecoding | None,
                 client_templates: TemplateLimits | None = None,
                 salt_per_key: bool = False, aliases: Sequence[str] = (),
                 force_include_usage: bool = False) -> None:
        self.loop = loop
        self.pipeline = RequestPipeline(loop, engine, tokenizer, metrics.requests, guided,
                                        client_templates, salt_per_key)
        self.turns = ChatTurns(self.pipeline)
        self.model_name = model_name
        self.model_names = [model_name, *(a for a in aliases if a != model_name)]
        self.force_include_usage = force_include_usage
        self.token_texts = TokenTexts(tokenizer)
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
        """``GET /v1/models``: the served model under each of its names."""
        return ModelList(data=[self.model(name) for name in self.model_names])

    def model(self, model: str) -> ModelCard:
        """``GET /v1/models/{model}``; 404 unless it names the served model."""
        self.check_model(model)
        return ModelCard(id=model, max_model_len=self.max_model_len)

    def check_model(self, model: str) -> None:
        """404 unless ``model`` is a name of the served model."""
        if model not in self.model_names:
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

    def unreached(self, turn: Turn) -> None:
        """Abort a queued turn whose response will not reach its client, and close the
        session it made under a server-made name (`ChatTurns.unreached`)."""
        self.abort(turn)
        self.turns.unreached(turn)

    async def more_choices(self, req: ChatCompletionRequest, turn: Turn) -> list[OutputStream]:
        """Queue choices 1..n-1 of a chat with ``n > 1``: the turn's prompt as plain requests
        outside its session (the session follows choice 0), each seeded ``seed + index``
        when the request is seeded."""
        streams: list[OutputStream] = []
        try:
            for index in range(1, req.n):
                params = turn.request.params
                if params.seed is not None:
                    params = dataclasses.replace(params, seed=params.seed + index)
                request = dataclasses.replace(turn.request, request_id=new_request_id(),
                                              params=params)
                streams.append(await self.pipeline.queue(request))
        except BaseException:
            abort_all(streams)
            raise
        return streams

    async def chat_completion(self, req: ChatCompletionRequest, turn: Turn,
                              more: Sequence[OutputStream] = ()) -> ChatCompletion:
        """Run a queued chat turn (and its ``more`` choices, `more_choices`) to the end: the
        whole response."""
        try:
            done = await asyncio.gather(
                self._last(self.turns.outputs(turn)),
                *(self._last(self.pipeline.outputs(stream)) for stream in more))
        finally:
            abort_all(more)
        choices, usage = [], Usage.of(len(turn.request.prompt_token_ids), 0, 0)
        for index, last in enumerate(done):
            text = last.outputs[0].text if last is not None else ""
            reply = parse_reply(text) if parses_tools(req) else ParsedReply(text, [])
            if index == 0:
                finish = await self.finish_turn(turn, last, reply)
            else:
                finish = self.finish_choice(last, reply)
            message = ResponseMessage(content=reply.content,
                                      tool_calls=response_tool_calls(reply.tool_calls))
            choices.append(ChatChoice(index=index, message=message, finish_reason=finish,
                                      logprobs=self._chat_logprobs(last, 0)))
            usage = _add_usage(usage, _usage_of(last, cached=index == 0))
        response = ChatCompletion(id=random_id("chatcmpl"), model=self.model_name,
                                  choices=choices, usage=usage)
        turn.trace.mark("first_event")
        turn.trace.finish(response.id, False, len(turn.request.prompt_token_ids))
        return response

    @staticmethod
    async def _last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput | None:
        last = None
        async for out in outputs:
            last = out
        return last

    async def chat_stream(self, req: ChatCompletionRequest, turn: Turn,
                          more: Sequence[OutputStream] = ()) -> AsyncIterator[str]:
        """Run a queued chat turn (and its ``more`` choices) as server-sent events (aborted
        if the client leaves); an error after the stream started is sent as an error event,
        and the stream always ends with ``[DONE]``."""
        try:
            async for event in self._chat_events(req, turn, random_id("chatcmpl"), more):
                yield event
        except APIError as e:
            yield sse(e.body())
        finally:
            abort_all(more)
        yield SSE_DONE

    async def _chat_events(self, req: ChatCompletionRequest, turn: Turn, cid: str,
                           more: Sequence[OutputStream]) -> AsyncIterator[str]:
        opts = req.stream_options or StreamOptions()
        stream = _ChatStream(self, req, turn, cid, 1 + len(more))
        for index in range(stream.n):
            yield stream.chunk(index, ChatDelta(role="assistant", content=""))
        sources: list[AsyncIterator[RequestOutput]] = [
            self.turns.outputs(turn), *(self.pipeline.outputs(s) for s in more)]
        async for index, out in _merged(sources):
            if out is None:  # the choice ended
                yield await stream.finish(index)
                continue
            event = stream.delta(index, out)
            if event is not None:
                turn.trace.mark("first_event")
                yield event
        turn.trace.finish(cid, True, len(turn.request.prompt_token_ids))
        if opts.include_usage or self.force_include_usage:
            yield sse(ChatCompletionChunk(id=cid, model=self.model_name, choices=[],
                                          usage=stream.usage()))

    def _chat_logprobs(self, out: RequestOutput | None, start: int) -> ChatLogprobs | None:
        """The chat ``logprobs`` of ``out``'s tokens from ``start`` on (None when not asked
        for)."""
        lps = out.outputs[0].logprobs if out is not None else None
        if lps is None:
            return None
        return ChatLogprobs(content=[self.token_texts.chat(lp) for lp in lps[start:]])

    async def finish_turn(self, turn: Turn, last: RequestOutput | None,
                          reply: ParsedReply) -> FinishReason:
        """End the turn (`ChatTurns.end`: its session awaits the reply's tool calls, if any,
        before the client sees it); count and return its finish reason."""
        assert last is not None
        awaits = await self.turns.end(turn, reply)
        reason = "tool_calls" if awaits else _reason(last.outputs[0].finish_reason)
        self._count_finished(last, reason)
        return reason

    def finish_choice(self, last: RequestOutput | None, reply: ParsedReply) -> FinishReason:
        """The finish reason of a choice outside the session (``n > 1``): ``tool_calls`` when
        it made complete calls; counted."""
        assert last is not None
        reason = ("tool_calls" if reply.tool_calls and not reply.cut
                  else _reason(last.outputs[0].finish_reason))
        self._count_finished(last, reason)
        return reason

    # ------------------------------------------------------------------ completions
    async def start_completion(self, req: CompletionRequest, owner: str = ANONYMOUS,
                               trace: Tracer = NO_TRACE, surrogate_free: bool = False,
                               ) -> list[tuple[Request, OutputStream]]:
        """Validate and queue every prompt of a text-completion request (``trace``: the stage
        marks of its first prompt; ``surrogate_free``: no string of ``req`` can hold a lone
        surrogate, `ParsedBody.surrogate_free`, so `check_text` is skipped)."""
        trace.mark("parsed")
        self.check_model(req.model)
        if not surrogate_free:
            check_text(req.model_dump(exclude_defaults=True))
        check_known_fields(req)
        if req.logprobs is not None and req.logprobs > MAX_LOGPROBS:
            raise BadRequestError(f"logprobs must be at most {MAX_LOGPROBS}", param="logprobs")
        requests = _copies(await self.pipeline.completion_requests(req, owner), req.n)
        trace.mark("request_made")
        queued: list[tuple[Request, OutputStream]] = []
        try:
            for request in requests:
                queued.append((request, await self.pipeline.queue(request)))
        except BaseException:
            abort_all([stream for _, stream in queued])
            raise
        trace.mark("submitted")
        return queued

    async def completion(self, req: CompletionRequest,
                         queued: list[tuple[Request, OutputStream]],
                         trace: Tracer = NO_TRACE) -> Completion:
        """Run queued prompts to the end: one choice per prompt (``trace``: the first's)."""
        choices, usage = [], Usage.of(0, 0, 0)
        try:
            for index, (request, stream) in enumerate(queued):
                last = None
                async for out in self.pipeline.outputs(stream):
                    if index == 0:
                        trace.first_output(stream.engine_ns, out.timing)
                    last = out
                assert last is not None
                reason = _reason(last.outputs[0].finish_reason)
                self._count_finished(last, reason)
                choices.append(CompletionChoice(
                    index=index, text=last.outputs[0].text, finish_reason=reason,
                    logprobs=self.token_texts.completion(last.outputs[0].logprobs, 0, 0)))
                usage = _add_usage(usage, _usage(request, last))
        finally:  # an error or a client that left: the other prompts stop too
            abort_all([stream for _, stream in queued])
        response = Completion(id=random_id("cmpl"), model=self.model_name, choices=choices,
                              usage=usage)
        trace.mark("first_event")
        trace.finish(response.id, False, len(queued[0][0].prompt_token_ids))
        return response

    async def completion_stream(self, req: CompletionRequest,
                                queued: list[tuple[Request, OutputStream]],
                                trace: Tracer = NO_TRACE) -> AsyncIterator[str]:
        """Server-sent events of queued prompts, one after the other (``trace``: the
        first's stage marks)."""
        cid, usage = random_id("cmpl"), Usage.of(0, 0, 0)
        opts = req.stream_options or StreamOptions()
        try:
            for index, (request, stream) in enumerate(queued):
                first = trace if index == 0 else NO_TRACE
                async for event, out in self._completion_events(cid, index, request, stream,
                                                                opts, usage, first):
                    yield event
                    if out.finished:
                        usage = _add_usage(usage, _usage(request, out))
                if index == 0:
                    trace.finish(cid, True, len(request.prompt_token_ids))
        except APIError as e:
            yield sse(e.body())
        else:
            if opts.include_usage or self.force_include_usage:
                yield sse(Completion(id=cid, model=self.model_name, choices=[], usage=usage))
        finally:
            abort_all([stream for _, stream in queued])
        yield SSE_DONE

    async def _completion_events(self, cid: str, index: int, request: Request,
                                 stream: OutputStream, opts: StreamOptions, before: Usage,
                                 trace: Tracer) -> AsyncIterator[tuple[str, RequestOutput]]:
        """One prompt's chunks and the output each was made of (``before``: the usage of
        the prompts streamed earlier, for ``continuous_usage_stats``; ``trace``: its stage
        marks)."""
        sent = lp_sent = 0
        async for out in self.pipeline.outputs(stream):
            trace.first_output(stream.engine_ns, out.timing)
            text = _stable_text(out, request.params.stop)
            reason = _reason(out.outputs[0].finish_reason) if out.finished else None
            if reason is not None:
                self._count_finished(out, reason)
            if len(text) > sent or reason is not None:
                lps = out.outputs[0].logprobs
                choice = CompletionChoice(
                    index=index, text=text[sent:], finish_reason=reason,
                    logprobs=self.token_texts.completion(lps, lp_sent, sent))
                chunk = Completion(id=cid, model=self.model_name, choices=[choice])
                if opts.continuous_usage_stats:
                    chunk.usage = _add_usage(before, _usage(request, out))
                if opts.include_obfuscation:
                    chunk.obfuscation = obfuscation()
                event = sse(chunk)
                trace.mark("first_event")
                yield event, out
                sent, lp_sent = len(text), len(lps or ())

    # ------------------------------------------------------------------ shared
    def _count_finished(self, out: RequestOutput, reason: str) -> None:
        counters = self.metrics.requests
        counters.finished[reason] += 1
        counters.generation_tokens += len(out.outputs[0].token_ids)


class _ChatStream:
    """The state of a streamed chat's choices: each one's tool-call parser, what of its text
    and log probabilities was sent, its last output; `chunk` makes an event with the stream
    options applied (``continuous_usage_stats``, ``include_obfuscation``)."""

    def __init__(self, serving: OpenAIServing, req: ChatCompletionRequest, turn: Turn,
                 cid: str, n: int) -> None:
        self.serving, self.turn, self.cid, self.n = serving, turn, cid, n
        self.opts = req.stream_options or StreamOptions()
        self.stop = turn.request.params.stop
        self.parsers = [StreamingToolParser() if parses_tools(req) else None
                        for _ in range(n)]
        self.sent, self.lp_sent = [0] * n, [0] * n
        self.content = [""] * n
        self.last: list[RequestOutput | None] = [None] * n

    def chunk(self, index: int, delta: ChatDelta, finish: FinishReason | None = None,
              logprobs: ChatLogprobs | None = None) -> str:
        """One chunk event of choice ``index``."""
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish,
                                 logprobs=logprobs)
        chunk = ChatCompletionChunk(id=self.cid, model=self.serving.model_name,
                                    choices=[choice])
        if self.opts.continuous_usage_stats:
            chunk.usage = self.usage()
        if self.opts.include_obfuscation:
            chunk.obfuscation = obfuscation()
        return sse(chunk)

    def delta(self, index: int, out: RequestOutput) -> str | None:
        """The event of choice ``index``'s new stable text in ``out`` (None: nothing new)."""
        self.last[index] = out
        text = _stable_text(out, self.stop)  # all of it at the end
        delta, self.sent[index] = _chat_delta(self.parsers[index], text, self.sent[index])
        if delta is None:
            return None
        self.content[index] += delta.content or ""
        return self.chunk(index, delta, logprobs=self._logprobs(index))

    async def finish(self, index: int) -> str:
        """The last events of choice ``index``: the rest of an unclosed or invalid tool-call
        block, then the finish reason (the turn's end reported first for choice 0)."""
        last, parser, events = self.last[index], self.parsers[index], ""
        reply = ParsedReply(self.content[index] or None, [])
        if parser is not None and last is not None:
            # an unclosed or invalid block: its content, and the closing of its arguments
            rest, closing = parser.finish(last.outputs[0].text)
            if rest or closing:
                self.content[index] += rest
                events += self.chunk(index, ChatDelta(content=rest or None,
                                                      tool_calls=_call_deltas(closing) or None))
            reply = ParsedReply(self.content[index] or None, list(parser.calls), parser.cut)
        serving = self.serving
        reason = (await serving.finish_turn(self.turn, last, reply) if index == 0
                  else serving.finish_choice(last, reply))
        return events + self.chunk(index, ChatDelta(), reason, self._logprobs(index))

    def _logprobs(self, index: int) -> ChatLogprobs | None:
        out = self.last[index]
        lps = out.outputs[0].logprobs if out is not None else None
        if not lps or len(lps) <= self.lp_sent[index]:
            return None
        start, self.lp_sent[index] = self.lp_sent[index], len(lps)
        return self.serving._chat_logprobs(out, start)

    def usage(self) -> Usage:
        """The usage so far, over every choice (cached tokens: choice 0's)."""
        done = sum(len(o.outputs[0].token_ids) for o in self.last if o is not None)
        first = self.last[0]
        return Usage.of(len(self.turn.request.prompt_token_ids), done,
                        first.num_cached_tokens if first is not None else 0)


_END = object()


async def _merged(sources: Sequence[AsyncIterator[RequestOutput]],
                  ) -> AsyncIterator[tuple[int, RequestOutput | None]]:
    """``(index, output)`` of several output streams as they come, and ``(index, None)`` when
    stream ``index`` ends; the first error of any stream is raised (the others are left, which
    aborts them). One stream is read directly."""
    if len(sources) == 1:
        async for out in sources[0]:
            yield 0, out
        yield 0, None
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(index: int, source: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in source:
                await queue.put((index, out))
            await queue.put((index, _END))
        except BaseException as e:
            await queue.put((index, e))
            raise

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(sources)]
    try:
        left = len(tasks)
        while left:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is _END:
                left -= 1
                yield index, None
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class TokenTexts:
    """The texts of tokens in log probabilities, decoded one token at a time by a tokenizer
    of the event loop's own (a copy, made at first use; the pipeline's is the tokenizing
    thread's); without a tokenizer a token reads ``token_id:N`` (vLLM's form)."""

    def __init__(self, tokenizer: Any) -> None:
        self._source = tokenizer
        self._tokenizer: Any = None
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        """The text of one token (partial UTF-8 decodes to U+FFFD, as OpenAI shows it)."""
        text = self._texts.get(token_id)
        if text is None:
            if self._source is None:
                text = f"token_id:{token_id}"
            else:
                if self._tokenizer is None:
                    self._tokenizer = copy.deepcopy(self._source)
                text = str(self._tokenizer.decode([token_id]))
            if len(self._texts) < TOKEN_TEXT_CACHE:
                self._texts[token_id] = text
        return text

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))

    def chat(self, lp: TokenLogprobs) -> TokenLogprob:
        """One token's entry of a chat choice's ``logprobs.content``."""
        text = self.text(lp.token_id)
        return TokenLogprob(token=text, logprob=lp.logprob, bytes=list(text.encode("utf-8")),
                            top_logprobs=[self._top(t, v) for t, v in lp.top])

    def completion(self, lps: Sequence[TokenLogprobs] | None, start: int,
                   offset: int) -> CompletionLogprobs | None:
        """The legacy ``logprobs`` of a text completion's tokens from ``start`` on, their
        text offsets counted from ``offset`` (None when not asked for)."""
        if lps is None:
            return None
        out = CompletionLogprobs()
        for lp in lps[start:]:
            text = self.text(lp.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append({self.text(t): v for t, v in lp.top})
            out.text_offset.append(offset)
            offset += len(text)
        return out


def obfuscation() -> str:
    """Random characters of a random length for ``stream_options.include_obfuscation``."""
    return secrets.token_urlsafe(secrets.randbelow(OBFUSCATION_MAX) + 1)


def _copies(requests: list[Request], n: int) -> list[Request]:
    """Each prompt's request ``n`` times (``n`` choices each: new ids, seeded ``seed + i``)."""
    if n == 1:
        return requests
    out = []
    for request in requests:
        for i in range(n):
            params = request.params
            if params.seed is not None and i:
                params = dataclasses.replace(params, seed=params.seed + i)
            out.append(request if i == 0 else dataclasses.replace(
                request, request_id=new_request_id(), params=params))
    return out


def _usage_of(out: RequestOutput | None, cached: bool) -> Usage:
    """The completion tokens of one choice (and its cached prompt tokens if ``cached``)."""
    if out is None:
        return Usage.of(0, 0, 0)
    return Usage.of(0, len(out.outputs[0].token_ids), out.num_cached_tokens if cached else 0)


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
    return ChatDelta(content=content or None, tool_calls=_call_deltas(fragments) or None), sent


def _call_deltas(fragments: Sequence[CallFragment]) -> list[ToolCallDelta]:
    # "type" on every piece: the openai SDK's accumulation overwrites it with each one's.
    return [ToolCallDelta(index=f.index, id=f.id, type="function",
                          function=FunctionCallDelta(name=f.name, arguments=f.arguments))
            for f in fragments]


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
