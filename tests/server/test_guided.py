"""Grammar-constrained decoding: forced tool calls and JSON schemas on the random tiny model."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from edmm.engine import Engine, SamplingParams
from edmm.server.errors import BadRequestError
from edmm.server.grammar_probe import PROBE_NICENESS, GrammarProbe, check_grammar
from edmm.server.guided import (
    GrammarBudget,
    GrammarLimits,
    GuidedDecoding,
    bounded_strings,
    clean_message,
)
from edmm.server.protocol import FunctionDefinition
from edmm.server.tool_parser import parse_reply

FUNCTIONS = [
    FunctionDefinition(name="get_weather", parameters={
        "type": "object", "additionalProperties": False, "required": ["city", "days"],
        "properties": {"city": {"enum": ["Paris", "Tokyo"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}}}),
    FunctionDefinition(name="noop"),  # no parameters: any object
]



def _run(engine: Engine, processor: Any, seed: int, max_tokens: int = 200) -> str:
    prompt = engine.tokenizer.encode("<|im_start|>user\nWeather?<|im_end|>\n"
                                     "<|im_start|>assistant\n")
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                            logits_processors=[processor])
    engine.add_request(f"r{seed}", prompt, params)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out if out.finished else final
    assert final is not None and final.outputs[0].finish_reason == "stop"
    return final.outputs[0].text


@pytest.mark.parametrize("parallel", [False, True])
def test_forced_calls_are_valid_for_every_seed(engine: Engine, guided: GuidedDecoding,
                                               parallel: bool) -> None:
    for seed in range(4):
        reply = parse_reply(_run(engine, guided.tool_calls(FUNCTIONS[:1], parallel), seed))
        assert reply.content is None and reply.tool_calls
        assert parallel or len(reply.tool_calls) == 1
        for call in reply.tool_calls:
            args = json.loads(call.arguments)
            assert call.name == "get_weather" and args["city"] in ("Paris", "Tokyo")
            assert 1 <= args["days"] <= 7 and set(args) == {"city", "days"}
            assert call.arguments == json.dumps(args)  # printed the way tojson prints it


def test_json_schema_response(engine: Engine, guided: GuidedDecoding) -> None:
    schema = {"type": "object", "required": ["ok"], "additionalProperties": False,
              "properties": {"ok": {"type": "boolean"}}}
    for seed in range(3):
        assert isinstance(json.loads(_run(engine, guided.json_schema(schema), seed))["ok"], bool)


def test_invalid_schema_is_a_bad_request(guided: GuidedDecoding) -> None:
    with pytest.raises(BadRequestError):
        guided.json_schema({"type": "no-such-type"})
    with pytest.raises(BadRequestError):
        guided.tool_calls([], parallel=False)


PANIC = ("panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10\n"
         "<backtrace>\n   0: <unknown>\n  16: type_call\n             at /tmp/Objects/typeobject.c"
         ":1091:11\n</backtrace>")
LISTING = ("at 1(8): failed to compile JSON schema: Invalid type: nope\n"
           "   1 | start: %json {\"type\": \"nope\"}\n       ^")


def test_llguidance_messages_lose_backtraces_and_listings() -> None:
    assert clean_message(PANIC) == ("panic: assertion failed: grammar.symbols.len() < u16::MAX "
                                    "as usize - 10")
    assert clean_message(LISTING) == "failed to compile JSON schema: Invalid type: nope"
    assert len(clean_message("x" * 10_000)) < 600


def test_a_grammar_over_its_mask_budget_stops_at_eos(engine: Engine, tiny_dir: Path) -> None:
    """Masks costing more than the budget (here: any) stop the processor: it allows only EOS
    from then on, at no cost, and says why."""
    tok = engine.tokenizer
    costly = GuidedDecoding(tok, engine.model_config.vocab_size, tok.eos_token_id,
                            GrammarBudget(first_mask_s=60.0, mask_s=0.0, grace_masks=0))
    processor = costly.json_schema({"type": "object"})
    assert processor.failure is None and processor.param == "response_format"
    text = _run(engine, processor, seed=0)
    assert processor.failure is not None and "too costly" in processor.failure
    assert text == "{"  # the mask that went over is applied, then only EOS


def test_a_grammar_whose_first_mask_is_over_budget_is_refused(engine: Engine) -> None:
    tok = engine.tokenizer
    strict = GuidedDecoding(tok, engine.model_config.vocab_size, tok.eos_token_id,
                            GrammarBudget(first_mask_s=0.0))
    with pytest.raises(BadRequestError) as info:
        strict.json_schema({"type": "object"})
    assert info.value.code == "grammar_too_costly" and info.value.param == "response_format"


@pytest.mark.parametrize("schema", [
    pytest.param({"type": "nope"}, id="bad-type"),
    pytest.param({"type": "object", "properties": {"n": {"type": "integer", "minimum": 3,
                                                         "maximum": 1}}}, id="nested-bounds"),
    pytest.param({"type": "object", "properties": {"s": {"type": "string", "minLength": 3,
                                                         "maxLength": 1}}}, id="nested-lengths"),
    pytest.param({"type": "object", "x-guidance": None}, id="x-guidance-null"),
    pytest.param([1], id="not-an-object"),
])
def test_check_schema_refuses_invalid_schemas(guided: GuidedDecoding, schema: Any) -> None:
    with pytest.raises(BadRequestError) as info:
        guided.check_schema(schema, "tools.3")
    assert info.value.param == "tools.3"


def test_check_schema_accepts_valid_ones(guided: GuidedDecoding) -> None:
    for function in FUNCTIONS:
        guided.check_schema(function.parameters or {"type": "object"}, "tools.0")


COSTLY_PATTERN = "^((a{100}){100}){10}$"
COSTLY = {"type": "object", "required": ["a"], "properties": {
    "a": {"type": "string", "pattern": COSTLY_PATTERN}}}
# Cheap at the start; the mask of "a"'s value builds the costly pattern's lexer states.
COSTLY_LATER = {"type": "object", "required": ["x", "a"], "properties": {
    "x": {"type": "string", "maxLength": 2}, "a": {"type": "string", "pattern": COSTLY_PATTERN}}}


@pytest.fixture(scope="module")
def isolated(engine: Engine) -> Iterator[GuidedDecoding]:
    """Grammars checked in the probe process (as the server does)."""
    tok = engine.tokenizer
    g = GuidedDecoding(tok, engine.model_config.vocab_size, tok.eos_token_id, isolated=True)
    g.start()
    yield g
    g.close()


def test_the_probe_refuses_a_costly_grammar_and_remembers(isolated: GuidedDecoding,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          ) -> None:
    grammar = isolated.json_schema_grammar(COSTLY)
    t0 = time.process_time()
    with pytest.raises(BadRequestError) as info:
        asyncio.run(isolated.check_isolated([grammar]))
    assert info.value.code == "grammar_too_costly" and info.value.param == "response_format"
    assert time.process_time() - t0 < 0.05  # the lexer states were built in the probe
    assert "<state>" not in info.value.message and "Tokens:" not in info.value.message

    def no_probe(_: object) -> None:
        raise AssertionError("the verdict was not remembered")
    monkeypatch.setattr(GrammarProbe, "submit", no_probe)
    with pytest.raises(BadRequestError):
        asyncio.run(isolated.check_isolated([grammar]))


def test_the_probe_checks_tool_schemas_and_passes_good_grammars(
        isolated: GuidedDecoding) -> None:
    bad = isolated.schema_grammar({"type": "nope"}, "tools.1")
    good = [isolated.schema_grammar(FUNCTIONS[0].parameters, "tools.0"),
            isolated.tool_calls_grammar(FUNCTIONS, parallel=True)]
    asyncio.run(isolated.check_isolated(good))
    with pytest.raises(BadRequestError) as info:
        asyncio.run(isolated.check_isolated([*good, bad]))
    assert info.value.param == "tools.1" and "invalid JSON schema" in info.value.message


def test_the_probe_process_runs_at_a_lower_priority(isolated: GuidedDecoding) -> None:
    pool = isolated._probe._pool  # type: ignore[union-attr]
    assert pool is not None
    pids = [p.pid for p in pool._processes.values() if p.pid is not None]  # type: ignore[union-attr]
    assert pids and all(os.getpriority(os.PRIO_PROCESS, pid) >= os.getpriority(
        os.PRIO_PROCESS, 0) + PROBE_NICENESS for pid in pids)


@pytest.mark.parametrize(("limits", "stops"), [
    pytest.param(GrammarLimits(), True, id="serving-limits"),
    pytest.param(GrammarLimits(step_lexer_fuel=None), False, id="llguidance-defaults"),
])
def test_a_mask_over_the_fuel_stops_the_request_within_the_step_bound(
        engine: Engine, limits: GrammarLimits, stops: bool) -> None:
    """A grammar that passes its first mask but whose later mask builds costly lexer states
    stops there: the matcher goes over the parser's step fuel, so that mask is cheap, and the
    processor says why (with llguidance's default fuel the same mask takes ~0.2 s)."""
    tok = engine.tokenizer
    g = GuidedDecoding(tok, engine.model_config.vocab_size, tok.eos_token_id, limits=limits)
    processor = g.processor(g.json_schema_grammar(COSTLY_LATER))  # unchecked: its pattern
    spent: list[float] = []

    def timed(ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        t0 = time.thread_time()
        out = processor(ids, logits)
        spent.append(time.thread_time() - t0)
        return out
    _run(engine, timed, seed=0, max_tokens=48)
    if stops:
        assert processor.failure is not None and "too costly" in processor.failure
        assert max(spent) < 0.05
    else:
        assert max(spent) > 0.05  # the mutation: what the serving limits bound


def test_check_grammar_verdicts(engine: Engine) -> None:
    tok = engine.tokenizer
    g = GuidedDecoding(tok, engine.model_config.vocab_size, tok.eos_token_id)
    llt, vocab = g.spec.build(), engine.model_config.vocab_size

    def verdict(schema: Any, enforced: bool = True) -> str | None:
        text = g.json_schema_grammar(schema).text
        return check_grammar(llt, vocab, text, enforced, GrammarBudget(),
                             GrammarLimits()).problem
    assert verdict({"type": "object"}) is None
    assert verdict(COSTLY) == "costly"
    assert verdict(COSTLY, enforced=False) is None  # a tool's schema: only validated
    assert verdict({"type": "nope"}) == "invalid"
    assert verdict(COSTLY_LATER) is None  # its first mask is cheap...
    with pytest.raises(BadRequestError) as info:  # ...but its pattern alone is not
        g.json_schema(COSTLY_LATER)
    assert info.value.code == "grammar_too_costly" and info.value.param == "response_format"
    with pytest.raises(BadRequestError):
        g.tool_calls([FunctionDefinition(name="f", parameters=COSTLY_LATER)], parallel=False)


def test_bounded_strings_bound_only_unbounded_strings() -> None:
    schema = {"type": "object", "properties": {
        "free": {"type": "string"}, "nullable": {"type": ["string", "null"]},
        "own": {"type": "string", "maxLength": 3}, "pick": {"type": "string", "enum": ["a"]},
        "list": {"type": "array", "items": {"type": "string"}},
        "literal": {"const": {"type": "string"}}, "n": {"type": "integer"}}}
    out = bounded_strings(schema, 10)
    props = out["properties"]
    assert props["free"]["maxLength"] == props["nullable"]["maxLength"] == 10
    assert props["list"]["items"]["maxLength"] == 10
    assert props["own"]["maxLength"] == 3 and "maxLength" not in props["pick"]
    assert props["literal"] == {"const": {"type": "string"}} and props["n"] == {"type": "integer"}
    assert "maxLength" not in schema["properties"]["free"]  # a copy
    assert bounded_strings(schema, None) is schema


def test_forced_calls_under_async_scheduling_equal_the_calls_in_step(tiny_dir: Path) -> None:
    """Async scheduling with constrained decoding: each step's forward is queued before the
    previous step's tokens reach the host and the masks are computed after (the runner's
    `with_resolved_outputs`). Four forced calls at once, sampled, give the same tokens and
    finish reasons as in step; the processors' matchers took every token (EOS too, fed
    before the step that the engine drops once it sees the stop) without an error."""
    from edmm.engine import EngineConfig

    outputs = {}
    for mode in (False, True):
        with Engine(EngineConfig(model=str(tiny_dir), max_model_len=512, num_slots=8,
                                 max_num_seqs=8, async_scheduling=mode)) as engine:
            tok = engine.tokenizer
            guided = GuidedDecoding(tok, engine.model_config.vocab_size, tok.eos_token_id)
            prompt = tok.encode("<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n")
            procs = [guided.tool_calls(FUNCTIONS[:1], seed % 2 == 1) for seed in range(4)]
            for seed, proc in enumerate(procs):
                engine.add_request(f"r{seed}", prompt, SamplingParams(
                    temperature=1.0, seed=seed, max_tokens=200, logits_processors=[proc]))
            final = {}
            while engine.has_unfinished():
                for out in engine.step():
                    final[out.request_id] = (tuple(out.outputs[0].token_ids),
                                             out.outputs[0].finish_reason)
            assert all(p.failure is None for p in procs)
            outputs[mode] = final
    assert outputs[True] == outputs[False]
    assert all(reason == "stop" for _, reason in outputs[True].values())
    for tokens, _ in outputs[True].values():
        reply = parse_reply(tok.decode(list(tokens), skip_special_tokens=True))
        assert reply.tool_calls and all(c.name == "get_weather" for c in reply.tool_calls)
