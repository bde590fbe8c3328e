"""`IncrementalChatRenderer`: the text and ids of an incremental render equal a full render's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conversations import TEXT, conversations, tool_lists, user_message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edmm.model.prompt_encoder import PromptEncoder
from edmm.server.incremental import IncrementalChatRenderer


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


def _full(tok: Any) -> Any:
    def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               kwargs: dict[str, Any] | None, generation: bool) -> str:
        return str(tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                           add_generation_prompt=generation, **(kwargs or {})))
    return render


@st.composite
def _turns(draw: st.DrawFn) -> list[list[dict[str, Any]]]:
    """Requests of one agent: each the previous plus new messages, sometimes with an earlier
    user message changed (a memory block inserted mid-prompt) or a new user query (the
    earlier reasoning is then stripped)."""
    conv = draw(conversations(max_turns=5))
    cuts = sorted(draw(st.lists(st.integers(1, len(conv)), min_size=1, max_size=5)))
    requests = []
    for cut in cuts:
        msgs = [dict(m) for m in conv[:cut]]
        users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
        if users and draw(st.integers(0, 3)) == 0:
            i = draw(st.sampled_from(users))
            msgs[i]["content"] += f"\n\n<memory>\n{draw(TEXT)}\n</memory>"
        if draw(st.integers(0, 4)) == 0:
            msgs.append(draw(user_message()))
        requests.append(msgs)
    return requests


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=_turns(), tools=tool_lists(), thinking=st.sampled_from([None, False]))
def test_incremental_equals_full_render(tok: Any, requests: list[list[dict[str, Any]]],
                                        tools: list[dict[str, Any]] | None,
                                        thinking: bool | None) -> None:
    full = _full(tok)
    kwargs = None if thinking is None else {"enable_thinking": thinking}
    renderer = IncrementalChatRenderer(full, PromptEncoder(tok).encode)
    for msgs in requests:
        expected = full(msgs, tools, kwargs, True)
        assert renderer.render_text(msgs, tools, kwargs) == expected
        assert renderer.render_ids(msgs, tools, kwargs) == tok.encode(
            expected, add_special_tokens=False)


def test_a_resume_renders_only_the_new_messages(tok: Any) -> None:
    """An agent's resume: the shared messages up to the last query are not rendered again."""
    full = _full(tok)
    renderer = IncrementalChatRenderer(full, verify=True)
    convo: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    for i in range(20):
        convo += [{"role": "user", "content": f"padding {i}"},
                  {"role": "assistant", "content": "Noted."}]
    convo.append({"role": "user", "content": "Look it up."})
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]}
    renderer.render_text(convo, None)
    assert renderer.stats.full_renders == 1
    before = renderer.stats.rendered_messages
    resume = [*convo, call, {"role": "tool", "tool_call_id": "c1", "content": "found"}]
    assert renderer.render_text(resume, None) == full(resume, None, None, True)
    assert renderer.stats.full_renders == 1 and renderer.stats.reused_messages == 40
    # Two windows (the earlier prompt's, to find where the query starts; the new one) of
    # the system message, the query and what follows it.
    assert renderer.stats.rendered_messages - before == (1 + 1) + (1 + 3)
    again = [*resume, {"role": "assistant", "content": "Done."},
             {"role": "user", "content": "Thanks."}]
    assert renderer.render_text(again, None) == full(again, None, None, True)
    assert renderer.stats.full_renders == 1


def test_a_changed_first_message_renders_in_full(tok: Any) -> None:
    full = _full(tok)
    renderer = IncrementalChatRenderer(full)
    convo = [{"role": "system", "content": "A."}, {"role": "user", "content": "q"}]
    renderer.render_text(convo, None)
    other = [{"role": "system", "content": "B."}, {"role": "user", "content": "q"}]
    assert renderer.render_text(other, None) == full(other, None, None, True)
    assert renderer.stats.full_renders == 2
