"""Request validation, abort and stop conditions of the engine (tiny random Qwen2)."""

from __future__ import annotations

from array import array
from typing import Any

import pytest
from engine_helpers import VOCAB, HFCase, MakeEngine, greedy, run_to_completion

from edmm.engine import (
    ContextLengthError,
    Engine,
    EngineConfig,
    EngineConfigError,
    InvalidRequestError,
    SamplingParams,
)
from edmm.model.prompt_encoder import TokenIds


def serves_next_request(engine: Engine, case: HFCase) -> bool:
    engine.add_request("next", case.prompts[1], greedy())
    return run_to_completion(engine)["next"].outputs[0].token_ids == case.reference[1]


@pytest.mark.parametrize("prompt", [
    pytest.param([], id="empty"),
    pytest.param([1] * 257, id="longer-than-max-model-len"),
    pytest.param([1, VOCAB], id="id-past-vocab"),
    pytest.param([-1, 2], id="negative-id"),
    pytest.param([1, 2.0], id="float-id"),
    pytest.param([True, 2], id="bool-id"),
    pytest.param("text without a tokenizer", id="text-no-tokenizer"),
    pytest.param(42, id="not-a-prompt"),
])
def test_bad_prompt_is_rejected_before_scheduling(
        qwen2_case: HFCase, make_engine: MakeEngine, prompt: Any) -> None:
    engine = make_engine(qwen2_case.folder)
    with pytest.raises(InvalidRequestError):
        engine.add_request("bad", prompt, greedy())
    assert not engine.has_unfinished()
    assert serves_next_request(engine, qwen2_case)


def test_bad_params_and_duplicate_ids_are_rejected(
        qwen2_case: HFCase, make_engine: MakeEngine) -> None:
    engine = make_engine(qwen2_case.folder)
    with pytest.raises(InvalidRequestError):
        engine.add_request("x", [1, 2], {"temperature": 0})  # type: ignore[arg-type]
    engine.add_request("dup", [1, 2, 3], greedy(4))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("dup", [4, 5], greedy(4))
    assert run_to_completion(engine)["dup"].outputs[0].token_ids == qwen2_case.greedy([1, 2, 3], 4)
    assert serves_next_request(engine, qwen2_case)


def test_abort_releases_memory_and_others_continue(
        qwen2_case: HFCase, make_engine: MakeEngine) -> None:
    engine = make_engine(qwen2_case.folder, enable_prefix_caching=False)
    for i in (2, 3):
        engine.add_request(str(i), qwen2_case.prompts[i], greedy())
    engine.step()
    used = engine.stats().kv.pages_in_use
    assert engine.abort("3")
    assert not engine.abort("3") and not engine.abort("unknown")
    assert engine.stats().kv.pages_in_use < used
    final = run_to_completion(engine)
    assert set(final) == {"2"}
    assert final["2"].outputs[0].token_ids == qwen2_case.reference[2]
    assert engine.stats().kv.pages_free == engine.stats().kv.pages_total


def test_stop_token_ids_and_min_tokens(qwen2_case: HFCase, make_engine: MakeEngine) -> None:
    ref = qwen2_case.reference[2]
    stop = ref[5]
    first = ref.index(stop)
    engine = make_engine(qwen2_case.folder)
    engine.add_request("stop", qwen2_case.prompts[2], greedy(stop_token_ids=[stop]))
    engine.add_request("min", qwen2_case.prompts[2],
                       greedy(stop_token_ids=[stop], min_tokens=first + 2))
    final = run_to_completion(engine)
    assert final["stop"].outputs[0].token_ids == ref[:first + 1]
    assert final["stop"].outputs[0].finish_reason == "stop"
    later = [i for i, t in enumerate(ref) if t == stop and i + 1 >= first + 2]
    expected = ref[:later[0] + 1] if later else ref
    assert final["min"].outputs[0].token_ids == expected


def test_eos_from_generation_config_stops(qwen2_case: HFCase, make_engine: MakeEngine) -> None:
    engine = make_engine(qwen2_case.folder)
    eos = qwen2_case.reference[0][3]
    engine.eos_token_ids = frozenset({eos})
    engine.add_request("eos", qwen2_case.prompts[0], SamplingParams(temperature=0, max_tokens=32))
    out = run_to_completion(engine)["eos"].outputs[0]
    assert out.token_ids[-1] == eos and out.finish_reason == "stop"
    assert out.token_ids == qwen2_case.reference[0][:len(out.token_ids)]


def test_max_model_len_caps_generation(qwen2_case: HFCase, make_engine: MakeEngine) -> None:
    engine = make_engine(qwen2_case.folder, max_model_len=72)
    engine.add_request("long", qwen2_case.prompts[3], greedy())  # 65 tokens + 32 > 72
    out = run_to_completion(engine)["long"].outputs[0]
    assert out.finish_reason == "length"
    assert out.token_ids == qwen2_case.reference[3][:7]


def test_a_prompt_past_max_model_len_is_a_context_length_error(
        qwen2_case: HFCase, make_engine: MakeEngine) -> None:
    engine = make_engine(qwen2_case.folder, max_model_len=72)
    validator = engine.validator  # immutable: what the server uses off the engine thread
    with pytest.raises(ContextLengthError) as info:
        validator.make("long", [1] * 73, greedy())
    assert (info.value.prompt_len, info.value.max_model_len) == (73, 72)
    assert isinstance(info.value, InvalidRequestError)
    with pytest.raises(ContextLengthError):
        engine.add_request("long", [1] * 73, greedy())
    with pytest.raises(InvalidRequestError) as bad:
        validator.make("oov", [VOCAB], greedy())
    assert not isinstance(bad.value, ContextLengthError)
    request = validator.make("ok", [1] * 60, greedy())
    engine.submit(request)
    with pytest.raises(InvalidRequestError, match="already in use"):  # refused at submit
        engine.submit(validator.make("ok", [2, 3], greedy()))
    assert run_to_completion(engine)["ok"].prompt_token_ids == [1] * 60


def test_a_tokenizer_array_is_checked_in_one_pass(qwen2_case: HFCase,
                                                  make_engine: MakeEngine) -> None:
    """An ``array('q')`` of ids (`PromptEncoder.encode_array`) becomes the same list as its
    ids would; an id outside the vocabulary is the same error."""
    validator = make_engine(qwen2_case.folder, max_model_len=72).validator
    assert validator.make("a", array("q", [0, 5, VOCAB - 1]), greedy()).prompt_token_ids == [
        0, 5, VOCAB - 1]
    for bad in (VOCAB, -1):
        with pytest.raises(InvalidRequestError, match="not in the vocabulary"):
            validator.make("oov", array("q", [3, bad]), greedy())
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        validator.make("empty", array("q"), greedy())


def test_token_ids_are_checked_on_their_twin(qwen2_case: HFCase,
                                            make_engine: MakeEngine) -> None:
    """`TokenIds` (`PromptEncoder.encode_ids`): bounds checked on the packed twin, the list
    taken as it is (a plain list, the request's own); a twin of another length is ignored and
    the list checked as any list."""
    validator = make_engine(qwen2_case.folder, max_model_len=72).validator
    ids = TokenIds([0, 5, VOCAB - 1], array("q", [0, 5, VOCAB - 1]))
    got = validator.make("t", ids, greedy()).prompt_token_ids
    assert got == [0, 5, VOCAB - 1] and type(got) is list and got is not ids
    for bad in (VOCAB, -1):
        with pytest.raises(InvalidRequestError, match="not in the vocabulary"):
            validator.make("oov", TokenIds([3, bad], array("q", [3, bad])), greedy())
    with pytest.raises(InvalidRequestError, match="not in the vocabulary"):
        validator.make("short", TokenIds([3, VOCAB], array("q", [3])), greedy())


@pytest.mark.parametrize("fields", [
    pytest.param(dict(max_num_batched_tokens=4, max_num_seqs=8), id="budget-below-seqs"),
    pytest.param(dict(max_num_seqs=9, num_slots=8), id="seqs-above-slots"),
    pytest.param(dict(device="mps"), id="device"),
    pytest.param(dict(backend="cuda"), id="cuda-backend-on-cpu"),
    pytest.param(dict(num_pages=0), id="no-pages"),
])
def test_bad_config_is_a_typed_error(fields: dict[str, Any]) -> None:
    with pytest.raises(EngineConfigError):
        EngineConfig(**{"max_num_seqs": 8, "num_slots": 8, **fields})
