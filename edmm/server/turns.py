"""A chat turn's life in the server: queued, streaming, ended (with tool calls: a tool window).

One `Turn` record crosses the threads, each phase writing its own fields before it hands the
turn on (the queue or future between two threads orders the writes):

1. `ChatTurns.start`, on the event loop: the grammar job starts (`RequestPipeline.grammars`;
   it overlaps the render), a client's chat template renders in its process
   (`RequestPipeline.client_text`), then one job on the tokenizing thread renders and
   tokenizes the prompt (`RequestPipeline.prompt`), makes the engine request
   (`RequestPipeline.request`) and the `Turn` (`ChatTurns._made`) and, with no grammar to wait
   for, sends it to the engine thread itself (`ChatTurns._made_and_sent`: no hop back to the
   event loop in between). With a grammar, the event loop attaches its processors once they
   are compiled and sends it.
2. On the engine thread `ServerSessions.begin` names the turn's session and queues its
   request; the event loop learns the session id and the output stream.
3. `ChatTurns.outputs` yields the engine's outputs to the HTTP layer (`OpenAIServing`).
4. `ChatTurns.end` reports the turn's end to its session before the client sees it
   (`ServerSessions.end`). Without tool calls to await, the session's KV becomes an ordinary
   cache entry (nothing waits for that). With tool calls the session awaits them and
   speculation starts: the client's predicted next request, if any, is rendered on the
   tokenizing thread, which sends the end to the engine thread itself; once the session
   awaits the calls, the resume that answers them is prepared on the tokenizing thread
   (`RequestPipeline.prepare_resume`) while the tools run.

A failed start queues nothing; its errors come in this order: a client-template setting, the
render (the template, the context), the grammars, the request's options and ids, its session.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from edmm.agent.render import assistant_message
from edmm.engine import Request, RequestOutput, SamplingParams
from edmm.engine.sampling import LogitsProcessor
from edmm.server.engine_loop import EngineLoop, OutputStream, Submission
from edmm.server.errors import APIError, BadRequestError, ServiceUnavailableError
from edmm.server.guided import GrammarLogitsProcessor
from edmm.server.incremental import RenderedPrompt
from edmm.server.pipeline import RequestPipeline, new_request_id
from edmm.server.prompts import (
    chat_logprobs,
    client_template,
    parses_tools,
    predicted_messages,
    prompt_limit,
    response_tool_calls,
    sampling_params,
    template_messages,
    template_tools,
    trailing_tool_results,
)
from edmm.server.protocol import AssistantMessage, ChatCompletionRequest, ChatMessage
from edmm.server.sessions import ANONYMOUS, ServerSessions
from edmm.server.stages import NO_TRACE, Tracer
from edmm.server.tool_parser import ParsedReply, ParsedToolCall

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Turn:
    """One chat turn: its engine request, what names its session, and how it ended.

    Made on the tokenizing thread (`ChatTurns.start`), read on the engine thread when its
    session is named (`ServerSessions.begin`: ``request``, ``asked_session``,
    ``tool_results``, ``owner``, ``may_await``, ``discard_pending``; it sets
    ``session_key`` and ``minted``), streamed on the event loop, and read again there when
    it ends (`ServerSessions.end`: ``session_key``, ``calls``, `next_messages`, ``tools``
    and the client's hints).
    """

    request: Request  # validated, salted, with its grammars
    owner: str = ANONYMOUS  # the client sending it (`edmm.server.sessions.owner_of`)
    asked_session: str | None = None  # named explicitly (header, else body)
    tool_results: Sequence[tuple[str, str]] = ()  # (tool_call_id, content) of trailing tool msgs
    may_await: bool = False  # its reply may end in tool calls (tools it may call)
    discard_pending: bool = False  # ``edmm.discard_pending_calls``
    messages: list[dict[str, Any]] = field(default_factory=list)  # as the template reads them
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] | None = None  # ``chat_template_kwargs``
    prompt: RenderedPrompt | None = None  # its prompt's handle (`ChatPrompts.prepare_resume`)
    predicted_next: list[ChatMessage] | None = None  # ``edmm.predicted_next_messages``
    predictions: Mapping[str, str] = field(default_factory=dict)  # call id or tool name -> text
    expected_duration_s: float | None = None  # of its tools, as the client expects
    trace: Tracer = NO_TRACE
    # Once queued (engine thread: the key; event loop: the name and the stream).
    session_id: str = ""  # its session's name, as the client knows it
    session_key: str = ""  # its session's id in the agent layer (`sessions.session_key`)
    minted: bool = False  # its session is new, under a name the server made up
    stream: OutputStream | None = None
    # Its end (event loop or tokenizing thread, before `ServerSessions.end`).
    calls: Sequence[ParsedToolCall] = ()  # the calls its session awaits (none: it ended)
    reply: dict[str, Any] | None = None  # the reply's template message, with calls to await
    predicted_prompt: Sequence[int] = ()  # the whole next prompt, as the client predicts it

    @property
    def next_messages(self) -> list[dict[str, Any]]:
        """The conversation with its reply, as the client sends it back."""
        return [*self.messages, self.reply] if self.reply is not None else list(self.messages)


class ChatTurns:
    """Starts, streams and ends chat turns over a `RequestPipeline` (see the module
    docstring)."""

    def __init__(self, pipeline: RequestPipeline) -> None:
        self.pipeline = pipeline
        self.loop: EngineLoop[ServerSessions] = pipeline.loop
        self.max_model_len = pipeline.max_model_len

    # ------------------------------------------------------------------ queued
    async def start(self, chat: ChatCompletionRequest, session_header: str | None,
                    owner: str = ANONYMOUS, trace: Tracer = NO_TRACE) -> Turn:
        """Render, make and queue a validated chat's turn (render -> request -> submit);
        any error is raised before anything stays queued."""
        messages, tools = template_messages(chat.messages), template_tools(chat.tools)
        trace.mark("validated")
        pipeline, kwargs = self.pipeline, chat.chat_template_kwargs
        source = client_template(kwargs, pipeline.client_templates)  # its 400 comes first
        grammars = pipeline.grammars(chat)
        submission: Submission[ServerSessions, str] = Submission(self.loop, new_request_id())
        make = self._made if grammars is not None else self._made_and_sent
        try:
            text = None if source is None else await pipeline.client_text(messages, tools,
                                                                          kwargs)
            made = await pipeline.tokenize(make, submission, chat, session_header, owner,
                                           messages, tools, text, trace)
            if grammars is None:
                turn = _raised(made)  # sent already
            else:
                trace.mark("back")
                processors = await grammars  # its error comes before the request's
                turn = _raised(made)
                self._send(submission, turn, chat, processors)
            turn.session_id, turn.stream = await submission.result()
        except BaseException:
            submission.cancel()
            if grammars is not None:
                _discard(grammars)
            raise
        trace.mark("submitted")
        return turn

    def _made(self, submission: Submission[ServerSessions, str], chat: ChatCompletionRequest,
              session_header: str | None, owner: str, messages: list[dict[str, Any]],
              tools: list[dict[str, Any]] | None, text: str | None,
              trace: Tracer) -> Turn | APIError:
        """On the tokenizing thread: the turn of a chat, its prompt rendered (or ``text``, a
        client template's, encoded) and its engine request made under ``submission``'s id.
        An error of the prompt is raised; one of the request's options or ids is returned (it
        comes after the grammars')."""
        kwargs = chat.chat_template_kwargs
        prompt = self.pipeline.prompt(messages, tools, kwargs,
                                      prompt_limit(self.max_model_len, chat.completion_limit),
                                      text, trace)
        try:
            params = self.params(chat, len(prompt.ids))
            request = self.pipeline.request(prompt.ids, params, owner, chat.cache_salt,
                                            submission.request_id)
        except APIError as e:
            return e
        ext = chat.edmm
        return Turn(request, owner=owner,
                    asked_session=session_header or (ext.session_id if ext else None),
                    tool_results=trailing_tool_results(chat.messages),
                    may_await=parses_tools(chat),
                    discard_pending=ext.discard_pending_calls if ext else False,
                    messages=messages,
                    tools=tools, template_kwargs=kwargs, prompt=prompt.prompt,
                    predicted_next=ext.predicted_next_messages if ext else None,
                    predictions=ext.predicted_tool_results if ext else {},
                    expected_duration_s=ext.expected_tool_duration_s if ext else None,
                    trace=trace)

    def _made_and_sent(self, submission: Submission[ServerSessions, str],
                       chat: ChatCompletionRequest, session_header: str | None, owner: str,
                       messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                       text: str | None, trace: Tracer) -> Turn | APIError:
        """`_made`, then sent to the engine thread from the tokenizing thread (a chat with no
        grammar to wait for); nothing is sent after an error."""
        turn = self._made(submission, chat, session_header, owner, messages, tools, text,
                          trace)
        if not isinstance(turn, APIError):
            trace.mark("request_made")
            submission.send(lambda b: _begin(b, turn))
        return turn

    def _send(self, submission: Submission[ServerSessions, str], turn: Turn,
              chat: ChatCompletionRequest, processors: list[LogitsProcessor]) -> None:
        """Send ``turn`` to the engine thread from the event loop, with the ``processors``
        of its grammars and the tokens its grammar forces at the start (computed with the
        prompt: a forced call's wrapper and name cost no decode steps)."""
        if processors:
            params = self.params(chat, len(turn.request.prompt_token_ids), processors)
            grammars = [p for p in processors if isinstance(p, GrammarLogitsProcessor)]
            if len(grammars) == 1 and grammars[0].forced:
                params = dataclasses.replace(params, forced_output_ids=list(grammars[0].forced))
            turn.request = dataclasses.replace(turn.request, params=params)
        turn.trace.mark("request_made")
        submission.send(lambda b: _begin(b, turn))

    def params(self, chat: ChatCompletionRequest, prompt_len: int,
               processors: list[LogitsProcessor] | None = None) -> SamplingParams:
        """A chat's sampling params: ``tool_choice: "none"`` with tools bans the tool-call
        block's start token (the reply is text; the prompt keeps its tools, so it extends the
        session's as any turn does); ``parallel_tool_calls: false`` stops the reply at the end
        of its first call (where the format's markers are single tokens)."""
        markers = self.pipeline.tool_markers
        ban: tuple[int, ...] = ()
        stops: tuple[int, ...] = ()
        if markers is not None and chat.tools:
            if chat.tool_choice == "none":
                ban = (markers[0],)
            elif chat.parallel_tool_calls is False:
                stops = (markers[1],)
        return sampling_params(chat, chat.completion_limit, prompt_len, self.max_model_len,
                               processors, logprobs=chat_logprobs(chat), ban=ban,
                               stop_token_ids=stops)

    # ------------------------------------------------------------------ streaming
    async def outputs(self, turn: Turn) -> AsyncIterator[RequestOutput]:
        """The queued turn's outputs, the first one marked on its trace; a grammar that
        stopped over its budget is a 400. Leaving early (an error, the client gone) aborts
        the request."""
        stream = turn.stream
        assert stream is not None, "the turn is not queued"
        try:
            async for out in self.pipeline.outputs(stream):
                turn.trace.first_output(stream.engine_ns, out.timing)
                _check_grammar(turn.request)
                yield out
        except BaseException:
            stream.abort()  # no-op once finished
            raise

    # ------------------------------------------------------------------ ended
    def unreached(self, turn: Turn) -> None:
        """The turn's response will not reach its client (it left, or the turn failed):
        a session the turn made under a server-made name is closed
        (`ServerSessions.drop_unreached`), after the turn's abort."""
        if turn.stream is None:
            return
        with contextlib.suppress(ServiceUnavailableError):  # the server is closing
            self.loop.call(lambda b: b.drop_unreached(turn)).add_done_callback(_log_failure)

    async def end(self, turn: Turn, reply: ParsedReply) -> bool:
        """Report the turn's end to its session before the client sees ``reply``; True when
        the session awaits its tool calls (a call cut short is not run: no tool window)."""
        if not reply.tool_calls or reply.cut:
            with contextlib.suppress(ServiceUnavailableError):  # the server is closing
                self.loop.call(lambda b: b.end(turn)).add_done_callback(_log_failure)
            return False
        turn.calls = tuple(reply.tool_calls)
        turn.reply = assistant_message(reply.content, turn.calls)
        # Shielded: once the reply exists its session must await the calls, even if the
        # client leaves now.
        await asyncio.shield(self._await_tools(turn, reply.content))
        return True

    async def _await_tools(self, turn: Turn, content: str | None) -> None:
        """Put the turn's session in awaiting-tool (its speculation starts), then prepare
        the resume while the tools run."""
        if turn.predicted_next is None:
            await self.loop.run(lambda b: b.end(turn))
        else:
            await asyncio.wrap_future(await self._predicted_end(turn, content))
        self.pipeline.prepare_resume(turn.prompt or turn.messages, turn.reply)

    async def _predicted_end(self, turn: Turn, content: str | None,
                             ) -> concurrent.futures.Future[None]:
        """The client's predicted next request with this turn's reply
        (`EdmmExtension.predicted_next_messages`) rendered as that request will be, and the
        turn's end sent to the engine thread, by the tokenizing thread; the end's future. A
        prediction that fails in any way (its text was checked with the request; the reply
        exists already, so only speculation may be lost) is dropped."""
        assert turn.predicted_next is not None
        reply = AssistantMessage(role="assistant", content=content,
                                 tool_calls=response_tool_calls(turn.calls))
        messages = template_messages(predicted_messages(turn.predicted_next, reply))
        try:
            text = await self.pipeline.client_text(messages, turn.tools, turn.template_kwargs)
        except Exception as e:  # a hint that fails costs the hint only
            _dropped(turn, e)
            return self.loop.call(lambda b: b.end(turn))
        return await self.pipeline.tokenize(self._predicted_and_sent, turn, messages, text)

    def _predicted_and_sent(self, turn: Turn, messages: list[dict[str, Any]],
                            text: str | None) -> concurrent.futures.Future[None]:
        """On the tokenizing thread: ``turn.predicted_prompt`` (kept for the resume that
        sends it), then the end sent to the engine thread."""
        try:
            turn.predicted_prompt = self.pipeline.prompt(
                messages, turn.tools, turn.template_kwargs, self.max_model_len, text,
                awaited=True).ids
        except Exception as e:  # a hint that fails costs the hint only
            _dropped(turn, e)
        return self.loop.call(lambda b: b.end(turn))


def _begin(backend: ServerSessions, turn: Turn) -> str:
    """``backend.begin(turn)`` on the engine thread, marked on the turn's trace."""
    turn.trace.mark("engine_picked")
    session_id = backend.begin(turn)
    turn.trace.mark("begun")
    return session_id


def _raised(made: Turn | APIError) -> Turn:
    if isinstance(made, APIError):
        raise made
    return made


def _check_grammar(request: Request) -> None:
    """400 once a grammar of ``request`` stopped over its budget (leaving the output stream
    aborts the request)."""
    for processor in request.params.logits_processors:
        if isinstance(processor, GrammarLogitsProcessor) and processor.failure is not None:
            raise BadRequestError(processor.failure, param=processor.param,
                                  code="grammar_too_costly")


def _dropped(turn: Turn, error: Exception) -> None:
    logger.info("session %s: predicted_next_messages ignored: %s", turn.session_id,
                getattr(error, "message", None) or type(error).__name__)


def _log_failure(future: concurrent.futures.Future[Any]) -> None:
    """Log the error of a call on the engine thread that nobody waits for."""
    if not future.cancelled() and (error := future.exception()) is not None:
        logger.warning("engine call failed: %r", error)


def _discard(future: asyncio.Future[Any]) -> None:
    """Cancel ``future``, or if it is done, retrieve its error (none is logged as lost)."""
    if not future.cancel() and not future.cancelled():
        future.exception()

