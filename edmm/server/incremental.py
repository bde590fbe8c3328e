"""Incremental chat rendering: render only the messages that are new since an earlier request.

Rendering a conversation with a Jinja chat template costs per message (the sandbox checks
every attribute read), so an agent's resume re-renders dozens of unchanged messages to append
one tool result. `IncrementalChatRenderer` keeps the text of recent prompts and, for a new
request sharing a prefix of messages with one of them, renders only a *window*: the leading
system message (the template's header: system text and tools) and the messages from the last
user query before the first changed message on; the new text is the earlier prompt's text up
to that query plus the window's text after its header.

A window that the template refuses (e.g. a template that checks how roles alternate) falls
back to a full render, whose error, if any, is the request's.

This is exact for templates of the Hermes/Qwen family, whose text of a message depends only on
the tools, the first message, the message's neighbours and the index of the last user query
(``reasoning_content`` is shown only after it): the messages before a user query that both
requests share render the same in both. The property test
(``tests/server/test_incremental_render.py``) checks it against full renders of random
conversations (tools, parallel calls, reasoning stripping, mid-prompt memory blocks). Every
step that could go wrong for another template is checked on the texts (the window's header
is the header alone rendered; the earlier prompt ends with its own window's text), and falls
back to a full render if not; ``verify=True`` also compares with a full render every time.

**Awaited resumes.** When a turn ends in tool calls, `await_resume` prepares the resume that
answers them (the prompt, the reply, one tool message per call, in order) as text *around* the
results (`edmm.agent.render.text_around_results`, the home of next-prompt rendering): the
window is rendered twice with random placeholder results (of two lengths, with whitespace at
both ends) and must come out as the same pieces around them, each placeholder verbatim. The
resume that carries exactly those messages is then the pieces joined with its results: no
template runs. `slots_exact` probes this route on the template (results with markup,
whitespace and JSON) before a server trusts it. Awaited prompts (also a predicted next
request, `expect`) are kept by the first call id their resume answers, out of the recent
prompts, so that a resume finds its prompt however many other sessions' prompts came since;
the oldest are dropped past ``awaited`` sessions or ``awaited_chars`` characters of text.

Not thread-safe: one thread (the server's tokenizing thread) owns it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from edmm.agent.render import text_around_results

# (messages, tools, chat_template_kwargs, add_generation_prompt) -> prompt text
RenderFn = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any] | None,
                     bool], str]


class IncrementalRenderError(RuntimeError):
    """``verify=True`` found an incremental render that differs from the full render."""


# Requests of one agent that exercise what a template's text of a message may depend on:
# tools, the system message, parallel calls and their grouped results, reasoning shown only
# after the last user query, a new query, a memory block inserted mid-prompt. `is_exact` runs
# them with ``verify=True`` before a server trusts the incremental route of its template.
_CALL = {"id": "probe_1", "type": "function",
         "function": {"name": "probe", "arguments": '{"key": "a"}'}}
_CALL2 = {"id": "probe_2", "type": "function",
          "function": {"name": "probe", "arguments": '{"key":"b"}'}}
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": "probe", "description": "Look a key up.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}}}}}]
_BASE: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a probe."},
    {"role": "user", "content": "First question."},
    {"role": "assistant", "content": "Noted."},
    {"role": "user", "content": "Second question."}]
_TURN: list[dict[str, Any]] = [
    {"role": "assistant", "content": "", "reasoning_content": "Look both up.",
     "tool_calls": [_CALL, _CALL2]},
    {"role": "tool", "tool_call_id": "probe_1", "content": " one\n"},
    {"role": "tool", "tool_call_id": "probe_2",
     "content": '{"key": "<tool_response>two</tool_response>"}\t'}]
_MEMORY = {"role": "user", "content": "Second question.\n\n<memory>\nkept\n</memory>"}
PROBE_REQUESTS: tuple[list[dict[str, Any]], ...] = (
    _BASE,
    [*_BASE, *_TURN],
    [*_BASE, *_TURN, {"role": "assistant", "content": "<think>\nDone.\n</think>\n\nBoth."},
     {"role": "user", "content": "Third question."}],
    [*_BASE[:3], _MEMORY, *_TURN],
    [*_BASE[1:], *_TURN],
)


@dataclass(eq=False)
class RenderedPrompt:
    """A rendered prompt: its messages, tools, kwargs and text; ``starts``: where its user
    queries start in the text (those found so far); ``encoded``: what its caller derived from
    the text (`edmm.server.chat_prompts.ChatPrompts` keeps its ids' handle there)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    kwargs: dict[str, Any] | None
    text: str
    starts: dict[int, int] = field(default_factory=dict)  # user message index -> char offset
    encoded: Any = None


@dataclass(eq=False)
class ResumeSlots:
    """The text of an awaited resume around its results: ``pieces[0] + result_0 + pieces[1]
    + ... + pieces[n]`` for the ``head`` messages (the prompt and its reply) and one tool
    message per call id, in order; ``encoded``: the caller's handle of ``pieces[0]``."""

    head: list[dict[str, Any]]
    call_ids: list[str]
    tools: list[dict[str, Any]] | None
    kwargs: dict[str, Any] | None
    pieces: list[str]
    query: tuple[int, int]  # the last user query: its message index, its char offset
    encoded: Any = None

    def fill(self, messages: Sequence[dict[str, Any]]) -> str | None:
        """The text of ``messages`` if they are the awaited resume, else None."""
        h = len(self.head)
        if len(messages) != h + len(self.call_ids) or _shared_prefix(self.head, messages) != h:
            return None
        parts = [self.pieces[0]]
        for k, m in enumerate(messages[h:]):
            content = m.get("content")
            if (m.keys() != _TOOL_KEYS or m["role"] != "tool" or not isinstance(content, str)
                    or m["tool_call_id"] != self.call_ids[k]):
                return None
            parts += (content, self.pieces[k + 1])
        return "".join(parts)


_TOOL_KEYS = frozenset({"role", "content", "tool_call_id"})  # a tool message's, as templated
Awaited = RenderedPrompt | ResumeSlots


class AwaitedPrompts:
    """Awaited prompts by the first call id their resume answers, bounded by sessions (keys)
    and by the characters of text held; the least recently added key is dropped first, the
    latest is always kept."""

    def __init__(self, sessions: int, chars: int) -> None:
        self._items: OrderedDict[str, list[Awaited]] = OrderedDict()
        self._sessions = sessions
        self._max_chars = chars
        self.chars = 0  # characters of text held

    def __len__(self) -> int:
        return len(self._items)

    def add(self, key: str, item: Awaited) -> None:
        """Keep ``item`` under ``key`` (the latest), dropping the oldest keys past the bounds."""
        self._items.setdefault(key, []).append(item)
        self._items.move_to_end(key)
        self.chars += _chars(item)
        while len(self._items) > 1 and (len(self._items) > self._sessions
                                        or self.chars > self._max_chars):
            self._drop(next(iter(self._items)))

    def get(self, key: str) -> Sequence[Awaited]:
        return self._items.get(key, ())

    def pop(self, key: str) -> None:
        """Drop ``key``'s items (its session resumed)."""
        self._drop(key)

    def _drop(self, key: str) -> None:
        self.chars -= sum(_chars(item) for item in self._items.pop(key, ()))


def _chars(item: Awaited) -> int:
    return len(item.text) if isinstance(item, RenderedPrompt) else sum(map(len, item.pieces))


@dataclass
class RenderStats:
    """Messages rendered (windows and full renders) and taken from earlier prompts' text;
    ``same_prompts``: prompts whose every message, tools and kwargs an earlier prompt had
    (its text taken whole); ``slot_renders``: awaited resumes joined from their pieces."""

    rendered_messages: int = 0
    reused_messages: int = 0
    full_renders: int = 0
    window_renders: int = 0
    same_prompts: int = 0
    slot_renders: int = 0  # awaited resumes joined from their pieces (no template run)


class IncrementalChatRenderer:
    """Prompt text (and ids) of conversations, rendering only what is new; see the module
    docstring.

    Args:
        render: the full render of a conversation (the chat template, tools, kwargs, whether
            to add the generation prompt); its errors pass through.
        encode: token ids of a prompt text (e.g. `PromptEncoder.encode`, which reuses the
            ids of the shared text prefix); used by `render_ids`.
        capacity: recent prompts kept (the oldest dropped first).
        verify: also render in full and raise `IncrementalRenderError` on a difference.
        awaited: sessions whose awaited resume is kept (the oldest dropped first).
        awaited_chars: characters of awaited text kept, all sessions together (the oldest
            dropped first; the latest is always kept). With its ids a character costs ~10
            bytes, so the default (2**25) bounds the store near 350 MB whatever the contexts.
        slots: prepare awaited resumes as pieces around their results (`await_resume`).
    """

    def __init__(self, render: RenderFn, encode: Callable[[str], list[int]] | None = None,
                 capacity: int = 16, verify: bool = False, awaited: int = 256,
                 awaited_chars: int = 1 << 25, slots: bool = True) -> None:
        self._render = render
        self._encode = encode
        self._recent: deque[RenderedPrompt] = deque(maxlen=capacity)
        self._verify = verify
        self._last_header: tuple[tuple[Any, ...], str] | None = None
        self._awaited = AwaitedPrompts(awaited, awaited_chars)
        self.slots = slots
        self.stats = RenderStats()

    def is_exact(self) -> bool:
        """True when the incremental route gives the full render's text on `PROBE_REQUESTS`
        (with a tool and without) and reuses text there; a template that fails (its text of
        a message depends on more than the module docstring says, or it refuses the probe)
        should be rendered in full. The probe is not kept among the recent prompts."""
        checker = IncrementalChatRenderer(self._render, capacity=len(PROBE_REQUESTS),
                                          verify=True, slots=False)
        try:
            for tools in (_PROBE_TOOLS, None):
                for messages in PROBE_REQUESTS:
                    checker.render_text(messages, tools)
        except Exception:  # a difference, or a template that refuses the probe
            return False
        return checker.stats.reused_messages > 0

    def slots_exact(self) -> bool:
        """True when awaited resumes joined from their pieces (`await_resume`) give the full
        render's text on the probe's tool turn (two parallel calls, results with markup,
        JSON and whitespace at their ends), with a tool and without; else a server should
        set `slots` False (the window route stays)."""
        checker = IncrementalChatRenderer(self._render, verify=True)
        try:
            for tools in (_PROBE_TOOLS, None):
                base = checker.render(_BASE, tools)[0]
                if checker.await_resume(base, _TURN[0]) is None:
                    return False
                checker.render_text([*_BASE, *_TURN], tools)
        except Exception:  # a difference, or a template that refuses the probe
            return False
        return checker.stats.slot_renders == 2

    def render_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                   kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of the prompt (generation prompt added)."""
        if self._encode is None:
            raise ValueError("render_ids needs an encode function")
        return self._encode(self.render_text(messages, tools, kwargs))

    def render_text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text (generation prompt added), equal to ``render(messages, tools,
        kwargs, True)``."""
        return self.render(messages, tools, kwargs)[0].text

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               kwargs: dict[str, Any] | None = None) -> tuple[RenderedPrompt, Any]:
        """`render_text`'s prompt, and the ``encoded`` handle of an earlier text that shares
        its prefix (the prompt it was made from; None if rendered in full)."""
        found = self._take_awaited(messages, tools, kwargs)
        if found is None:
            same = self._take_same(messages, tools, kwargs)
            found = (same, same.encoded) if same is not None else None
        if found is None:
            found = self._incremental(messages, tools, kwargs)
        if found is None:
            found = (RenderedPrompt(list(messages), tools, kwargs,
                                    self._render(messages, tools, kwargs, True)), None)
            self.stats.full_renders += 1
            self.stats.rendered_messages += len(messages)
        elif self._verify and found[0].text != self._render(messages, tools, kwargs, True):
            raise IncrementalRenderError("the incremental render differs from the full one")
        self._recent.append(found[0])
        return found

    def prepare_resume(self, prompt: RenderedPrompt | Sequence[dict[str, Any]] | None = None,
                       ) -> bool:
        """Find, ahead of time, where a prompt's last user query starts in its text (what a
        resume of it, which shares every message up to that query, needs: otherwise its
        render renders that window of the earlier prompt too); return whether it is known.
        ``prompt``: the turn that just ended (`render`'s), or the latest recent prompt of
        its messages (other sessions' prompts may have come after it), else the latest
        prompt. Meant for idle time on the owning thread, after that prompt was answered."""
        entry = prompt if isinstance(prompt, RenderedPrompt) else self._find(prompt)
        return entry is not None and self._query(entry) is not None

    def await_resume(self, prompt: RenderedPrompt, reply: dict[str, Any],
                     ) -> ResumeSlots | None:
        """`prepare_resume`, and the pieces of the resume that answers ``reply``'s tool calls
        (see the module docstring), kept for that resume; None when `slots` is off, the reply
        calls no tool, or the template does not render placeholder results verbatim."""
        query = self._query(prompt)
        calls = reply.get("tool_calls") or []
        ids: list[str] = [c["id"] for c in calls
                          if isinstance(c, dict) and isinstance(c.get("id"), str)]
        if (not self.slots or query is None or not ids or len(ids) != len(calls)
                or len(set(ids)) != len(ids)):
            return None
        head = [*prompt.messages, reply]

        def render(marks: list[str]) -> str | None:  # the window, as a client sends results
            rendered = self._on_base(prompt, [*head, *(
                {"role": "tool", "content": m, "tool_call_id": i} for m, i in zip(marks, ids,
                                                                                    strict=True))],
                                     query[0], prompt.tools, prompt.kwargs)
            return rendered[0].text if rendered is not None else None

        pieces = text_around_results(render, len(ids))
        if pieces is None:
            return None
        slots = ResumeSlots(head, ids, prompt.tools, prompt.kwargs, pieces, query)
        self._awaited.add(ids[0], slots)
        return slots

    def expect(self, prompt: RenderedPrompt) -> bool:
        """Keep ``prompt`` (e.g. a predicted next request) for the resume that sends its
        messages, by the first call id of its trailing tool messages; False if it has none."""
        n = _trailing_tools(prompt.messages)
        if n == 0:
            return False
        self._awaited.add(prompt.messages[-n]["tool_call_id"], prompt)
        return True

    def _take_awaited(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      kwargs: dict[str, Any] | None) -> tuple[RenderedPrompt, Any] | None:
        """The awaited prompt these messages send (its resume's), found by the call id they
        answer first; that session's awaited prompts are dropped (it resumed)."""
        n = _trailing_tools(messages)
        key = messages[-n].get("tool_call_id") if n else None
        if not isinstance(key, str):
            return None
        for item in self._awaited.get(key):
            if item.tools != tools or item.kwargs != kwargs:
                continue
            if isinstance(item, RenderedPrompt):
                if not _same(item.messages, messages):
                    continue
                self._forget(item)
                self.stats.same_prompts += 1
                found = (item, item.encoded)
            else:
                text = item.fill(messages)
                if text is None:
                    continue
                j, start = item.query
                self.stats.slot_renders += 1
                found = (RenderedPrompt(list(messages), tools, kwargs, text, {j: start}),
                         item.encoded)
            self._awaited.pop(key)
            self.stats.reused_messages += len(messages)
            return found
        return None

    def _forget(self, entry: RenderedPrompt) -> None:
        """Take ``entry`` out of the recent prompts (`render` puts it back last)."""
        for i, e in enumerate(self._recent):
            if e is entry:
                del self._recent[i]
                return

    def _find(self, messages: Sequence[dict[str, Any]] | None) -> RenderedPrompt | None:
        """The latest recent prompt of exactly ``messages`` (any tools), or the latest."""
        if messages is None:
            return self._recent[-1] if self._recent else None
        return next((e for e in reversed(self._recent) if _same(e.messages, messages)), None)

    def _query(self, entry: RenderedPrompt) -> tuple[int, int] | None:
        """The index of ``entry``'s last user query and where it starts in its text."""
        j = _last_user_before(entry.messages, len(entry.messages))
        if j is None or j <= self._header_len(entry.messages):
            return None
        start = self._start(entry, j)
        return (j, start) if start is not None else None

    def _take_same(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                   kwargs: dict[str, Any] | None) -> RenderedPrompt | None:
        """The recent prompt of exactly these messages, tools and kwargs (e.g. a retry): its
        text is this one's, nothing is rendered. Taken out of the recent prompts (`render`
        puts it back last)."""
        for i in range(len(self._recent) - 1, -1, -1):
            entry = self._recent[i]
            if (entry.tools == tools and entry.kwargs == kwargs
                    and _same(entry.messages, messages)):
                del self._recent[i]
                self.stats.reused_messages += len(messages)
                self.stats.same_prompts += 1
                return entry
        return None

    def _incremental(self, messages: list[dict[str, Any]],
                     tools: list[dict[str, Any]] | None,
                     kwargs: dict[str, Any] | None) -> tuple[RenderedPrompt, Any] | None:
        base, j = self._best_base(messages, tools, kwargs)
        if base is None:
            return None
        return self._on_base(base, messages, j, tools, kwargs)

    def _on_base(self, base: RenderedPrompt, messages: list[dict[str, Any]], j: int,
                 tools: list[dict[str, Any]] | None,
                 kwargs: dict[str, Any] | None) -> tuple[RenderedPrompt, Any] | None:
        """``messages`` rendered from user query ``j`` on, ``base``'s text before it (the two
        share every message before ``j``), and ``base``'s handle."""
        start = self._start(base, j)
        if start is None:
            return None
        body = self._window_body(messages, j, tools, kwargs)
        if body is None:
            return None
        self.stats.reused_messages += j - self._header_len(messages)
        return (RenderedPrompt(list(messages), tools, kwargs, base.text[:start] + body,
                               {j: start}), base.encoded)

    def _best_base(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                   kwargs: dict[str, Any] | None) -> tuple[RenderedPrompt | None, int]:
        """The recent prompt whose shared messages reach the latest user query (its index)."""
        best: tuple[RenderedPrompt | None, int] = (None, 0)
        most = _last_user_before(messages, len(messages))  # no base can do better
        for entry in reversed(self._recent):
            if entry.tools != tools or entry.kwargs != kwargs:
                continue
            shared = _shared_prefix(entry.messages, messages)
            j = _last_user_before(messages, shared)
            if j is not None and j > best[1] and j > self._header_len(messages):
                best = (entry, j)
                if j == most:
                    break
        return best

    def _start(self, entry: RenderedPrompt, j: int) -> int | None:
        """Where user message ``j`` starts in ``entry``'s text, from a window render of the
        entry (checked: its text ends with the window's)."""
        if j in entry.starts:
            return entry.starts[j]
        body = self._window_body(entry.messages, j, entry.tools, entry.kwargs)
        if body is None or not entry.text.endswith(body):
            return None
        entry.starts[j] = len(entry.text) - len(body)
        return entry.starts[j]

    def _window_body(self, messages: list[dict[str, Any]], j: int,
                     tools: list[dict[str, Any]] | None,
                     kwargs: dict[str, Any] | None) -> str | None:
        """The text of messages ``j:`` (generation prompt added), after the header; None if
        the window's render does not start with the header's."""
        head = messages[:self._header_len(messages)]
        try:
            # No system message: no header (a template that adds a default system prompt
            # then fails the caller's check, and the request is rendered in full).
            header = self._header(head, tools, kwargs)
            window = self._render([*head, *messages[j:]], tools, kwargs, True)
        except Exception:  # the full render decides: its text, or its error
            return None
        self.stats.window_renders += 1
        self.stats.rendered_messages += len(head) + len(messages) - j
        if not window.startswith(header):
            return None
        return window[len(header):]

    def _header(self, head: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                kwargs: dict[str, Any] | None) -> str:
        """The text of the leading system message alone (the last one is kept)."""
        if not head:
            return ""
        key = (head, tools, kwargs)
        if self._last_header is not None and self._last_header[0] == key:
            return self._last_header[1]
        text = self._render(head, tools, kwargs, False)
        self._last_header = (key, text)
        return text

    @staticmethod
    def _header_len(messages: Sequence[dict[str, Any]]) -> int:
        return 1 if messages and messages[0].get("role") == "system" else 0


def _same(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]]) -> bool:
    """Whether ``a`` and ``b`` are the same messages."""
    return len(a) == len(b) and _shared_prefix(a, b) == len(a)


def _shared_prefix(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]]) -> int:
    """How many leading messages ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x is not y and x != y:
            break
        n += 1
    return n


def _last_user_before(messages: Sequence[dict[str, Any]], end: int) -> int | None:
    """Index of the last user query among ``messages[:end]`` (not a tool-response wrapper)."""
    for i in range(min(end, len(messages)) - 1, -1, -1):
        m = messages[i]
        content = m.get("content")
        if m.get("role") == "user" and isinstance(content, str) and not (
                content.startswith("<tool_response>") and content.endswith("</tool_response>")):
            return i
    return None


def _trailing_tools(messages: Sequence[dict[str, Any]]) -> int:
    """How many tool messages end ``messages``."""
    n = 0
    while n < len(messages) and messages[-1 - n].get("role") == "tool":
        n += 1
    return n

