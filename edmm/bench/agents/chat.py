"""A trace job as a chat conversation: the agent type's tools and system prompt, the messages
a client sends turn after turn, and what of each prompt the server already saw.

An agent type (``Job.agent``) becomes a system message and a list of tools, identical in every
session of the type (seeded by the type's name and the run's tag), so the rendered prefix is
token-identical across them: the tools are the type's tool names in the trace, each with a
description sized so the schemas take `tool_schema_share` of the type's ``prefix_tokens``,
and parameters every engine's grammar closes in a few tokens (one enumerated string); the
system text takes the rest. A job without a type keeps the single `TOOL` and a system prompt
of its own. The parameters are an enumerated string and a string of `CALL_DIGITS` digits: the
first a grammar fixes (an engine may compute it with the prompt, as edmm serve's grammar
fast-forward does), the second every engine decodes one token a digit (Qwen2's tokenizer
splits numbers into single digits), as a real call's free arguments are decoded.

`Conversation` keeps the messages and, for each turn, where the messages sent so far end in
tokens (from the server's ``usage``: a reply's prompt tokens are the tokens before it). A turn
that keeps only the first ``keep_tokens`` of the context (a compaction) keeps the messages up
to the last such boundary at or before it; what a turn's prompt adds to the context kept from
before it is its ``new_tokens`` (what an unbounded prefix cache could not serve).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from edmm.agent.render import template_view
from edmm.bench.agents.fleet import AGENTS
from edmm.bench.agents.trace import Job
from edmm.bench.live import TOOL, TOOL_NAME

DEFAULT_TOOL_SHARE = 0.7  # of a shared prefix, in tool schemas, for types not in `AGENTS`
CALL_DIGITS = 32  # free characters of every forced call's arguments (decoded, never forced)
_PARAMETERS = {"type": "object",
               "properties": {"key": {"type": "string", "enum": ["record"]},
                              "n": {"type": "string", "pattern": f"^[0-9]{{{CALL_DIGITS}}}$"}},
               "required": ["key", "n"], "additionalProperties": False}


def tool_schema_share(agent: str) -> float:
    """The part of ``agent``'s shared prefix its tool schemas take (`AGENTS`' split)."""
    for profile in AGENTS:
        if profile.name == agent:
            return profile.tool_schema_tokens / profile.prefix_tokens
    return DEFAULT_TOOL_SHARE


def agent_tools(jobs: Sequence[Job]) -> dict[str, tuple[str, ...]]:
    """Per agent type, the tool names its jobs call (sorted: every session the same list)."""
    out: dict[str, set[str]] = {}
    for job in jobs:
        if job.agent:
            names = out.setdefault(job.agent, set())
            names.update(t.tool for t in job.turns if t.tool is not None)
    return {a: tuple(sorted(n)) or (TOOL_NAME,) for a, n in out.items()}


@dataclass(frozen=True)
class AgentChat:
    """An agent type's system message and tools (the shared prefix)."""

    system: str
    tools: list[dict[str, Any]]
    prefix_tokens: int  # rendered tokens of the system message with the tools


class ChatTexts:
    """Text of about a number of tokens, and the agent types' shared prefixes, for one
    tokenizer (``text`` draws words; `count` renders with the chat template)."""

    def __init__(self, tokenizer: Any, words: Sequence[str]) -> None:
        self.tok, self.words = tokenizer, tuple(words)
        sample = " ".join(self.words * 20)
        self.per_word = len(tokenizer.encode(sample, add_special_tokens=False)) / (
            len(self.words) * 20)
        self._agents: dict[tuple[str, str, int], AgentChat] = {}

    def text(self, rng: random.Random, tokens: int) -> str:
        """Random words of about ``tokens`` tokens."""
        n = max(1, round(tokens / self.per_word))
        return " ".join(rng.choice(self.words) for _ in range(n))

    def count(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
              generation: bool = False) -> int:
        """Tokens of ``messages`` with ``tools`` as the chat template renders them."""
        text = self.tok.apply_chat_template(template_view(self.tok, messages), tools=tools,
                                            tokenize=False, add_generation_prompt=generation)
        return len(self.tok.encode(text, add_special_tokens=False))

    def agent(self, name: str, names: Sequence[str], prefix_tokens: int, tag: str) -> AgentChat:
        """The shared prefix of agent type ``name`` (its ``names`` of tools) of about
        ``prefix_tokens`` tokens; the same for every call with the same arguments."""
        key = (name, tag, prefix_tokens)
        if key not in self._agents:
            self._agents[key] = self._build(name, names, prefix_tokens, tag)
        return self._agents[key]

    def _build(self, name: str, names: Sequence[str], prefix_tokens: int,
               tag: str) -> AgentChat:
        rng = random.Random(f"{tag}/agent/{name}")
        per_tool = max(1, round(prefix_tokens * tool_schema_share(name) / max(len(names), 1)))
        tools = [{"type": "function", "function": {
            "name": tool, "description": self.text(rng, per_tool), "parameters": _PARAMETERS}}
            for tool in names]
        bare = self.count([{"role": "system", "content": ""}], tools)
        system = self.text(rng, max(1, prefix_tokens - bare))
        rendered = self.count([{"role": "system", "content": system}], tools)
        return AgentChat(system, tools, rendered)


def job_chat(texts: ChatTexts, job: Job, tools_of: Mapping[str, Sequence[str]], tag: str,
             task: str) -> tuple[AgentChat, str]:
    """The job's shared prefix (its agent type's; a job without one: the single `TOOL` and a
    system prompt of its own, no shared tokens) and its first user message."""
    rng = random.Random(f"{tag}/{job.job_id}")
    if not job.agent:
        system = texts.text(rng, max(1, job.system_tokens - texts.count(
            [{"role": "system", "content": ""}, {"role": "user", "content": task}], [TOOL],
            generation=True)))
        return AgentChat(system, [TOOL], 0), task
    chat = texts.agent(job.agent, tools_of.get(job.agent, (TOOL_NAME,)), job.prefix_tokens, tag)
    own = job.system_tokens - job.prefix_tokens
    return chat, texts.text(rng, own) if own > 8 else task


@dataclass
class Conversation:
    """The messages of one session and where, in tokens, each turn's messages ended."""

    messages: list[dict[str, Any]]
    shared_tokens: int  # tokens of ``messages[:1]`` (the shared prefix; 0: none)
    boundaries: list[tuple[int, int]] = field(default_factory=list)  # (tokens, messages)
    kept: int = 0  # tokens of the next prompt the context before it held

    def __post_init__(self) -> None:
        self.boundaries = [(self.shared_tokens, 1)]

    def replied(self, prompt_tokens: int, completion_tokens: int,
                message: dict[str, Any]) -> None:
        """The server answered ``message`` to a prompt of ``prompt_tokens`` tokens."""
        self.boundaries.append((prompt_tokens, len(self.messages)))
        self.messages.append(message)
        self.kept = prompt_tokens + completion_tokens

    def keep(self, tokens: int) -> None:
        """Keep the messages through the last boundary at or before ``tokens``; the system
        message (the shared prefix, the first boundary) is always kept, and counted kept."""
        at, n = max((b for b in self.boundaries if b[0] <= tokens), default=self.boundaries[0])
        del self.messages[n:]
        self.boundaries = [b for b in self.boundaries if b[1] <= n]
        self.kept = at

    def add(self, *messages: dict[str, Any]) -> None:
        """Messages appended after the kept context."""
        self.messages.extend(messages)


__all__ = ["AgentChat", "ChatTexts", "Conversation", "agent_tools", "job_chat",
           "tool_schema_share"]
