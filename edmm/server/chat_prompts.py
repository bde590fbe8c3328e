"""Prompt ids of chat requests rendered with the model's template, on the tokenizing thread.

An agent's resume repeats the conversation with a tool result appended. `ChatPrompts` renders
it with an `IncrementalChatRenderer` (only the messages from the last shared user query on
are rendered; the rest of the text is the earlier prompt's) and encodes the text with the
server's `PromptEncoder` (only the text after the shared prefix is tokenized). The renderer is
used only if the model's template passes `IncrementalChatRenderer.is_exact` when the server
starts; otherwise, and whenever the shared prefix cannot be proven the same, the conversation
is rendered in full. Either way the ids equal a full render's.

Not thread-safe: everything runs on the server's one tokenizing thread.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from functools import partial
from typing import Any

from edmm.model.prompt_encoder import PromptEncoder, TokenIds
from edmm.server.incremental import IncrementalChatRenderer, RenderStats
from edmm.server.prompts import encode_prompt, template_text
from edmm.server.stages import StageTimer

logger = logging.getLogger(__name__)


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
        """Decide once whether prompts render incrementally (probing the template); return
        whether they do. Runs on first use if not called before."""
        if not self._prepared:
            self._prepared = True
            if self._incremental and _has_template(self.tokenizer):
                renderer = IncrementalChatRenderer(partial(template_text, self.tokenizer))
                if renderer.is_exact():
                    self._renderer = renderer
                else:
                    logger.info("the chat template fails the incremental-render probe: "
                                "every prompt is rendered in full")
        return self._renderer is not None

    def ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
            kwargs: dict[str, Any] | None, limit: int | None,
            timer: StageTimer | None = None) -> TokenIds:
        """The prompt's token ids (`encode_prompt`: `TokenIds`; refused past ``limit``
        tokens when one is given); marks ``render_start``, ``rendered`` and ``tokenized`` on
        ``timer``."""
        if timer is not None:
            timer.mark("render_start")
        self.prepare()
        if self._renderer is not None:
            text = self._renderer.render_text(messages, tools, kwargs)
        else:
            text = template_text(self.tokenizer, messages, tools, kwargs)
        if timer is not None:
            timer.mark("rendered")
        ids = encode_prompt(self.tokenizer, self.encoder, text, limit)
        if timer is not None:
            timer.mark("tokenized")
        return ids

    def prepare_resume(self, messages: list[dict[str, Any]] | None = None) -> None:
        """Idle-time work for the resume of the prompt of ``messages`` (else the latest;
        `IncrementalChatRenderer.prepare_resume`); any failure only leaves it to the
        resume."""
        if self._renderer is not None:
            try:
                self._renderer.prepare_resume(messages)
            except Exception:  # the resume renders it, or falls back to a full render
                logger.debug("preparing the resume failed", exc_info=True)


def _has_template(tokenizer: Any) -> bool:
    return tokenizer is not None and getattr(tokenizer, "chat_template", None) is not None
