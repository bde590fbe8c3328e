"""`AgentEngine`: an `Engine` that knows each agent session's execution state.

One engine loop calls `step()`; sessions move through `SessionState` as their turns run::

    agent = AgentEngine()                                  # the embedded tiny model on the CPU
    agent.add_request("t0", prompt_ids, params, session_id="s")
    ... step() until "t0" finishes                          # session "s" is FINISHED
    agent.await_tools("s", [ToolCall("c1", "get_weather", '{"city": "Paris"}')],
                      messages=messages, tools=tools)       # AWAITING_TOOL: speculation starts
    agent.feed_tool_output("s", "c1", '{"temp')              # optional: streamed output
    agent.predict_tool_result("s", "c1", '{"temp": 21}')    # optional: a predicted result
    ... step() keeps running other sessions; speculation uses the capacity they leave
    agent.resume("s", "t1", [ToolResult("c1", '{"temp": 21}')], params)  # RESUMING
    ... step(): the best branch is committed by slot swap, only what is new is prefilled

Not thread-safe: call every method from the thread that calls `step()`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from edmm.agent.types import (
    AgentConfig,
    SessionMetrics,
    SessionState,
    TokenLayout,
    ToolCall,
    ToolContent,
    ToolResult,
    ToolSpec,
)
from edmm.engine import Engine, EngineConfig, RequestOutput, SamplingParams
from edmm.engine.engine import PromptInput

Message = Mapping[str, Any]


class AgentEngine:
    """Agent sessions over an `Engine`: pause at tool calls, speculate in the tool window,
    commit the best branch zero-copy at resume.

    Args:
        engine: the engine to drive, or the config to build one (None: the tiny model).
        config: agent settings (speculation sources, retention policy, tool deadline).
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, engine: Engine | EngineConfig | None = None,
                 config: AgentConfig | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: PromptInput,
                    params: SamplingParams | None = None, *,
                    session_id: str | None = None) -> None:
        """Queue a request; with ``session_id``, a turn of that session (created if new; a
        FINISHED session takes its next user turn). Raises `SessionStateError` if the session
        is generating, awaiting a tool (use `resume`) or abandoned."""
        raise NotImplementedError

    def step(self) -> list[RequestOutput]:
        """One engine step; also abandons sessions past their tool deadline and advances
        session states. Returns the outputs of requests that got a token."""
        raise NotImplementedError

    def has_unfinished(self) -> bool:
        """True while any request (not speculation) waits or runs."""
        raise NotImplementedError

    def has_speculation(self) -> bool:
        """True while some speculation branch is still being prefilled."""
        raise NotImplementedError

    def abort(self, request_id: str) -> bool:
        """Stop a request; its session (if any) becomes FINISHED. False if unknown."""
        raise NotImplementedError

    # ------------------------------------------------------------------ tool window
    def declare_tool(self, spec: ToolSpec) -> None:
        """Declare a tool's properties (idempotent -> results memoised, expected duration)."""
        raise NotImplementedError

    def await_tools(self, session_id: str, tool_calls: Sequence[ToolCall], *,
                    messages: Sequence[Message] | None = None,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    layout: TokenLayout | None = None,
                    expected_duration_s: float | None = None,
                    predictions: Mapping[str, ToolContent] | None = None,
                    deadline_s: float | None = None) -> None:
        """The session's last turn ended in ``tool_calls``: FINISHED -> AWAITING_TOOL.

        ``messages`` (the conversation as the client will send it back, up to and including
        the assistant message with the tool calls) and ``tools`` let the template source render
        the next prompt with the chat template; without them the next prompt follows
        ``layout`` (token ids). ``predictions``: call id -> predicted result.
        ``deadline_s``: seconds until the session is abandoned (default: the config's).
        Raises `SessionStateError` unless the session's turn has finished.
        """
        raise NotImplementedError

    def feed_tool_output(self, session_id: str, call_id: str, chunk: ToolContent) -> None:
        """Append partial output of a running tool; it is prefilled incrementally.
        Raises `UnknownToolCallError` / `SessionStateError`."""
        raise NotImplementedError

    def predict_tool_result(self, session_id: str, call_id: str, result: ToolContent, *,
                            position: int | None = None) -> None:
        """Predict a pending call's result (inserted at token ``position`` of the context, or
        where the layout puts it): the next prompt with it is prefilled in a branch.
        Raises `UnknownToolCallError`, `InsertionPositionError`, `SessionStateError`."""
        raise NotImplementedError

    def resume(self, session_id: str, request_id: str, results: Sequence[ToolResult],
               params: SamplingParams | None = None, *,
               prompt: PromptInput | None = None) -> None:
        """Results arrived: AWAITING_TOOL -> RESUMING, and queue the resume turn.

        ``prompt``: the next prompt exactly as the client sent it (text or ids); None: rendered
        from ``results`` (chat template if the session has messages, else its token layout).
        At admission the longest common token prefix with each branch (and the retained KV)
        is found, the best is committed by slot swap and truncated after the match, and only
        the rest is prefilled. All checks happen first (`SessionStateError`,
        `UnknownToolCallError`, `InsertionPositionError`): on error nothing changes.
        """
        raise NotImplementedError

    # ------------------------------------------------------------------ sessions
    def session_state(self, session_id: str) -> SessionState:
        """The session's state (`UnknownSessionError` if there is none)."""
        raise NotImplementedError

    def session_context(self, session_id: str) -> list[int]:
        """Token ids of the session's conversation as the engine last saw it (a copy)."""
        raise NotImplementedError

    def session_metrics(self, session_id: str) -> SessionMetrics:
        """The session's counters (a copy)."""
        raise NotImplementedError

    def find_session(self, prompt_token_ids: Sequence[int]) -> str | None:
        """The live session whose context is the longest prefix of ``prompt_token_ids``
        (a server without a session header finds a conversation's session this way)."""
        raise NotImplementedError

    def close_session(self, session_id: str) -> None:
        """Abort its request, drop its speculation and retained KV, forget it."""
        raise NotImplementedError

    def check_integrity(self) -> None:
        """Raise if a session breaks its state's invariants, or the engine its own."""
        raise NotImplementedError

    def close(self) -> None:
        """Close every session and the engine (if this object built it)."""
        raise NotImplementedError
