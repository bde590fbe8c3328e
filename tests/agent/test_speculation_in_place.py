"""Speculation in place: a paused session's speculation that continues its own KV is prefilled
in the session's own slot (no page of its prefix mapped again), adopted at resume as it is on a
hit and truncated back to the match on a miss."""

from __future__ import annotations

import dataclasses

import pytest
from agent_helpers import MakeAgent, drain, greedy, run

from edmm.agent import AgentConfig, AgentEngine, SessionTag, TokenLayout, ToolCall, ToolResult
from edmm.agent.gate import BranchPlan, SpeculationGate
from edmm.agent.learning import Outcomes

PROMPT = list(range(100, 160))  # 60 tokens; +6 generated = a 66-token context
SUFFIX = (2, 10, 11, 12)
RESULT = list(range(600, 620))


def _arena(agent: AgentEngine):  # type: ignore[no-untyped-def]
    return agent.engine.kv._arena


def _first_turn(agent: AgentEngine, prompt: list[int] = PROMPT) -> list[int]:
    agent.add_request("t0", prompt, greedy(), session_id="s")
    run(agent)
    return agent.session_context("s")


def _reference(make_agent: MakeAgent, prompt: list[int]) -> list[int]:
    ref = make_agent(enable_prefix_caching=True).engine
    ref.add_request("ref", prompt, greedy())
    return run(ref)["ref"].outputs[0].token_ids


def test_a_hit_maps_no_page_of_the_prefix_and_prefills_no_speculated_token(
        make_agent: MakeAgent) -> None:
    agent = make_agent(AgentConfig(speculation=("predicted",)))
    context = _first_turn(agent)
    (slot,) = agent.engine.kv.tagged(SessionTag.session("s"))
    own = len(context) - 1  # the last token has no KV
    arena, kv = _arena(agent), agent.engine.kv
    maps = arena.driver.map_pages
    agent.await_tools("s", [ToolCall("c1", "f")], layout=TokenLayout(suffix=SUFFIX),
                      predictions={"c1": RESULT})
    drain(agent)
    prompt = [*context, *RESULT, *SUFFIX]
    # Only the new tokens' pages were mapped (the branch path maps the prefix's full pages).
    assert arena.driver.map_pages - maps == kv.pages_for(len(prompt)) - kv.pages_for(own)
    assert kv.tagged(SessionTag.session("s")) == [slot]
    maps = arena.driver.map_pages
    agent.resume("s", "t1", [ToolResult("c1", RESULT)], greedy())
    out = run(agent)["t1"]
    hit = out.prefix_hit
    assert hit is not None and hit.slot == slot and not hit.committed
    assert out.num_cached_tokens == len(prompt) - 1  # only the last token prefilled
    m = agent.session_metrics("s")
    assert (m.spec_hits, m.spec_partial, m.spec_misses, m.spec_in_place) == (1, 0, 0, 1)
    # the in-place hit counts for its source and tool, as a branch's would (the gate's P(used))
    assert agent._usage_stats.own("s", "predicted", "f") == Outcomes(hits=1)
    assert m.tokens_recomputed == 1
    assert m.tokens_speculated == len(prompt) - own
    # Past the prompt only the output's pages: no page of the prefix mapped at resume.
    assert arena.driver.map_pages - maps <= kv.pages_for(len(prompt) + 6) - kv.pages_for(
        len(prompt) - 1)
    assert out.outputs[0].token_ids == _reference(make_agent, prompt)


def test_the_branch_path_maps_the_prefix(make_agent: MakeAgent) -> None:
    """The same speculation with in place off: a branch maps every full page of the prefix
    (what the in-place test above does not)."""
    agent = make_agent(AgentConfig(speculation=("predicted",), speculate_in_place=False))
    context = _first_turn(agent)
    arena, kv = _arena(agent), agent.engine.kv
    maps = arena.driver.map_pages
    agent.await_tools("s", [ToolCall("c1", "f")], layout=TokenLayout(suffix=SUFFIX),
                      predictions={"c1": RESULT})
    drain(agent)
    own = len(context) - 1
    assert arena.driver.map_pages - maps >= kv.layout().full_pages(own) + 1


def test_a_miss_truncates_to_the_common_prefix_and_prefills_the_rest(
        make_agent: MakeAgent) -> None:
    agent = make_agent(AgentConfig(speculation=("predicted",)))
    context = _first_turn(agent)
    (slot,) = agent.engine.kv.tagged(SessionTag.session("s"))
    own = len(context) - 1
    before = _arena(agent).token_bytes_view(slot, 0, own).clone()
    wrong = [*RESULT[:5], *range(700, 715)]
    agent.await_tools("s", [ToolCall("c1", "f")], layout=TokenLayout(suffix=SUFFIX),
                      predictions={"c1": wrong})
    drain(agent)
    assert _arena(agent).num_tokens(slot) == len(context) + len(wrong) + len(SUFFIX)
    agent.resume("s", "t1", [ToolResult("c1", RESULT)], greedy())
    out = run(agent)["t1"]
    prompt = [*context, *RESULT, *SUFFIX]
    common = len(context) + 5
    assert out.prefix_hit is not None and out.prefix_hit.slot == slot
    assert out.num_cached_tokens == common
    m = agent.session_metrics("s")
    assert m.tokens_recomputed == len(prompt) - common
    assert (m.spec_hits, m.spec_partial, m.spec_misses) == (0, 1, 0)
    assert bool((_arena(agent).token_bytes_view(slot, 0, own) == before).all())
    assert out.outputs[0].token_ids == _reference(make_agent, prompt)


def test_a_miss_before_the_speculated_tokens_keeps_the_sessions_kv(
        make_agent: MakeAgent) -> None:
    """A result inserted mid-context at resume: the slot is cut back into the session's own
    KV (the speculated tail entirely), outputs as without speculation."""
    agent = make_agent(AgentConfig(speculation=("predicted",)))
    _first_turn(agent)
    agent.await_tools("s", [ToolCall("c1", "f")], layout=TokenLayout(suffix=SUFFIX),
                      predictions={"c1": RESULT})
    drain(agent)
    agent.resume("s", "t1", [ToolResult("c1", RESULT, position=30)], greedy())
    out = run(agent)["t1"]
    assert out.num_cached_tokens == 30
    m = agent.session_metrics("s")
    assert (m.spec_hits, m.spec_partial, m.spec_misses) == (0, 0, 1)
    assert out.outputs[0].token_ids == _reference(make_agent, out.prompt_token_ids)


def test_a_resume_during_the_prefill_stops_it_and_keeps_what_it_computed(
        make_agent: MakeAgent) -> None:
    """A resume that arrives while the speculation in place runs: it stops where it is, the
    slot comes back as the session's entry and the resume adopts it (one chunk of the
    speculation computed: the rest is prefilled)."""
    agent = make_agent(AgentConfig(speculation=("predicted",)), max_num_batched_tokens=16,
                       speculative_tokens_when_idle=8)
    context = _first_turn(agent)
    agent.await_tools("s", [ToolCall("c1", "f")], layout=TokenLayout(suffix=SUFFIX),
                      predictions={"c1": RESULT})
    agent.step()  # 8 of the 25 speculated tokens
    assert agent.has_speculation()
    agent.check_integrity()
    agent.resume("s", "t1", [ToolResult("c1", RESULT)], greedy())
    assert not agent.has_speculation()
    out = run(agent)["t1"]
    prompt = [*context, *RESULT, *SUFFIX]
    assert out.num_cached_tokens == len(context) - 1 + 8
    assert out.outputs[0].token_ids == _reference(make_agent, prompt)


def test_one_key_extends_the_slot_and_others_branch(make_agent: MakeAgent) -> None:
    """The template's speculation goes in place; a predicted result that continues all of it
    takes the slot over (nothing cut); a misplaced one (a fork before the end) branches."""
    agent = make_agent()
    context = _first_turn(agent)
    agent.await_tools("s", [ToolCall("c1", "f")], layout=TokenLayout(suffix=SUFFIX))
    m = agent.session_metrics("s")
    assert m.spec_in_place == 1  # template: the context and nothing else
    agent.predict_tool_result("s", "c1", RESULT)
    assert agent.session_metrics("s").spec_in_place == 2  # continues it: takes it over
    agent.predict_tool_result("s", "c1", RESULT[:3], position=40)  # a fork mid-context
    assert agent.session_metrics("s").spec_in_place == 2
    drain(agent)
    assert agent.engine.kv.tagged(SessionTag.branch("s", "predicted"))
    agent.check_integrity()
    agent.resume("s", "t1", [ToolResult("c1", RESULT)], greedy())
    out = run(agent)["t1"]
    prompt = [*context, *RESULT, *SUFFIX]
    assert out.num_cached_tokens == len(prompt) - 1
    assert out.outputs[0].token_ids == _reference(make_agent, prompt)


def test_memory_pressure_takes_the_speculated_tail_before_the_sessions_kv(
        make_agent: MakeAgent) -> None:
    agent = make_agent(AgentConfig(speculation=("predicted",)), num_pages=40)
    context = _first_turn(agent)
    (slot,) = agent.engine.kv.tagged(SessionTag.session("s"))
    big = list(range(300, 380))
    agent.await_tools("s", [ToolCall("c1", "f")], layout=TokenLayout(suffix=SUFFIX),
                      predictions={"c1": big})
    drain(agent)
    assert agent.engine.kv.tail_pages() > 0
    other = list(range(800, 1000))[:200]  # needs nearly the whole pool
    agent.add_request("o", other[:180], greedy(2))
    run(agent)
    agent.check_integrity()
    # The tail went; the session's own KV (a retained entry) stayed, cut back exactly.
    assert agent.engine.kv.tagged(SessionTag.session("s")) == [slot]
    assert agent.engine.kv.tail_pages() == 0 and _arena(agent).num_tokens(slot) == len(
        context) - 1
    agent.resume("s", "t1", [ToolResult("c1", RESULT)], greedy())
    out = run(agent)["t1"]
    prompt = [*context, *RESULT, *SUFFIX]
    assert out.outputs[0].token_ids == _reference(make_agent, prompt)


def test_closing_or_aborting_during_the_prefill_frees_everything(make_agent: MakeAgent) -> None:
    agent = make_agent(AgentConfig(speculation=("predicted",)), speculative_tokens_when_idle=4)
    _first_turn(agent)
    agent.await_tools("s", [ToolCall("c1", "f")], layout=TokenLayout(suffix=SUFFIX),
                      predictions={"c1": RESULT})
    agent.step()
    agent.close_session("s")
    agent.check_integrity()
    assert not agent.has_speculation() and agent.engine.stats().kv.cache_entries == 0


# ---------------------------------------------------------------------- the gate
class H200Gate(SpeculationGate):
    """The gate on the H200's numbers (not this CPU's timings), recording each plan."""

    def __init__(self) -> None:
        super().__init__()
        object.__setattr__(self, "plans", [])

    def pays(self, plan: BranchPlan) -> bool:
        self.plans.append(plan)  # type: ignore[attr-defined]
        return super().pays(dataclasses.replace(plan, token_s=None, page_s=None))


@pytest.mark.parametrize("in_place", [True, False])
def test_the_gate_pays_for_a_short_template_offer_on_a_long_context(
        make_agent: MakeAgent, in_place: bool) -> None:
    """A 20-token template offer (the tool call's end and the result's header) after a
    2K-token context: in place it maps a few pages and pays; as a branch it maps the
    context's ~250 full pages (16 KiB pages of the tiny model) and the gate refuses it."""
    gate = H200Gate()
    agent = make_agent(AgentConfig(speculation=("template",), speculation_gate=gate,
                                   speculate_in_place=in_place),
                       max_model_len=2304, num_pages=700, max_num_batched_tokens=2048)
    prompt = [5 + (i * 7) % 900 for i in range(2000)]
    context = _first_turn(agent, prompt)
    header = tuple(range(40, 59))  # + the context's last token: 20 new tokens
    agent.await_tools("s", [ToolCall("c1", "f")], layout=TokenLayout(before=header))
    (plan,) = gate.plans
    assert plan.new_tokens == 20
    m = agent.session_metrics("s")
    if in_place:
        assert plan.shared_pages == 0 and plan.new_pages <= 4
        assert m.spec_gated == 0 and m.spec_in_place == 1
    else:
        assert plan.shared_pages == agent.engine.kv.layout().full_pages(len(context) - 1)
        assert m.spec_gated == 1
    drain(agent)
    agent.resume("s", "t1", [ToolResult("c1", [7, 8])], greedy(2))
    out = run(agent)["t1"]
    assert out.num_cached_tokens == (len(context) + len(header) if in_place
                                     else len(context) - 1)
