"""Prompt ids of chat requests rendered with the model's template, on the tokenizing thread.

An agent's resume repeats the conversation with a tool result appended. `ChatPrompts` renders
it with an `IncrementalChatRenderer` (only the messages from the last shared user query on
are rendered; the rest of the text is the earlier prompt's) and encodes the text with the
server's `PromptEncoder` (only the text after the shared prefix is tokenized). The renderer is
used only if the model's template passes `IncrementalChatRenderer.is_exact` when the server
starts; otherwise, and whenever the shared prefix cannot be proven the same, the conversation
is rendered in full. Either way the ids equal a full render's.

A turn that ends in tool calls prepares its resume while the tools run (`prepare_resume` with
the reply): the renderer keeps the resume's text around its results, and the text before the
first result is encoded then, so the resume that carries exactly the results runs no template
and tokenizes only them (and what follows). The prompt a turn rendered (`ChatPrompt.prompt`)
is the handle of its text and ids: the server keeps it with the turn, so that preparation
needs no lookup among recent prompts, however many sessions run.

Not thread-safe: everything runs on the server's one tokenizing thread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from edmm.model.prompt_encoder import PromptEncoder, TokenIds
from edmm.server.incremental import IncrementalChatRenderer, RenderedPrompt, RenderStats
from edmm.server.prompts import encode_prompt_text, template_text
from edmm.server.stages import NO_TRACE, Tracer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered conversation's ids and its prompt's handle (None when rendered in full
    without the incremental renderer), to pass to `ChatPrompts.prepare_resume`."""

    ids: TokenIds
    prompt: RenderedPrompt | None


class ChatPrompts:
    """Prompt ids of conversations under the model's chat template (see the module
    docstring); ``incremental`` False renders every prompt in full."""

    def __init__(self, tokenizer: Any, encoder: PromptEncoder | None,
                 incremental: bool = True) -> None:
        self.tokenizer = tokenizer
        self.encoder = encoder
        self._incremental = incremental
        self._renderer: IncrementalChatRenderer | None = None
        self._prepared = False

    @property
    def stats(self) -> RenderStats:
        """Messages rendered and reused so far (a copy; zeros while rendering in full)."""
        return replace(self._renderer.stats) if self._renderer is not None else RenderStats()

    def prepare(self) -> bool:
        """Decide once whether prompts render incrementally (probing the template), and
        whether awaited resumes are joined from pieces (`IncrementalChatRenderer.slots_exact`);
        return whether they render incrementally. Runs on first use if not called before."""
        if not self._prepared:
            self._prepared = True
            if self._incremental and _has_template(self.tokenizer):
                renderer = IncrementalChatRenderer(partial(template_text, self.tokenizer))
                if renderer.is_exact():
                    renderer.slots = renderer.slots_exact()
                    self._renderer = renderer
                else:
                    logger.info("the chat template fails the incremental-render probe: "
                                "every prompt is rendered in full")
        return self._renderer is not None

    def ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
            kwargs: dict[str, Any] | None, limit: int | None,
            trace: Tracer = NO_TRACE) -> TokenIds:
        """The prompt's token ids (`render`'s)."""
        return self.render(messages, tools, kwargs, limit, trace).ids

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               kwargs: dict[str, Any] | None, limit: int | None,
               trace: Tracer = NO_TRACE, awaited: bool = False) -> ChatPrompt:
        """The prompt's token ids (`TokenIds`; refused past ``limit`` tokens when one is
        given) and its handle; ``awaited``: a predicted next request, kept for the resume
        that sends it (`IncrementalChatRenderer.expect`). Marks ``render_start``,
        ``rendered`` and ``tokenized`` on ``trace``."""
        trace.mark("render_start")
        self.prepare()
        prompt, hint, renderer = None, None, self._renderer
        if renderer is not None:
            prompt, hint = renderer.render(messages, tools, kwargs)
            text = prompt.text
        else:
            text = template_text(self.tokenizer, messages, tools, kwargs)
        trace.mark("rendered")
        ids, encoded = encode_prompt_text(self.tokenizer, self.encoder, text, limit, hint)
        if renderer is not None and prompt is not None:
            prompt.encoded = encoded
            if awaited:
                renderer.expect(prompt)
        trace.mark("tokenized")
        return ChatPrompt(ids, prompt)

    def prepare_resume(self, prompt: RenderedPrompt | list[dict[str, Any]] | None = None,
                       reply: dict[str, Any] | None = None) -> None:
        """Idle-time work for the resume of ``prompt`` (a `ChatPrompt.prompt`; or the
        latest recent prompt of these messages; else the latest): where its last query
        starts (`IncrementalChatRenderer.prepare_resume`), and with the ``reply`` (its
        template message) the resume answering its tool calls, as pieces around the results
        with the first piece encoded (`IncrementalChatRenderer.await_resume`). Any failure
        only leaves the work to the resume."""
        if self._renderer is None:
            return
        try:
            if reply is None or not isinstance(prompt, RenderedPrompt):
                self._renderer.prepare_resume(prompt)
                return
            slots = self._renderer.await_resume(prompt, reply)
            if slots is not None and self.encoder is not None:
                slots.encoded = self.encoder.encode_text(slots.pieces[0], hint=prompt.encoded,
                                                         keep=False)[1]
        except Exception:  # the resume renders it, or falls back to a full render
            logger.debug("preparing the resume failed", exc_info=True)


def _has_template(tokenizer: Any) -> bool:
    return tokenizer is not None and getattr(tokenizer, "chat_template", None) is not None
