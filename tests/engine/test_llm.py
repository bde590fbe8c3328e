"""The offline API: ``from edmm import LLM, SamplingParams`` on the embedded tiny model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from edmm import LLM, SamplingParams
from edmm.engine import InvalidRequestError

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The weather in Paris is", "An agent calls a tool and", "Memory is managed in pages."]


@pytest.fixture(scope="module")
def llm(tiny_dir: Path) -> Iterator[LLM]:
    with LLM(str(tiny_dir), max_model_len=256, num_slots=8, max_num_seqs=4,
             max_num_batched_tokens=64) as model:
        yield model
        model.reset_prefix_cache()
        model.llm_engine.check_integrity()
        kv = model.llm_engine.stats().kv
        assert kv.pages_free == kv.pages_total


def test_generate_text_ids_and_dicts_in_order(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPTS[1])
    outs = llm.generate([PROMPTS[0], {"prompt_token_ids": ids}, {"prompt": PROMPTS[2]}], GREEDY)
    assert [o.prompt for o in outs] == [PROMPTS[0], None, PROMPTS[2]]
    assert outs[1].prompt_token_ids == ids
    singles = [llm.generate(p, GREEDY)[0] for p in PROMPTS]
    for out, single in zip(outs, singles, strict=True):
        c = out.outputs[0]
        assert c.token_ids == single.outputs[0].token_ids and len(c.token_ids) == 12
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
        assert c.finish_reason == "length" and out.finished


def test_repeated_prompt_reuses_the_prefix(llm: LLM) -> None:
    prompt = " ".join(PROMPTS * 3)
    cold = llm.generate(prompt, GREEDY)[0]
    warm = llm.generate(prompt, GREEDY)[0]
    n = len(cold.prompt_token_ids)
    assert warm.num_cached_tokens == n - 1 > 0  # all but the last prompt token
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    llm.reset_prefix_cache()
    assert llm.generate(prompt, GREEDY)[0].num_cached_tokens == 0


def test_chat_applies_the_template(llm: LLM) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    out = llm.chat(messages, GREEDY, tools=tools)[0]
    assert out.prompt is not None and "get_weather" in out.prompt
    assert out.prompt.endswith("<|im_start|>assistant\n")
    again = llm.generate({"prompt_token_ids": out.prompt_token_ids}, GREEDY)[0]
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
    two = llm.chat([messages, [*messages, {"role": "assistant", "content": "Sunny."}]], GREEDY)
    assert len(two) == 2


def test_seeded_sampling_is_reproducible_across_batches(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16)
    alone = llm.generate(PROMPTS[0], seeded)[0].outputs[0].token_ids
    batch = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]],
                         [SamplingParams(temperature=1.0, max_tokens=8), seeded, GREEDY])
    assert batch[1].outputs[0].token_ids == alone
    other = SamplingParams(temperature=1.0, top_p=0.9, seed=4321, max_tokens=16)
    assert llm.generate(PROMPTS[0], other)[0].outputs[0].token_ids != alone


def test_stop_string_cuts_the_text(llm: LLM) -> None:
    full = llm.generate(PROMPTS[0], GREEDY)[0].outputs[0]
    stop = full.text[len(full.text) // 2:][:3]
    assert stop.strip(), "need a visible stop string"
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12,
                                                  ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[:full.text.index(stop)]
    assert full.token_ids[:len(out.token_ids)] == out.token_ids


@pytest.mark.parametrize("bad", [
    pytest.param("", id="empty-text"),
    pytest.param({"prompt_token_ids": []}, id="empty-ids"),
    pytest.param({"prompt_token_ids": [5, 10**6]}, id="out-of-vocab"),
    pytest.param("word " * 300, id="too-long"),
    pytest.param({"text": "x"}, id="bad-dict"),
])
def test_bad_input_raises_before_anything_runs(llm: LLM, bad: object) -> None:
    with pytest.raises(InvalidRequestError):
        llm.generate([PROMPTS[0], bad], GREEDY)  # type: ignore[list-item]
    assert not llm.llm_engine.has_unfinished()
    assert llm.generate(PROMPTS[0], GREEDY)[0].outputs[0].finish_reason == "length"


def test_params_count_must_match(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError):
        llm.generate(PROMPTS, [GREEDY, GREEDY])
