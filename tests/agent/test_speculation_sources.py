"""Speculation sources (template, streamed, predicted / memoised), renderers, retention."""

from __future__ import annotations

import json
from typing import Any

import pytest
from agent_helpers import FakeClock, MakeAgent, drain, greedy, run

from edmm.agent import (
    AgentConfig,
    AgentEngine,
    SessionTag,
    TokenLayout,
    ToolCall,
    ToolResult,
    ToolSpec,
)
from edmm.agent.errors import SessionStateError, UnknownPolicyError
from edmm.agent.render import TemplateRenderer, TokenRenderer, assistant_message
from edmm.agent.retention import RETENTION_POLICIES, PausedSession
from edmm.agent.speculation import SPECULATION_SOURCES
from edmm.engine import EntryRank

CONTEXT_PROMPT = list(range(100, 160))  # 60 tokens; +6 generated = a 66-token context
SUFFIX = (2, 10, 11, 12)  # e.g. "<|im_end|>" + the next assistant header
RESULT = list(range(600, 620))


def first_turn(agent: AgentEngine, session_id: str = "s", prompt: list[int] | None = None,
               ) -> list[int]:
    agent.add_request(f"{session_id}-t0", prompt or CONTEXT_PROMPT, greedy(),
                      session_id=session_id)
    run(agent)
    return agent.session_context(session_id)


def reference_tokens(make_agent: MakeAgent, prompt: list[int]) -> list[int]:
    """Greedy output of ``prompt`` on an engine with no reuse at all."""
    ref = make_agent(enable_prefix_caching=True, num_pages=64).engine
    ref.add_request("ref", prompt, greedy())
    ref.reset_prefix_cache()
    return run(ref)["ref"].outputs[0].token_ids


def resume_and_run(agent: AgentEngine, result: list[int], **kw: Any) -> Any:
    agent.resume("s", "t1", [ToolResult("c1", result, **kw)], greedy())
    return run(agent)["t1"]


# ---------------------------------------------------------------------- renderers
def test_token_renderer_inserts_wraps_and_stops_at_the_first_unknown_result() -> None:
    calls = (ToolCall("c1", "f"), ToolCall("c2", "g"))
    r = TokenRenderer(tuple(range(1, 11)), calls,
                      TokenLayout(before=(90,), after=(91,), suffix=(99,), positions={"c1": 3}))
    assert r.render({}) == [1, 2, 3, 90]
    assert r.render({"c1": [5]}) == [1, 2, 3, 90, 5, 91, *range(4, 11), 90]
    assert r.render({"c1": [5, 6]}, stop_after="c1") == [1, 2, 3, 90, 5, 6]
    assert r.render({"c1": [5], "c2": [6]}) == [1, 2, 3, 90, 5, 91, *range(4, 11), 90, 6, 91, 99]
    moved = r.with_positions({"c2": 0})
    assert moved.render({"c2": [6]}) == [90, 6, 91, 1, 2, 3, 90]


def test_template_renderer_matches_the_chat_template(tiny_dir: Any) -> None:
    from edmm.model import load_tokenizer

    tok = load_tokenizer(tiny_dir)
    calls = (ToolCall("c1", "get_weather", '{"city":"Paris"}'),)
    msgs = ({"role": "user", "content": "Weather in Paris?"},
            assistant_message("Let me check.", calls))
    r = TemplateRenderer(tok, msgs, calls)
    client = [msgs[0], assistant_message("Let me check.", [
        ToolCall("c1", "get_weather", json.dumps(json.loads(calls[0].arguments)))])]
    full = tok.apply_chat_template(
        [*client, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
        add_generation_prompt=True, tokenize=False)
    assert '{"city": "Paris"}' in full  # re-serialised as clients do
    assert r.render({"c1": "sunny"}) == tok.encode(full, add_special_tokens=False)
    head = tok.decode(r.render({}))
    assert full.startswith(head) and head.endswith("<tool_response>\n")


def test_registries_know_the_sources_and_policies() -> None:
    assert {"template", "streamed", "predicted", "prompt"} <= set(SPECULATION_SOURCES)
    assert {"lru", "keep", "cost"} <= set(RETENTION_POLICIES)
    with pytest.raises(UnknownPolicyError):
        SPECULATION_SOURCES.create("oracle")
    with pytest.raises(UnknownPolicyError):
        AgentEngine(config=AgentConfig(retention="forever"))


def test_cost_policy_keeps_sessions_that_return_soon_and_cost_most() -> None:
    cost = RETENTION_POLICIES.create("cost")
    soon = cost.retention(PausedSession(1000, True, 0.5))
    late = cost.retention(PausedSession(1000, True, 30.0))
    small = cost.retention(PausedSession(100, True, 0.5))
    assert soon[0] == late[0] == EntryRank.RETAINED and soon[1] > late[1] and soon[1] > small[1]
    assert cost.retention(PausedSession(1000, False, None))[0] == EntryRank.PLAIN
    assert RETENTION_POLICIES.create("lru").retention(PausedSession(9, True, 1.0)) == (
        EntryRank.PLAIN, 0.0)


def test_cost_policy_does_not_favour_calls_past_their_expected_duration() -> None:
    """Heavy-tailed tools: a call that ran 20 s past an expected 1 s is not 'back any
    moment'; it ranks below a fresh call expected back in 2 s, and with no expected duration
    the older call ranks lower (LRU)."""
    cost = RETENTION_POLICIES.create("cost")
    overdue = cost.retention(PausedSession(1000, True, -20.0, 21.0))
    fresh = cost.retention(PausedSession(1000, True, 2.0, 0.0))
    assert overdue[1] < fresh[1]
    old = cost.retention(PausedSession(1000, True, None, 10.0))
    young = cost.retention(PausedSession(1000, True, None, 1.0))
    assert old[1] < young[1]


# ---------------------------------------------------------------------- sources end to end
@pytest.mark.parametrize("in_place", [True, False])
def test_predicted_result_hit_prefills_only_the_last_token(make_agent: MakeAgent,
                                                           in_place: bool) -> None:
    agent = make_agent(AgentConfig(speculation=("predicted",), speculate_in_place=in_place))
    context = first_turn(agent)
    agent.await_tools("s", [ToolCall("c1", "f")], layout=TokenLayout(suffix=SUFFIX),
                      predictions={"c1": RESULT})
    drain(agent)
    out = resume_and_run(agent, RESULT)
    prompt = [*context, *RESULT, *SUFFIX]
    assert out.prompt_token_ids == prompt
    assert out.num_cached_tokens == len(prompt) - 1
    m = agent.session_metrics("s")
    assert (m.spec_hits, m.spec_partial, m.spec_misses) == (1, 0, 0)
    assert m.tokens_recomputed == 1 and m.tokens_reused == len(prompt) - 1
    assert m.tokens_speculated == len(RESULT) + len(SUFFIX) + 1  # + the context's last token
    assert len(m.commit_s) == 1 and len(m.resume_ttft_s) == 1
    assert out.prefix_hit is not None
    # A branch is committed (the session's old slot retired); in place the slot is the same.
    assert bool(out.prefix_hit.committed) is not in_place
    assert m.spec_in_place == in_place
    assert out.outputs[0].token_ids == reference_tokens(make_agent, prompt)


def test_partly_right_prediction_commits_the_matching_prefix(make_agent: MakeAgent) -> None:
    agent = make_agent()
    context = first_turn(agent)
    wrong_tail = [*RESULT[:12], *range(700, 708)]
    agent.await_tools("s", [ToolCall("c1", "f")], layout=TokenLayout(suffix=SUFFIX),
                      predictions={"c1": wrong_tail})
    drain(agent)
    out = resume_and_run(agent, RESULT)
    prompt = [*context, *RESULT, *SUFFIX]
    assert out.num_cached_tokens == len(context) + 12
    m = agent.session_metrics("s")
    assert (m.spec_hits, m.spec_partial, m.spec_misses) == (0, 1, 0)
    assert m.tokens_recomputed == len(prompt) - len(context) - 12
    assert out.outputs[0].token_ids == reference_tokens(make_agent, prompt)


def test_wrong_mid_prompt_prediction_loses_to_the_retained_kv(make_agent: MakeAgent) -> None:
    agent = make_agent(AgentConfig(speculation=("predicted",)))
    context = first_turn(agent)
    agent.await_tools("s", [ToolCall("c1", "f")])
    agent.predict_tool_result("s", "c1", RESULT, position=10)  # the result is appended instead
    drain(agent)
    out = resume_and_run(agent, RESULT, position=len(context))
    assert out.num_cached_tokens == len(context) - 1  # the session's own KV, not the branch
    m = agent.session_metrics("s")
    assert (m.spec_hits, m.spec_partial, m.spec_misses) == (0, 0, 1)
    assert out.outputs[0].token_ids == reference_tokens(make_agent, [*context, *RESULT])


def test_mid_prompt_prediction_recomputes_nothing_before_the_end(make_agent: MakeAgent) -> None:
    """The bench's group C: a result inserted before a suffix, predicted right."""
    agent = make_agent()
    context = first_turn(agent)
    p = len(context) - 20
    agent.await_tools("s", [ToolCall("c1", "f")], predictions={"c1": RESULT},
                      layout=TokenLayout(positions={"c1": p}))
    drain(agent)
    out = resume_and_run(agent, RESULT)
    prompt = [*context[:p], *RESULT, *context[p:]]
    assert out.prompt_token_ids == prompt and out.num_cached_tokens == len(prompt) - 1
    assert out.outputs[0].token_ids == reference_tokens(make_agent, prompt)

    plain = make_agent(num_pages=64)  # no speculation: recompute from the insertion point
    context = first_turn(plain)
    plain.await_tools("s", [ToolCall("c1", "f")], layout=TokenLayout(positions={"c1": p}))
    assert resume_and_run(plain, RESULT).num_cached_tokens == p


def test_predicted_prompt_prefills_a_result_anywhere(make_agent: MakeAgent) -> None:
    """The server's ``predicted_next_messages``: an earlier part of the prompt edited."""
    agent = make_agent(AgentConfig(speculation=("prompt",)))
    context = first_turn(agent)
    prompt = [*context[:40], *RESULT, *context[42:], *SUFFIX]  # two tokens replaced
    agent.await_tools("s", [ToolCall("c1", "f")])
    agent.predict_prompt("s", [*prompt[:-1], 7])  # a wrong last token
    drain(agent)
    agent.predict_prompt("s", prompt)  # replaces it, continuing its branch
    drain(agent)
    agent.resume("s", "t1", [ToolResult("c1", RESULT)], greedy(), prompt=prompt)
    out = run(agent)["t1"]
    assert out.num_cached_tokens == len(prompt) - 1
    m = agent.session_metrics("s")
    assert (m.spec_hits, m.spec_partial, m.spec_misses) == (1, 0, 0)
    # branched from the session's KV: only the tokens from the edit on were speculated, then
    # the second prediction's last token
    assert m.tokens_speculated == len(prompt) - 40 + 1
    assert out.prefix_hit is not None and out.prefix_hit.committed  # the old slot retired
    assert out.outputs[0].token_ids == reference_tokens(make_agent, prompt)

    plain = make_agent(AgentConfig(speculation=("predicted",)), num_pages=64)
    first_turn(plain)
    plain.await_tools("s", [ToolCall("c1", "f")])
    plain.predict_prompt("s", prompt)  # no "prompt" source: nothing is speculated
    assert not plain.has_speculation()
    plain.resume("s", "t1", [ToolResult("c1", RESULT)], greedy(), prompt=prompt)
    assert run(plain)["t1"].num_cached_tokens == 40


def test_predicted_prompt_changed_at_an_earlier_token_is_a_partial_hit(
        make_agent: MakeAgent) -> None:
    """A resume that differs from the predicted prompt only at one earlier token (same
    length, same last token) commits the branch up to that token and recomputes the rest."""
    agent = make_agent(AgentConfig(speculation=("prompt",)))
    context = first_turn(agent)
    prompt = [*context[:40], *RESULT, *context[42:], *SUFFIX]
    agent.await_tools("s", [ToolCall("c1", "f")])
    agent.predict_prompt("s", prompt)
    drain(agent)
    sent = list(prompt)
    sent[50] = 5  # inside the result: an earlier token than the last, which is the same
    agent.resume("s", "t1", [ToolResult("c1", RESULT)], greedy(), prompt=sent)
    out = run(agent)["t1"]
    assert out.num_cached_tokens == 50
    m = agent.session_metrics("s")
    assert (m.spec_hits, m.spec_partial, m.spec_misses) == (0, 1, 0)
    assert out.outputs[0].token_ids == reference_tokens(make_agent, sent)


def test_streamed_output_is_prefilled_incrementally(make_agent: MakeAgent) -> None:
    agent = make_agent(AgentConfig(speculation=("streamed",)))
    context = first_turn(agent)
    agent.await_tools("s", [ToolCall("c1", "f")], layout=TokenLayout(suffix=SUFFIX))
    agent.feed_tool_output("s", "c1", RESULT[:5])
    drain(agent)
    agent.feed_tool_output("s", "c1", RESULT[5:12])
    drain(agent)
    out = resume_and_run(agent, RESULT)
    assert out.num_cached_tokens == len(context) + 12
    m = agent.session_metrics("s")
    assert m.tokens_recomputed == len(RESULT) - 12 + len(SUFFIX)
    assert m.spec_hits == 1
    # the second chunk continued the first branch's KV: each token speculated once
    assert m.tokens_speculated == 1 + 12
    assert out.outputs[0].token_ids == reference_tokens(
        make_agent, [*context, *RESULT, *SUFFIX])


def test_memoised_result_of_an_idempotent_tool_is_predicted(make_agent: MakeAgent) -> None:
    agent = make_agent()
    agent.declare_tool(ToolSpec("get_weather", cacheable=True))
    first_turn(agent, "a")
    agent.await_tools("a", [ToolCall("x", "get_weather", '{"city": "Paris"}')])
    agent.resume("a", "a-t1", [ToolResult("x", RESULT)], greedy())
    run(agent)
    context = first_turn(agent, "s", prompt=list(range(300, 350)))
    agent.await_tools("s", [ToolCall("c1", "get_weather", '{"city":"Paris"}')],
                      layout=TokenLayout(suffix=SUFFIX))
    drain(agent)
    out = resume_and_run(agent, RESULT)
    assert out.num_cached_tokens == len(context) + len(RESULT) + len(SUFFIX) - 1
    assert agent.session_metrics("s").spec_hits == 1


def test_template_source_prefills_up_to_the_tool_result(make_agent: MakeAgent) -> None:
    speculating = make_agent(max_model_len=512)
    plain = make_agent(AgentConfig(speculation=()), max_model_len=512)
    tok = speculating.tokenizer
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    prompt = tok.encode(tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True,
                                                tokenize=False), add_special_tokens=False)
    outputs = []
    for agent in (speculating, plain):
        first_turn(agent, prompt=prompt)
        text = tok.decode(agent.session_context("s")[len(prompt):])
        calls = [ToolCall("c1", "get_weather", '{"city":"Paris"}')]
        history = [*msgs, assistant_message(text, calls)]
        agent.await_tools("s", calls, messages=history, tools=tools)
        drain(agent)
        client = [*msgs, assistant_message(text, [ToolCall("c1", "get_weather",
                                                           '{"city": "Paris"}')]),
                  {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'}]
        ids = tok.encode(tok.apply_chat_template(client, tools=tools, add_generation_prompt=True,
                                                 tokenize=False), add_special_tokens=False)
        agent.resume("s", "t1", [ToolResult("c1", '{"temp": 21}')], greedy(), prompt=ids)
        outputs.append(run(agent)["t1"].outputs[0].token_ids)
    with_template = speculating.session_metrics("s")
    without = plain.session_metrics("s")
    assert with_template.spec_hits == 1 and without.spec_hits == 0
    tail = tok.encode('{"temp": 21}\n</tool_response><|im_end|>\n<|im_start|>assistant\n',
                      add_special_tokens=False)
    assert with_template.tokens_recomputed <= len(tail) + 1
    assert without.tokens_recomputed > with_template.tokens_recomputed + 10
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("policy,kept", [("cost", True), ("lru", False)])
def test_retention_policy_decides_who_survives_pressure(make_agent: MakeAgent, policy: str,
                                                        kept: bool) -> None:
    agent = make_agent(AgentConfig(retention=policy), num_pages=48)  # 48 pages of 8 tokens
    context = first_turn(agent)  # 66 tokens: 9 pages
    agent.await_tools("s", [ToolCall("c1", "f")], expected_duration_s=5.0)
    for i in range(3):  # other traffic: 124 tokens (16 pages) each, finished -> cache entries
        agent.add_request(f"r{i}", list(range(200 + i, 320 + i)), greedy(4))
        run(agent)
    out = resume_and_run(agent, RESULT)
    assert out.num_cached_tokens == (len(context) - 1 if kept else 0)


@pytest.mark.parametrize("offload", [True, False])
def test_offloaded_session_is_prefetched_before_its_tool_returns(make_agent: MakeAgent,
                                                                 offload: bool) -> None:
    """Pressure pushes a paused session out of the pool: with KV offload it goes to host
    memory and is copied back shortly before its tool is expected back; without, it is
    dropped and recomputed. The resume's output is the same."""
    clock = FakeClock()
    agent = make_agent(AgentConfig(speculation=()), clock=clock, num_pages=36,
                       kv_offload_bytes=(1 << 20) if offload else 0)
    context = first_turn(agent)  # 66 tokens: 9 pages
    agent.await_tools("s", [ToolCall("c1", "f")], expected_duration_s=5.0)
    agent.add_request("big", list(range(200, 450)), greedy(4))  # 32 pages: the session goes
    run(agent)
    cache = agent.engine.kv._index
    assert cache.offloaded_total == int(offload) and cache.num_entries == 1
    while cache.evict_one(max_rank=EntryRank.PLAIN):  # room again (others' entries go)
        pass
    clock.advance(4.0)
    agent.step()  # 1 s before the expected return: more than the lead (0.5 s)
    assert cache.restored_total == 0
    clock.advance(0.6)
    agent.step()  # 0.4 s before: prefetched
    assert cache.restored_total == int(offload)
    agent.check_integrity()
    out = resume_and_run(agent, RESULT)
    assert out.num_cached_tokens == (len(context) - 1 if offload else 0)
    assert out.outputs[0].token_ids == reference_tokens(
        make_agent, agent.session_context("s")[:-len(out.outputs[0].token_ids)])


def test_no_prefetch_while_a_request_waits_for_memory(make_agent: MakeAgent) -> None:
    """Inside the prefetch lead, an offloaded session is not copied back while a request waits
    for memory (the copy would take the pages it waits for, and be evicted again before its
    resume); once nothing waits, it is."""
    clock = FakeClock()
    agent = make_agent(AgentConfig(speculation=()), clock=clock, num_pages=36,
                       kv_offload_bytes=1 << 20)
    first_turn(agent)  # 66 tokens: 9 pages
    agent.await_tools("s", [ToolCall("c1", "f")], expected_duration_s=5.0)
    agent.add_request("big", list(range(200, 450)), greedy(4))  # 32 pages: the session goes
    run(agent)
    cache = agent.engine.kv._index
    while cache.evict_one(max_rank=EntryRank.PLAIN):
        pass
    agent.add_request("hog", list(range(300, 450)), greedy(40))  # 19 pages, then more
    agent.add_request("wait", list(range(500, 650)), greedy(4))  # 19 more: does not fit
    agent.step()
    assert agent.engine.memory_short() and agent.engine.stats().kv.pages_free >= 9
    clock.advance(4.6)
    agent.step()  # inside the lead, 9 pages free, but "wait" waits for memory
    assert agent.engine.memory_short() and cache.restored_total == 0
    agent.abort("wait")
    agent.step()
    agent.step()  # nothing waits: prefetched
    assert not agent.engine.memory_short() and cache.restored_total == 1
    run(agent)
    agent.check_integrity()


def test_resume_restores_an_offloaded_session_making_room(make_agent: MakeAgent) -> None:
    """No prefetch (unknown tool duration): the resume itself copies the session back,
    evicting plain cache entries for it, and reuses all of its context."""
    agent = make_agent(AgentConfig(speculation=()), num_pages=36, kv_offload_bytes=1 << 20)
    context = first_turn(agent)
    agent.await_tools("s", [ToolCall("c1", "f")])
    agent.add_request("big", list(range(200, 450)), greedy(4))
    run(agent)
    cache = agent.engine.kv._index
    assert cache.offloaded_total == 1 and cache.num_entries == 1  # the big request's entry
    out = resume_and_run(agent, RESULT)
    assert cache.restored_total == 1 and out.num_cached_tokens == len(context) - 1
    agent.check_integrity()


def test_prefetch_off_leaves_the_copy_for_the_resume(make_agent: MakeAgent) -> None:
    """``AgentConfig.prefetch=False`` (an offloading cache without predictions): a session past
    the prefetch point stays on the host until its resume copies it back."""
    clock = FakeClock()
    agent = make_agent(AgentConfig(speculation=(), prefetch=False), clock=clock,
                       num_pages=36, kv_offload_bytes=1 << 20)
    context = first_turn(agent)
    agent.await_tools("s", [ToolCall("c1", "f")], expected_duration_s=5.0)
    agent.add_request("big", list(range(200, 450)), greedy(4))
    run(agent)
    cache = agent.engine.kv._index
    while cache.evict_one(max_rank=EntryRank.PLAIN):
        pass
    clock.advance(4.8)
    agent.step()  # inside the lead: prefetch would copy it back now
    assert cache.offloaded_total == 1 and cache.restored_total == 0
    out = resume_and_run(agent, RESULT)
    assert cache.restored_total == 1 and out.num_cached_tokens == len(context) - 1
    counters = cache.offload.counters if cache.offload is not None else None
    assert counters is not None and counters.loads == counters.saves == 1
    assert counters.loaded_bytes == counters.saved_bytes > 0 and counters.load_s > 0


@pytest.mark.parametrize("awaiting, remaining, rank", [
    (True, 2.0, EntryRank.RETAINED), (True, 0.0, EntryRank.PLAIN),
    (True, None, EntryRank.PLAIN), (False, 2.0, EntryRank.PLAIN)])
def test_ttl_keeps_a_session_for_its_tools_expected_time(awaiting: bool,
                                                         remaining: float | None,
                                                         rank: EntryRank) -> None:
    policy = RETENTION_POLICIES.create("ttl")
    assert policy.retention(PausedSession(100, awaiting, remaining)) == (rank, 0.0)


@pytest.mark.parametrize("window_s", [5.0, 0.0])
def test_a_finished_turn_is_held_until_its_end_is_reported(make_agent: MakeAgent,
                                                           window_s: float) -> None:
    """A server reports a turn's tool calls only after parsing the reply, steps later. Until
    then the session's KV is held like a paused session's (`AgentConfig.report_window_s`):
    pressure offloads it instead of dropping it, and the resume reuses all of it. Without the
    hold it is a plain entry, the first to go, and the resume recomputes everything."""
    agent = make_agent(AgentConfig(speculation=(), retention="keep",
                                   report_window_s=window_s),
                       num_pages=36, kv_offload_bytes=1 << 20)
    context = first_turn(agent)  # 9 pages; its end not reported yet
    agent.add_request("big", list(range(200, 450)), greedy(4))  # 32 pages: the session goes
    run(agent)
    cache = agent.engine.kv._index
    assert cache.offloaded_total == (1 if window_s else 0)
    agent.await_tools("s", [ToolCall("c1", "f")])  # reported now
    out = resume_and_run(agent, RESULT)
    assert out.num_cached_tokens == (len(context) - 1 if window_s else 0)
    assert out.outputs[0].token_ids == reference_tokens(
        make_agent, agent.session_context("s")[:-len(out.outputs[0].token_ids)])


def test_end_turn_and_the_window_release_the_hold(make_agent: MakeAgent) -> None:
    """`end_turn` (no tool calls) makes the held KV a plain entry at once; an end never
    reported is released once the window has passed. Plain entries go before held ones."""
    clock = FakeClock()
    agent = make_agent(AgentConfig(speculation=(), retention="keep", report_window_s=2.0),
                       clock=clock, num_pages=48)
    cache = agent.engine.kv._index

    def rank(session_id: str) -> EntryRank:
        (slot,) = cache.tagged(SessionTag.session(session_id))
        plain = slot in cache.entry_slots(max_rank=EntryRank.PLAIN)
        return EntryRank.PLAIN if plain else EntryRank.RETAINED

    first_turn(agent, "a")
    first_turn(agent, "b", prompt=list(range(300, 360)))
    first_turn(agent, "c", prompt=list(range(400, 460)))
    assert rank("a") == rank("b") == rank("c") == EntryRank.RETAINED
    agent.end_turn("b")
    assert rank("b") == EntryRank.PLAIN
    agent.end_turn("b")  # reported already: nothing changes
    clock.advance(2.5)
    agent.step()  # past the window: "a" and "c" released too
    assert rank("a") == rank("c") == EntryRank.PLAIN
    agent.await_tools("a", [ToolCall("c1", "f")])
    assert rank("a") == EntryRank.RETAINED
    with pytest.raises(SessionStateError):
        agent.end_turn("a")  # awaiting its tools, not finished
    agent.check_integrity()
