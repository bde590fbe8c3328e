"""Where a request's work runs before the engine thread takes it, and how it gets there.

Work whose cost the client controls runs where it cannot hold anyone else up: the model's own
chat template and the tokenizer on the one tokenizing thread, with the context check made while
tokenizing (a prompt far over the context is refused before all of it is encoded); a client's
chat template (sandboxed, within its `TemplateLimits`) in a process of its own; a new grammar is
checked in the grammar probe's process (within its `GrammarBudget`), then compiled on the
isolated pool. Engine requests are made and validated where their ids are (the tokenizing
thread: no list of ids crosses threads but the request's), by the engine's immutable
`RequestValidator`.

`RequestPipeline` owns those threads and processes and the steps that run on them; the order
of the steps of a chat turn is `edmm.server.turns.ChatTurns`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing
import os
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from edmm.engine import ContextLengthError as EngineContextLengthError
from edmm.engine import Engine, InvalidRequestError, Request, RequestOutput
from edmm.engine.sampling import LogitsProcessor
from edmm.model.errors import PromptTooLongError
from edmm.model.prompt_encoder import PromptEncoder
from edmm.server.chat_prompts import ChatPrompt, ChatPrompts
from edmm.server.engine_loop import EngineLoop, OutputStream
from edmm.server.errors import APIError, BadRequestError, ContextLengthError
from edmm.server.guided import GuidedDecoding
from edmm.server.incremental import RenderedPrompt
from edmm.server.metrics import RequestCounters
from edmm.server.prompts import (
    client_template,
    client_template_variables,
    encode_prompt,
    prompt_limit,
    prompt_too_long,
    sampling_params,
)
from edmm.server.protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice
from edmm.server.sessions import ServerSessions
from edmm.server.stages import NO_TRACE, Tracer
from edmm.server.templates import TemplateLimits, render_client_template

T = TypeVar("T")
TEMPLATE_NICENESS = 10  # the client-template process yields the CPU to the server


class RequestPipeline:
    """The tokenizing thread, the isolated pool, the client-template process and the steps
    that run there (see the module docstring).

    ``client_templates``: the limits of client-supplied chat templates; None: they are refused.
    ``salt_per_key``: every request's prefix-cache salt includes its owner (its API key), so
    clients share no cached KV and ``usage.cached_tokens`` tells nothing across them.
    ``counters``: the HTTP layer's, where requests left unfinished are counted (`outputs`).
    """

    def __init__(self, loop: EngineLoop[ServerSessions], engine: Engine, tokenizer: Any,
                 counters: RequestCounters, guided: GuidedDecoding | None,
                 client_templates: TemplateLimits | None = None,
                 salt_per_key: bool = False) -> None:
        self.loop = loop
        self.counters = counters
        # The server's own copy, used only on its one tokenizing thread (tokenizers are not
        # shared between threads): rendering a long conversation never blocks the event loop.
        self.tokenizer = tokenizer
        self.encoder = PromptEncoder(tokenizer) if tokenizer is not None else None
        self.prompts = ChatPrompts(tokenizer, self.encoder)  # tokenizing thread only
        self.tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edmm-tokenize")
        # Grammar compilation: never ahead of others' tokenizing.
        self._isolated = ThreadPoolExecutor(max_workers=2, thread_name_prefix="edmm-isolated")
        # Client templates run pure Python for up to their time budget: in a thread they would
        # hold the GIL against the engine thread, so they render in a process of their own.
        self._templates: ProcessPoolExecutor | None = None
        self.client_templates = client_templates
        self.guided = guided
        self.salt_per_key = salt_per_key
        self.max_model_len = engine.max_model_len
        self.validator = engine.validator  # immutable: safe off the engine thread

    def start(self) -> None:
        """Probe the model's template for incremental rendering (`ChatPrompts.prepare`) on
        the tokenizing thread; start the client-template process when client templates are
        on, and wait until it renders (its start-up, which imports the template code, is paid
        by no request and never competes with live traffic)."""
        self.tokenizing.submit(self.prompts.prepare).result()
        if self.client_templates is not None:
            self._template_pool().submit(render_client_template, "{{ 1 }}", {},
                                         self.client_templates).result()

    def close(self) -> None:
        """Stop the threads (after the work queued on them) and the template process."""
        self.tokenizing.shutdown(wait=True)
        self._isolated.shutdown(wait=True)
        if self._templates is not None:
            self._templates.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------------ where work runs
    async def tokenize(self, fn: Callable[..., T], *args: Any) -> T:
        """Run tokenizer work (chat rendering, encoding, making requests) on the tokenizing
        thread."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizing, fn, *args)

    def later(self, fn: Callable[..., object], *args: Any) -> None:
        """Queue ``fn(*args)`` on the tokenizing thread, waited for by nobody (from any
        thread; dropped once the server is closing)."""
        with contextlib.suppress(RuntimeError):  # the executor is shut down
            self.tokenizing.submit(fn, *args)

    async def client_text(self, messages: list[dict[str, Any]],
                          tools: list[dict[str, Any]] | None,
                          kwargs: dict[str, Any] | None) -> str | None:
        """The prompt text of a client's chat template (``chat_template_kwargs``), rendered in
        the template process (started on first use; restarted if a render killed it, which is
        a 400 for that request); None when the model's template renders the prompt."""
        source = client_template(kwargs, self.client_templates)
        if source is None:
            return None
        assert self.client_templates is not None
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

    def _template_pool(self) -> ProcessPoolExecutor:
        if self._templates is None:  # below the server's threads on a busy CPU
            self._templates = ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                initializer=os.nice, initargs=(TEMPLATE_NICENESS,))
        return self._templates

    # ------------------------------------------------------------------ steps
    def prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               kwargs: dict[str, Any] | None, limit: int, text: str | None = None,
               trace: Tracer = NO_TRACE, awaited: bool = False) -> ChatPrompt:
        """On the tokenizing thread: a conversation's prompt ids, refused past ``limit``
        tokens: ``text`` (a client template's, `client_text`) encoded, or without it the
        model's template rendered (`ChatPrompts.render`: incremental where exact, marks on
        ``trace``; ``awaited``: kept for the resume that sends it)."""
        if text is None:
            return self.prompts.render(messages, tools, kwargs, limit, trace, awaited)
        return ChatPrompt(encode_prompt(self.tokenizer, self.encoder, text, limit), None)

    def request(self, ids: Sequence[int], params: Any, owner: str, salt: str | None = None,
                request_id: str | None = None) -> Request:
        """A validated request of ``ids`` (token ids in the vocabulary, length; a new id
        unless ``request_id``) with its prefix-cache salt: the client's ``salt``, and its
        ``owner`` when salting per key (joined by a NUL, which no owner contains:
        unambiguous); any thread."""
        if self.salt_per_key:
            salt = f"{owner}\x00{salt or ''}"
        try:
            request = self.validator.make(request_id or new_request_id(), ids, params)
        except EngineContextLengthError as e:
            raise ContextLengthError(str(e)) from e
        except InvalidRequestError as e:
            raise BadRequestError(str(e), param="prompt") from e
        return request if salt is None else dataclasses.replace(request, cache_salt=salt)

    def grammars(self, req: ChatCompletionRequest,
                 ) -> asyncio.Future[list[LogitsProcessor]] | None:
        """The job making ``req``'s logits processors, started now (it overlaps the prompt's
        render), or None when there is nothing to check or compile: no grammar, or only
        checks passed before. Its error is raised when it is awaited."""
        if self.guided is None:
            return asyncio.ensure_future(self._processors(req)) if _constrains(req) else None
        try:
            if self.guided.known_to_pass(self.guided.chat_grammars(req)):
                return None
        except APIError:  # raised by the job, in its order
            pass
        return asyncio.ensure_future(self._processors(req))

    async def _processors(self, req: ChatCompletionRequest) -> list[LogitsProcessor]:
        """Grammar constraints: forced tool calls, or a JSON response format (every tool's
        schema is checked, whatever the choice). New grammars are checked in the probe
        process; the enforced one is then compiled on the isolated pool."""
        guided = self.guided
        if guided is None:
            raise BadRequestError("constrained decoding needs a model with a tokenizer",
                                  param="tool_choice")
        grammars = guided.chat_grammars(req)
        await guided.check_isolated(grammars)
        loop = asyncio.get_running_loop()
        return [await loop.run_in_executor(self._isolated, guided.processor, g)
                for g in grammars if g.enforced]

    # ------------------------------------------------------------------ text completions
    async def completion_requests(self, req: CompletionRequest, owner: str) -> list[Request]:
        """The validated requests of a text completion's prompts (tokenized on the
        tokenizing thread)."""
        return [await self.tokenize(self._completion_request, req, p, owner)
                for p in _prompts(req.prompt)]

    def _completion_request(self, req: CompletionRequest, prompt: str | list[int],
                            owner: str) -> Request:
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
        return self.request(ids, params, owner, req.cache_salt)

    async def queue(self, request: Request) -> OutputStream:
        """Queue ``request`` outside any session; the stream of its outputs."""
        _, stream = await self.loop.submit(request.request_id, lambda b: b.submit(request))
        return stream

    async def outputs(self, stream: OutputStream) -> AsyncIterator[RequestOutput]:
        """The stream's outputs; a request left unfinished is counted as aborted."""
        try:
            async for out in stream.outputs():
                yield out
        finally:
            if stream.aborted:
                self.counters.finished["abort"] += 1

    def prepare_resume(self, prompt: RenderedPrompt | list[dict[str, Any]],
                       reply: dict[str, Any] | None) -> None:
        """Queue the preparation of the resume answering ``reply``'s calls
        (`ChatPrompts.prepare_resume`) on the tokenizing thread; any thread."""
        self.later(self.prompts.prepare_resume, prompt, reply)


def new_request_id() -> str:
    """A fresh engine request id."""
    return f"req-{uuid.uuid4().hex}"


def _constrains(req: ChatCompletionRequest) -> bool:
    """Whether ``req`` asks for constrained decoding (a forced tool call or JSON)."""
    return req.tool_choice == "required" or isinstance(req.tool_choice, NamedToolChoice) or (
        req.response_format is not None and req.response_format.type != "text")


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise BadRequestError("prompt is empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]
