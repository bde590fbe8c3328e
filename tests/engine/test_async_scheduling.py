"""Async scheduling (`EngineConfig.async_scheduling`) against the synchronous engine.

With async scheduling each step is launched before the previous one's tokens are processed:
a decoding sequence's pending token is fed from the device, a request that stops on a token
only its value reveals computes one extra token that is dropped, and outputs come one step
later. None of that may change what any request outputs: every workload here runs both ways
on the CPU (where the same code paths run, the device copy aside) and must give the same
tokens, finish reasons and a consistent engine after every step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from engine_helpers import NEW_TOKENS, HFCase, MakeEngine, greedy

from edmm.engine import Engine, RequestOutput, SamplingParams


def _run(engine: Engine, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]],
         abort_at: dict[int, str] | None = None) -> dict[str, RequestOutput]:
    """Step to the end, adding requests at the steps ``arrivals`` names and aborting those
    of ``abort_at``; check the engine after every step; the last output of each request."""
    final: dict[str, RequestOutput] = {}
    step = 0
    while engine.has_unfinished() or any(k >= step for k in arrivals):
        for rid, prompt, params in arrivals.get(step, []):
            engine.add_request(rid, prompt, params)
        if abort_at and step in abort_at:
            engine.abort(abort_at[step])
        for out in engine.step():
            final[out.request_id] = out
            assert PENDING not in out.outputs[0].token_ids
        engine.check_integrity()
        step += 1
    return final


PENDING = -1


def _both(make_engine: MakeEngine, folder: Any, run: Callable[[Engine], dict[str, RequestOutput]],
          **config: Any) -> tuple[dict[str, RequestOutput], dict[str, RequestOutput]]:
    sync = run(make_engine(folder, async_scheduling=False, **config))
    fast = run(make_engine(folder, async_scheduling=True, **config))
    return sync, fast


def _same(sync: dict[str, RequestOutput], fast: dict[str, RequestOutput]) -> None:
    assert sync.keys() == fast.keys()
    for rid in sync:
        a, b = sync[rid].outputs[0], fast[rid].outputs[0]
        assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason), rid
        assert fast[rid].finished == sync[rid].finished


@pytest.mark.parametrize("budget", [4096, 7], ids=["batched", "chunked-prefill"])
def test_greedy_outputs_match_sync_and_hf(qwen2_case: HFCase, make_engine: MakeEngine,
                                          budget: int) -> None:
    arrivals = {0: [(str(i), p, greedy()) for i, p in enumerate(qwen2_case.prompts)]}
    sync, fast = _both(make_engine, qwen2_case.folder, lambda e: _run(e, arrivals),
                       max_num_batched_tokens=budget, max_num_seqs=4)
    _same(sync, fast)
    assert [fast[str(i)].outputs[0].token_ids for i in range(4)] == qwen2_case.reference


def test_staggered_arrivals_stops_and_lengths(qwen2_case: HFCase, make_engine: MakeEngine) -> None:
    """Requests arrive while others decode; they stop on a token id chosen from their own
    reference continuation (so the extra token async scheduling computes is dropped), at
    max_tokens of 1, 2 and 5 tokens, or at min_tokens before a stop id."""
    ref, prompts = qwen2_case.reference, qwen2_case.prompts
    stop3 = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop_token_ids=[ref[1][3]])
    min_stop = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                              stop_token_ids=[ref[2][0]], min_tokens=6)
    arrivals = {
        0: [("a", prompts[0], greedy()), ("one", prompts[3], greedy(max_tokens=1))],
        2: [("stop", prompts[1], stop3), ("two", prompts[2], greedy(max_tokens=2))],
        5: [("min", prompts[2], min_stop), ("five", prompts[0][:9], greedy(max_tokens=5))],
        9: [("late", prompts[3] + ref[3][:4], greedy())],
    }
    sync, fast = _both(make_engine, qwen2_case.folder, lambda e: _run(e, arrivals),
                       max_num_seqs=4)
    _same(sync, fast)
    stopped = fast["stop"].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == ref[1][3]
    assert stopped.token_ids == ref[1][:stopped.token_ids.index(ref[1][3]) + 1]
    assert [len(fast[r].outputs[0].token_ids) for r in ("one", "two", "five")] == [1, 2, 5]
    assert fast["late"].outputs[0].token_ids == qwen2_case.greedy(prompts[3] + ref[3][:4])


def test_outputs_stream_one_token_at_a_time(qwen2_case: HFCase, make_engine: MakeEngine) -> None:
    """Each output adds exactly one resolved token (never a pending one), in order, one step
    after the step that sampled it; decode steps take their input from the device."""
    engine = make_engine(qwen2_case.folder, async_scheduling=True)
    launches: list[list[bool]] = []
    launch = engine._runner.launch

    def spy(batch: Any, previous: Any = None) -> Any:
        launches.append([s.pending_input for s in batch.seqs])
        return launch(batch, previous)

    engine._runner.launch = spy  # type: ignore[method-assign]
    engine.add_request("a", qwen2_case.prompts[1], greedy(max_tokens=8))
    seen: list[list[int]] = []
    while engine.has_unfinished():
        seen += [o.outputs[0].token_ids for o in engine.step()]
    assert seen == [qwen2_case.reference[1][:n] for n in range(1, 9)]
    # the prefill, then 7 decodes of a pending token (the 8th token is the last: not computed)
    assert launches == [[False]] + [[True]] * 7


def test_preemption_under_memory_pressure(qwen2_case: HFCase, make_engine: MakeEngine) -> None:
    """A pool too small for every sequence preempts and recomputes; a step in flight never
    sees its slot reused before it is done (the same outputs as with nothing in flight)."""
    arrivals = {0: [(str(i), p, greedy()) for i, p in enumerate(qwen2_case.prompts)]}
    engines = [make_engine(qwen2_case.folder, async_scheduling=mode, num_pages=24,
                           max_model_len=128, max_num_seqs=4) for mode in (False, True)]
    sync, fast = (_run(e, arrivals) for e in engines)
    _same(sync, fast)
    assert [fast[str(i)].outputs[0].token_ids for i in range(4)] == qwen2_case.reference
    assert engines[1].stats().num_preemptions > 0


def test_abort_in_flight(qwen2_case: HFCase, make_engine: MakeEngine) -> None:
    arrivals = {0: [(str(i), p, greedy()) for i, p in enumerate(qwen2_case.prompts)]}
    sync, fast = _both(make_engine, qwen2_case.folder,
                       lambda e: _run(e, arrivals, abort_at={6: "1"}), max_num_seqs=4)
    assert fast["1"].outputs[0].token_ids == qwen2_case.reference[1][:len(
        fast["1"].outputs[0].token_ids)]
    del sync["1"], fast["1"]  # how far it got differs by the step its outputs lag
    _same(sync, fast)


def test_prefix_reuse_after_a_stop(qwen2_case: HFCase, make_engine: MakeEngine) -> None:
    """A follow-up on a finished request's prompt + output reuses its KV; with async
    scheduling the stop token's KV may be there too (computed by the step in flight)."""
    ref, prompts = qwen2_case.reference, qwen2_case.prompts
    stop = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop_token_ids=[ref[2][6]])

    def run(engine: Engine) -> dict[str, RequestOutput]:
        first = _run(engine, {0: [("a", prompts[2], stop)]})
        follow = prompts[2] + first["a"].outputs[0].token_ids + [5, 6, 7]
        return {**first, **_run(engine, {0: [("b", follow, greedy(max_tokens=6))]})}

    sync, fast = _both(make_engine, qwen2_case.folder, run)
    _same(sync, fast)
    assert fast["b"].num_cached_tokens >= sync["b"].num_cached_tokens > 0


def test_seeded_sampling_matches(qwen2_case: HFCase, make_engine: MakeEngine) -> None:
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=s, max_tokens=12) for s in (1, 2)]
    arrivals = {0: [(f"s{i}", qwen2_case.prompts[i], p) for i, p in enumerate(params)]}
    sync, fast = _both(make_engine, qwen2_case.folder, lambda e: _run(e, arrivals))
    _same(sync, fast)


def test_logits_processors_run_on_host_tokens(qwen2_case: HFCase,
                                              make_engine: MakeEngine) -> None:
    """A processor reads the output so far: it gets the previous step's token once the next
    forward is queued, and sees every token it would see without async scheduling."""
    ref = qwen2_case.reference
    seen: dict[bool, list[list[int]]] = {False: [], True: []}

    def processor(mode: bool) -> Any:
        def ban_reference(output: list[int], logits: torch.Tensor) -> torch.Tensor:
            seen[mode].append(list(output))
            if len(output) < len(ref[0]):
                logits[ref[0][len(output)]] = float("-inf")
            return logits
        return ban_reference

    def run(mode: bool) -> Callable[[Engine], dict[str, RequestOutput]]:
        banned = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                logits_processors=[processor(mode)])
        return lambda e: _run(e, {0: [("p", qwen2_case.prompts[0], banned),
                                      ("q", qwen2_case.prompts[1], greedy(max_tokens=10))]})

    sync = run(False)(make_engine(qwen2_case.folder, async_scheduling=False))
    fast = run(True)(make_engine(qwen2_case.folder, async_scheduling=True))
    _same(sync, fast)
    assert seen[True] == seen[False] and len(seen[True]) == 6
    assert fast["p"].outputs[0].token_ids[0] != ref[0][0]


def test_async_scheduling_is_refused_with_tensor_parallel() -> None:
    from edmm.engine import EngineConfig
    from edmm.engine.errors import EngineConfigError

    with pytest.raises(EngineConfigError, match="async_scheduling"):
        EngineConfig(async_scheduling=True, tensor_parallel_size=2)
    assert not EngineConfig(tensor_parallel_size=2).uses_async_scheduling
    assert not EngineConfig().uses_async_scheduling  # the CPU: no CUDA graphs


def test_step_timing_accounts_for_the_step(qwen2_case: HFCase, make_engine: MakeEngine) -> None:
    """`Engine.last_step_timing` splits a step's host time into its phases (they add up to
    no more than the call's wall time); a flush of the step in flight has no launch."""
    import time

    engine = make_engine(qwen2_case.folder, async_scheduling=True)
    engine.add_request("a", qwen2_case.prompts[2], greedy(max_tokens=3))
    phases = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t
        timing = engine.last_step_timing
        assert timing is not None
        total = timing.schedule_s + timing.launch_s + timing.wait_s + timing.process_s
        assert min(timing.schedule_s, timing.launch_s, timing.wait_s, timing.process_s) >= 0
        assert total <= wall
        phases.append(timing.launch_s > 0)
    assert phases == [True, True, True, False]  # 3 tokens: prefill, 2 decodes, the last flush


def test_a_request_with_a_logits_processor_is_pipelined(qwen2_case: HFCase,
                                                        make_engine: MakeEngine) -> None:
    """A logits processor does not make steps wait (its masks are computed once the next
    forward is queued): three tokens take the same calls as without one, the last a flush
    with no launch (waiting for the tokens first would flush after every step)."""
    engine = make_engine(qwen2_case.folder, async_scheduling=True)
    engine.add_request("a", qwen2_case.prompts[2], SamplingParams(
        temperature=0.0, max_tokens=3, ignore_eos=True,
        logits_processors=[lambda output, logits: logits]))
    phases = []
    while engine.has_unfinished():
        engine.step()
        assert engine.last_step_timing is not None
        phases.append(engine.last_step_timing.launch_s > 0)
    assert phases == [True, True, True, False]


def test_abort_of_the_last_request_leaves_nothing_unfinished(qwen2_case: HFCase,
                                                             make_engine: MakeEngine) -> None:
    """The step in flight computed only for the aborted request: the engine has nothing left
    to give, and the next step finishes the launch without an output."""
    engine = make_engine(qwen2_case.folder, async_scheduling=True)
    engine.add_request("a", qwen2_case.prompts[1], greedy(max_tokens=20))
    engine.step()
    engine.step()
    assert engine.has_unfinished()
    engine.abort("a")
    assert not engine.has_unfinished()
    assert engine.step() == []
    engine.check_integrity()


def test_penalties_biases_and_logprobs_match_sync(qwen2_case: HFCase,
                                                  make_engine: MakeEngine) -> None:
    """Penalized requests count their output on the device: async scheduling samples what the
    synchronous engine samples, with the same log probabilities, beside unpenalized ones."""
    penalized = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, presence_penalty=1.0,
                               frequency_penalty=0.5, logprobs=3)
    biased = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                            logit_bias={qwen2_case.reference[0][0]: -100.0})
    prompts = qwen2_case.prompts
    arrivals = {0: [("pen", prompts[0], penalized), ("plain", prompts[1], greedy())],
                3: [("bias", prompts[0], biased)]}
    sync, fast = _both(make_engine, qwen2_case.folder, lambda e: _run(e, arrivals),
                       max_num_seqs=4)
    _same(sync, fast)
    assert fast["plain"].outputs[0].token_ids == qwen2_case.reference[1]
    assert fast["pen"].outputs[0].token_ids != qwen2_case.reference[0]
    assert fast["bias"].outputs[0].token_ids[0] != qwen2_case.reference[0][0]
    a, b = sync["pen"].outputs[0].logprobs, fast["pen"].outputs[0].logprobs
    assert a is not None and b is not None and len(b) == NEW_TOKENS
    assert [e.token_id for e in b] == [e.token_id for e in a]
    assert [e.logprob for e in b] == pytest.approx([e.logprob for e in a], abs=1e-5)
