"""Greedy tokens of the engine == HF transformers ``generate(do_sample=False)`` (float32, CPU),
for checkpoints loaded by the real loader, batched, chunked and with staggered arrivals."""

from __future__ import annotations

import pytest
from engine_helpers import NEW_TOKENS, HFCase, MakeEngine, greedy, run_to_completion

from edmm.engine import Engine, ScheduledBatch
from edmm.engine.runner import Launch


def record_batches(engine: Engine) -> list[ScheduledBatch]:
    """Spy on the batches the runner launches."""
    batches: list[ScheduledBatch] = []
    launch = engine._runner.launch

    def spy(batch: ScheduledBatch, previous: Launch | None = None) -> Launch:
        batches.append(batch)
        return launch(batch, previous)

    engine._runner.launch = spy  # type: ignore[method-assign]
    return batches


@pytest.mark.parametrize("budget", [4096, 7], ids=["batched", "chunked-prefill"])
def test_greedy_matches_hf(hf_case: HFCase, make_engine: MakeEngine, budget: int) -> None:
    engine = make_engine(hf_case.folder, max_num_batched_tokens=budget, max_num_seqs=4)
    batches = record_batches(engine)
    for i, prompt in enumerate(hf_case.prompts):
        engine.add_request(str(i), prompt, greedy())

    final = run_to_completion(engine)

    outs = [final[str(i)].outputs[0] for i in range(len(hf_case.prompts))]
    assert [o.token_ids for o in outs] == hf_case.reference
    assert all(o.finish_reason == "length" and len(o.token_ids) == NEW_TOKENS for o in outs)
    assert max(b.num_tokens for b in batches) <= budget
    assert len(batches[0].seqs) == len(hf_case.prompts) or budget < sum(map(len, hf_case.prompts))
    if budget == 7:  # prompts were split, and chunks rode along with decodes
        assert any(not s.sample and len(s.token_ids) > 1 for b in batches for s in b.seqs)
        assert any({len(s.token_ids) == 1 for s in b.seqs} == {True, False} for b in batches)


def test_staggered_arrivals_match_hf(hf_case: HFCase, make_engine: MakeEngine) -> None:
    engine = make_engine(hf_case.folder, max_num_batched_tokens=24, max_num_seqs=3)
    pending = list(enumerate(hf_case.prompts))
    final = {}
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % 5 == 0:
            i, prompt = pending.pop(0)
            engine.add_request(str(i), prompt, greedy())
        final.update({o.request_id: o for o in engine.step() if o.finished})
        step += 1
    assert [final[str(i)].outputs[0].token_ids for i in range(4)] == hf_case.reference
