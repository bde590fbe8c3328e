"""A grammar's forced start (llguidance's fast-forward tokens) computed with the prompt: the
output is the one decoding each token gives, in fewer engine steps, and only where no
per-token work needs the tokens (`SamplingParams.forced_prefix`)."""

from __future__ import annotations

from typing import Any

import pytest

from edmm.engine import Engine, SamplingParams
from edmm.server.guided import GuidedDecoding
from edmm.server.protocol import FunctionDefinition
from edmm.server.tool_parser import parse_reply

LOOKUP = FunctionDefinition(name="lookup", parameters={  # every call the same: all forced
    "type": "object", "properties": {"key": {"type": "string", "enum": ["record"]}},
    "required": ["key"], "additionalProperties": False})
OPEN = FunctionDefinition(name="open_file", parameters={  # a free string: forced to its key
    "type": "object", "properties": {"path": {"type": "string", "maxLength": 12}},
    "required": ["path"], "additionalProperties": False})



def _run(engine: Engine, params: SamplingParams, rid: str) -> tuple[list[int], str, int]:
    """The output's tokens and text, and the engine steps until it finished."""
    prompt = engine.tokenizer.encode("<|im_start|>user\nFind it.<|im_end|>\n"
                                     "<|im_start|>assistant\n")
    engine.add_request(rid, prompt, params)
    final, steps = None, 0
    while engine.has_unfinished():
        steps += 1
        for out in engine.step():
            final = out if out.finished else final
    assert final is not None and final.outputs[0].finish_reason == "stop"
    return list(final.outputs[0].token_ids), final.outputs[0].text, steps


@pytest.mark.parametrize("function", [LOOKUP, OPEN], ids=["enum", "free-string"])
def test_the_forced_start_gives_the_same_call_in_fewer_steps(
        engine: Engine, guided: GuidedDecoding, function: FunctionDefinition) -> None:
    runs = []
    for forced in (False, True):
        proc = guided.tool_calls([function], False)
        # greedy: a sampled reply would draw its random numbers for fewer tokens
        params = SamplingParams(temperature=0.0, max_tokens=64, logits_processors=[proc],
                                forced_output_ids=list(proc.forced) if forced else [])
        runs.append(_run(engine, params, f"{function.name}-{forced}"))
    (ids, text, steps), (f_ids, f_text, f_steps) = runs
    proc = guided.tool_calls([function], False)
    n = len(proc.forced)
    assert n >= 8 and ids[:n] == list(proc.forced)  # decoding token by token gives them too
    assert (f_ids, f_text) == (ids, text)
    assert f_steps == steps - n  # one prefill computes what took n decode steps
    (call,) = parse_reply(text).tool_calls
    assert call.name == function.name
    if function is LOOKUP:
        assert f_steps <= 3  # the whole call is forced: prefill, then the end


def test_the_forced_start_stops_short_of_a_stop_token_and_max_tokens() -> None:
    p = SamplingParams(max_tokens=5, forced_output_ids=[4, 5, 6, 7, 8, 9])
    assert p.forced_prefix({99}) == [4, 5, 6, 7]  # one token is always sampled
    assert SamplingParams(max_tokens=50, forced_output_ids=[4, 5, 6],
                          stop_token_ids=[6]).forced_prefix(()) == [4, 5]
    assert SamplingParams(max_tokens=50, forced_output_ids=[4, 5, 6]).forced_prefix({5}) == [4]
    assert SamplingParams(max_tokens=50, forced_output_ids=[4, 5, 6],
                          ignore_eos=True).forced_prefix({5}) == [4, 5, 6]


@pytest.mark.parametrize("per_token", [
    {"logprobs": 0}, {"stop": ["x"]}, {"presence_penalty": 0.5}, {"logit_bias": {3: 1.0}}])
def test_no_forced_start_where_each_token_is_needed(per_token: dict[str, Any]) -> None:
    assert SamplingParams(max_tokens=50, forced_output_ids=[4, 5],
                          **per_token).forced_prefix(()) == []


def test_forced_ids_are_checked() -> None:
    from edmm.engine.sampling import InvalidSamplingParams

    with pytest.raises(InvalidSamplingParams, match="forced_output_ids"):
        SamplingParams(forced_output_ids=[-1])


LOOKUP_TOOL = {"type": "function", "function": {
    "name": LOOKUP.name, "description": "Look a record up.", "parameters": LOOKUP.parameters}}


def test_over_http_a_forced_call_costs_a_prefill_and_its_kv_is_reused(fresh_server: Any) -> None:
    """Through the server: a call forced by name whose arguments the schema fixes comes back
    whole after about one step, and the resume after its result reuses the prompt and the
    reply's KV (the forced tokens are the template's own)."""
    from server_helpers import MODEL, QUESTION

    client = fresh_server.client()
    steps = fresh_server.metric("edmm_engine_steps_total")
    first = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[LOOKUP_TOOL], temperature=0, max_tokens=64,
        tool_choice={"type": "function", "function": {"name": "lookup"}})
    taken = fresh_server.metric("edmm_engine_steps_total") - steps
    (call,) = first.choices[0].message.tool_calls
    assert call.function.name == "lookup" and call.function.arguments == '{"key": "record"}'
    assert first.usage.completion_tokens >= 10 and taken <= 3
    messages = [*QUESTION, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "found"}]
    resumed = client.chat.completions.create(model=MODEL, messages=messages,
                                             tools=[LOOKUP_TOOL], temperature=0, max_tokens=4)
    reused = resumed.usage.prompt_tokens_details.cached_tokens
    assert reused >= first.usage.prompt_tokens + first.usage.completion_tokens - 2


def test_the_flag_turns_it_off(engine: Engine) -> None:
    """``--no-grammar-fast-forward`` reaches `GuidedDecoding`, whose processors then force
    nothing at the start (every token decoded)."""
    from edmm.server.cli import build_parser, config_from_args

    on = config_from_args(build_parser().parse_args([]))
    off = config_from_args(build_parser().parse_args(["--no-grammar-fast-forward"]))
    assert on.grammar_fast_forward and not off.grammar_fast_forward
    tok = engine.tokenizer
    plain = GuidedDecoding(tok, engine.model_config.vocab_size, tok.eos_token_id,
                           fast_forward=False)
    assert plain.tool_calls([LOOKUP], False).forced == ()
