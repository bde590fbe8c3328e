"""The centrepiece: greedy outputs are identical with EDMM on and off.

Hypothesis generates agent scripts: several sessions, several turns, results appended or
inserted mid-prompt, predictions right / partly right / misplaced / wrong, whole next prompts
predicted right or with one token edited, streamed output, abandoned sessions, under roomy and
tight KV pools and small and large step budgets. EDMM on is an `AgentEngine` with every
speculation source, the sessions interleaved tick by tick (one session's tool window overlaps
another's decode); EDMM off is a plain engine without any KV reuse running each session's turns
one after the other. After every tick the agent's and the engine's invariants hold; after every
script every page is back in the pool.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from agent_helpers import FakeClock, greedy, run
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from kv_helpers import tiny_engine_config as engine_config
from tiers import examples

from edmm.agent import (
    AgentConfig,
    AgentEngine,
    SessionState,
    SessionTag,
    TokenLayout,
    ToolCall,
    ToolResult,
)
from edmm.agent.render import TokenRenderer
from edmm.engine import Engine

VOCAB = 1024
BEFORE, AFTER = (3,), (4,)  # e.g. <tool_response> ... </tool_response>
SUFFIX = (2, 1, 10)  # e.g. <|im_end|> <|im_start|> assistant


@dataclass(frozen=True)
class CallScript:
    result_len: int
    insert_at: float | None  # fraction of the context; None: appended
    prediction: str  # none | right | partial | misplaced | wrong


@dataclass(frozen=True)
class ToolStep:
    calls: tuple[CallScript, ...]
    suffix_len: int
    stream_chunks: int  # chunks of the first call's result streamed before it returns
    window_ticks: int  # engine steps while the tools run
    abandon: bool  # no result before the deadline: the session ends here
    max_tokens: int  # of the resume turn
    prompt_prediction: str = "none"  # none | right | edited: the whole next prompt predicted


@dataclass(frozen=True)
class SessionScript:
    prompt_len: int
    max_tokens: int
    steps: tuple[ToolStep, ...]


@dataclass(frozen=True)
class Script:
    sessions: tuple[SessionScript, ...]
    num_pages: int
    budget: int
    seed: int


calls_st = st.builds(CallScript, st.integers(1, 14), st.none() | st.floats(0.0, 1.0),
                     st.sampled_from(["none", "right", "partial", "misplaced", "wrong"]))
step_st = st.builds(ToolStep, st.lists(calls_st, min_size=1, max_size=2).map(tuple),
                    st.integers(0, 3), st.integers(0, 2), st.integers(0, 4),
                    st.sampled_from([False, False, False, True]),
                    st.integers(1, 4), st.sampled_from(["none", "none", "right", "edited"]))
session_st = st.builds(SessionScript, st.integers(2, 120), st.integers(1, 4),
                       st.lists(step_st, max_size=3).map(tuple))
script_st = st.builds(Script, st.lists(session_st, min_size=1, max_size=3).map(tuple),
                      st.sampled_from([34, 400]), st.sampled_from([16, 64, 512]),
                      st.integers(0, 2**16))


# ---------------------------------------------------------------------- the script's data
@dataclass
class Plan:
    """Concrete tokens of one session's script (drawn from the script's seed)."""

    prompt: list[int]
    results: list[list[list[int]]]  # [step][call] -> result tokens
    predictions: list[list[list[int] | None]]
    misplaced: list[list[float | None]]  # where a misplaced prediction goes (fraction)
    prompt_edits: list[float]  # where an edited prompt prediction differs (fraction)


def plan(s: SessionScript, rng: random.Random) -> Plan:
    def toks(n: int) -> list[int]:
        return [rng.randrange(5, VOCAB) for _ in range(n)]

    p = Plan(toks(s.prompt_len), [], [], [], [])
    for step in s.steps:
        results = [toks(c.result_len) for c in step.calls]
        p.results.append(results)
        p.predictions.append([_predict(c, r, toks) for c, r in zip(step.calls, results,
                                                                    strict=True)])
        p.misplaced.append([(1.0 if c.insert_at is not None else 0.5)
                            if c.prediction == "misplaced" else None for c in step.calls])
        p.prompt_edits.append(rng.random())
    return p


def _predict(c: CallScript, result: list[int], toks: Callable[[int], list[int]],
             ) -> list[int] | None:
    if c.prediction == "none":
        return None
    if c.prediction == "partial":
        return result[: len(result) // 2] + toks(3)
    if c.prediction == "wrong":
        return toks(len(result))
    return list(result)  # right, or right content at the wrong place


def layout(context: list[int], step: ToolStep) -> TokenLayout:
    positions = {f"c{i}": int(c.insert_at * len(context))
                 for i, c in enumerate(step.calls) if c.insert_at is not None}
    return TokenLayout(BEFORE, AFTER, SUFFIX[: step.suffix_len], positions)


def tool_calls(step: ToolStep) -> list[ToolCall]:
    return [ToolCall(f"c{i}", f"tool{i}", "{}") for i in range(len(step.calls))]


def next_prompt(context: list[int], step: ToolStep, results: list[list[int]]) -> list[int]:
    renderer = TokenRenderer(tuple(context), tuple(tool_calls(step)), layout(context, step))
    return renderer.render({f"c{i}": r for i, r in enumerate(results)})


# ---------------------------------------------------------------------- EDMM off
def reference(engine: Engine, script: Script, plans: list[Plan], tag: str) -> list[list[list[int]]]:
    """Each session's turns, one after the other, on an engine that reuses no KV."""
    outputs = []
    for k, (s, p) in enumerate(zip(script.sessions, plans, strict=True)):
        prompt, turns = p.prompt, []
        max_tokens = [s.max_tokens, *(step.max_tokens for step in s.steps)]
        for i in itertools.count():
            engine.add_request(f"{tag}-{k}-{i}", prompt, greedy(max_tokens[i]))
            out = run(engine)[f"{tag}-{k}-{i}"].outputs[0].token_ids
            turns.append(out)
            if i == len(s.steps) or s.steps[i].abandon:
                break
            prompt = next_prompt(prompt + out, s.steps[i], p.results[i])
        outputs.append(turns)
    return outputs


# ---------------------------------------------------------------------- EDMM on
@dataclass
class Driver:
    """Runs one session's script on the agent, one action per tick when its state allows."""

    sid: str
    script: SessionScript
    plan: Plan
    turns: list[list[int]] = field(default_factory=list)
    step_index: int = 0
    actions: list[str] = field(default_factory=list)
    done: bool = False
    last_prompt_len: int = 0

    def start(self, agent: AgentEngine) -> None:
        agent.add_request(f"{self.sid}-0", self.plan.prompt, greedy(self.script.max_tokens),
                          session_id=self.sid)

    def tick(self, agent: AgentEngine) -> None:
        state = agent.session_state(self.sid)
        if self.done or state in (SessionState.GENERATING, SessionState.RESUMING):
            return
        if state == SessionState.ABANDONED:
            self.done = True
            return
        if state == SessionState.FINISHED and not self.actions:
            self._turn_finished(agent)
            return
        action = self.actions.pop(0)
        step = self.script.steps[self.step_index]
        if action.startswith("feed"):
            chunk = _chunk(self.plan.results[self.step_index][0], step, int(action[4:]))
            agent.feed_tool_output(self.sid, "c0", chunk)
        elif action == "resume":
            self._resume(agent, step)

    def _turn_finished(self, agent: AgentEngine) -> None:
        context = agent.session_context(self.sid)
        prompt_len = len(self.plan.prompt) if not self.turns else self.last_prompt_len
        self.turns.append(context[prompt_len:])
        if len(self.turns) > 1:
            self.step_index += 1
        if self.step_index == len(self.script.steps):
            self.done = True
            return
        step = self.script.steps[self.step_index]
        i = self.step_index
        preds = {f"c{j}": p for j, (p, m) in
                 enumerate(zip(self.plan.predictions[i], self.plan.misplaced[i], strict=True))
                 if p is not None and m is None}
        deadline = step.window_ticks + step.stream_chunks + 0.5 if step.abandon else 1e9
        agent.await_tools(self.sid, tool_calls(step), layout=layout(context, step),
                          predictions=preds, deadline_s=deadline)
        for j, (p, m) in enumerate(zip(self.plan.predictions[i], self.plan.misplaced[i],
                                       strict=True)):
            if p is not None and m is not None:
                agent.predict_tool_result(self.sid, f"c{j}", p, position=int(m * len(context)))
        if step.prompt_prediction != "none":
            prompt = next_prompt(context, step, self.plan.results[i])
            if step.prompt_prediction == "edited":
                k = int(self.plan.prompt_edits[i] * len(prompt))
                prompt[k] = (prompt[k] + 1) % VOCAB
            agent.predict_prompt(self.sid, prompt)
        self.actions = [f"feed{j}" for j in range(step.stream_chunks)]
        self.actions += ["wait"] * step.window_ticks + ([] if step.abandon else ["resume"])
        if step.abandon:
            self.actions += ["wait"] * 10**6  # until the deadline passes

    def _resume(self, agent: AgentEngine, step: ToolStep) -> None:
        i = self.step_index
        context = agent.session_context(self.sid)
        prompt = next_prompt(context, step, self.plan.results[i])
        self.last_prompt_len = len(prompt)
        results = [ToolResult(f"c{j}", r) for j, r in enumerate(self.plan.results[i])]
        client_sends_prompt = i % 2 == 1  # else the agent renders it from its layout
        agent.resume(self.sid, f"{self.sid}-{i + 1}", results, greedy(step.max_tokens),
                     prompt=prompt if client_sends_prompt else None)


def _chunk(result: list[int], step: ToolStep, j: int) -> list[int]:
    """The j-th of ``stream_chunks`` chunks covering the first ~2/3 of the result."""
    n = step.stream_chunks
    cut = [len(result) * 2 * k // (3 * n) for k in range(n + 1)]
    return result[cut[j]:cut[j + 1]]


def run_agent(agent: AgentEngine, clock: FakeClock, script: Script, plans: list[Plan],
              tag: str) -> list[list[list[int]]]:
    """Run the script's sessions interleaved, then close them one by one; after every tick
    and every close, every cache entry belongs to a session still open (`check_owners`)."""
    drivers = [Driver(f"{tag}-s{k}", s, p) for k, (s, p) in
               enumerate(zip(script.sessions, plans, strict=True))]
    for d in drivers:
        d.start(agent)
    for _ in range(5000):
        if all(d.done for d in drivers):
            break
        agent.step()
        clock.advance(1.0)
        agent.check_integrity()
        check_owners(agent)
        for d in drivers:
            d.tick(agent)
    else:
        raise AssertionError("script did not finish")
    for d in drivers:
        agent.close_session(d.sid)
        check_owners(agent)
    return [d.turns for d in drivers]


def check_owners(agent: AgentEngine) -> None:
    """Every prefix-cache entry of an agent-only engine is owned by an open session: it
    carries a tag, and the tag names the session (a `SessionTag`). An untagged entry is one
    no close would free."""
    open_sessions = set(agent.session_ids())
    kv = agent.engine.kv
    tagged = {slot: tag for tag in kv.tags() for slot in kv.tagged(tag)}
    untagged = set(kv.entry_slots()) - set(tagged)
    assert not untagged, f"entries {sorted(untagged)} are owned by no session"
    for slot, tag in tagged.items():
        assert isinstance(tag, SessionTag), f"entry {slot} ({tag!r}) is no session's"
        assert tag.session_id in open_sessions, f"entry {slot} ({tag}) outlived its session"


# ---------------------------------------------------------------------- the test
@pytest.fixture(scope="module", params=["cpu", "cpu-async",
                                        pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> str:
    """The host twin on the CPU (``cpu-async``: with async scheduling, the agent engine's
    steps launched before the previous step's tokens are processed); on CUDA, CUDA-graph
    decode and mixed batches (speculation riding along in decode steps), Triton attention,
    async scheduling (its default there)."""
    return str(request.param)


@pytest.fixture(scope="module")
def engines(tiny_dir: Path, device: str,
            ) -> Iterator[Callable[..., tuple[AgentEngine, FakeClock]]]:
    clock = FakeClock()
    built: dict[tuple[int, int, str, bool], AgentEngine] = {}

    def get(num_pages: int, budget: int, cache: str = "sessions",
            in_place: bool = True) -> tuple[AgentEngine, FakeClock]:
        key = (num_pages, budget, cache, in_place)
        if key in built and not _clean(built[key]):  # a failed example left state behind
            built.pop(key).close()
        if key not in built:
            config = engine_config(tiny_dir, num_pages=num_pages, max_num_batched_tokens=budget,
                                   max_num_seqs=8, speculative_tokens_when_busy=8,
                                   device=device.removesuffix("-async"),
                                   kv_offload_bytes=OFFLOAD_BYTES, kv_cache_policy=cache,
                                   async_scheduling=True if device.endswith("-async") else None)
            built[key] = AgentEngine(config, AgentConfig(speculate_in_place=in_place),
                                     clock=clock)
        return built[key], clock

    yield get
    for agent in built.values():
        agent.close()


def _clean(agent: AgentEngine) -> bool:
    return not (agent.session_ids() or agent.has_unfinished() or agent.has_speculation()
                or agent.engine.stats().kv.pages_in_use > agent.engine._runner.reserved_slots)


@pytest.fixture(scope="module")
def reference_engine(tiny_dir: Path, device: str) -> Iterator[Callable[[], Engine]]:
    engines: list[Engine] = []

    def get() -> Engine:
        if engines and engines[-1].has_unfinished():  # a failed example left requests
            engines.pop().close()
        if not engines:
            engines.append(Engine(engine_config(tiny_dir, enable_prefix_caching=False,
                                                device=device.removesuffix("-async"),
                                                async_scheduling=False)))
        return engines[-1]

    yield get
    for engine in engines:
        engine.close()


_ids = itertools.count()
# Host memory for evicted paused sessions: about two tiny-model sessions (2 KiB per token), so
# tight pools both offload (and restore at resume or by prefetch) and drop (over budget).
OFFLOAD_BYTES = 256 * 2048

_HEAVY_STEP = ToolStep((CallScript(12, 0.3, "right"), CallScript(6, None, "partial")), 3, 2, 2,
                       False, 3, "edited")
HEAVY = Script(  # three long sessions in a pool that holds barely one: eviction, preemption
    tuple(SessionScript(110 + k, 4, (_HEAVY_STEP, _HEAVY_STEP)) for k in range(3)), 34, 16, 7)


@settings(max_examples=examples(300), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(script=script_st)
@example(script=HEAVY)
def test_greedy_outputs_identical_with_edmm_on_and_off(
        engines: Callable[..., tuple[AgentEngine, FakeClock]],
        reference_engine: Callable[[], Engine], script: Script) -> None:
    rng = random.Random(script.seed)
    plans = [plan(s, rng) for s in script.sessions]
    _compare(*engines(script.num_pages, script.budget), reference_engine(), script, plans)


@settings(max_examples=examples(60), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(script=script_st)
@example(script=HEAVY)
def test_greedy_outputs_identical_with_speculation_in_place_on_and_off(
        engines: Callable[..., tuple[AgentEngine, FakeClock]],
        reference_engine: Callable[[], Engine], script: Script) -> None:
    """The same scripts with speculation in place (appended results extend the session's
    own slot, truncated back on a miss) and with every speculation on a branch: both give the
    plain engine's tokens."""
    rng = random.Random(script.seed)
    plans = [plan(s, rng) for s in script.sessions]
    for in_place in (True, False):
        _compare(*engines(script.num_pages, script.budget, in_place=in_place),
                 reference_engine(), script, plans)


SHARED = 20  # tokens of the system prompt every session of the baselines' test starts with


@settings(max_examples=examples(60), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(script=script_st, cache=st.sampled_from(["apc", "blocks"]))
@example(script=HEAVY, cache="blocks")
@example(script=HEAVY, cache="apc")
def test_greedy_outputs_identical_under_the_baselines_cache_policies(
        engines: Callable[..., tuple[AgentEngine, FakeClock]],
        reference_engine: Callable[[], Engine], script: Script, cache: str) -> None:
    """The same, with every session's prompt on one shared system prompt (their KV of it one
    physical copy) and the baselines' eviction and host tier: ``apc`` (tail-first,
    page-granular) and ``blocks`` (that, every block written through to the host once, and
    every admission loading the blocks the GPU lacks)."""
    rng = random.Random(script.seed)
    system = [rng.randrange(5, VOCAB) for _ in range(SHARED)]
    plans = [plan(s, rng) for s in script.sessions]
    for p in plans:
        p.prompt[:0] = system
    _compare(*engines(script.num_pages, script.budget, cache), reference_engine(), script,
             plans)


def _compare(agent: AgentEngine, clock: FakeClock, reference_engine: Engine, script: Script,
             plans: list[Plan]) -> None:
    """Run ``plans`` on the agent engine and on the plain one: the same greedy tokens; then
    every entry and page of the agent engine is back."""
    tag = f"x{next(_ids)}"
    on = run_agent(agent, clock, script, plans, tag)
    off = reference(reference_engine, script, plans, tag)
    assert on == off
    agent.check_integrity()
    assert not agent.has_speculation() and not agent.session_ids()
    arena = agent.engine.kv._arena
    reserved = agent.engine._runner.reserved_slots  # a CUDA-graph runner's pad slot: one page
    cached = arena.stats().slots_in_use - reserved
    assert cached == agent.engine.stats().kv.cache_entries + arena.stats().slots_retired
    assert agent.engine.stats().kv.cache_entries == 0  # each session's entries went with it
    agent.engine.reset_prefix_cache()  # frees the retired slots
    assert agent.engine.stats().kv.pages_in_use == reserved
    assert arena.stats().slots_in_use == reserved
    agent.check_integrity()


@settings(max_examples=examples(60), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(script=script_st)
@example(script=Script((SessionScript(6, 4, (ToolStep((CallScript(1, 0.5, "none"),), 0, 0, 0,
                                                      False, 1),)),), 34, 16, 0))
def test_closing_a_session_frees_every_entry_it_made(
        engines: Callable[..., tuple[AgentEngine, FakeClock]], script: Script) -> None:
    """The ownership half of the test above, without the reference run (so it covers more
    scripts in less time): entries a session's sequences left unadopted stay the session's,
    so closing it frees them. The example: a result inserted mid-prompt, so the resume
    branches from the session's KV instead of adopting it; its old entry was left untagged."""
    rng = random.Random(script.seed)
    agent, clock = engines(script.num_pages, script.budget)
    run_agent(agent, clock, script, [plan(s, rng) for s in script.sessions], f"o{next(_ids)}")
    assert agent.engine.stats().kv.cache_entries == 0
