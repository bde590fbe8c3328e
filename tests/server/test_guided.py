"""Grammar-constrained decoding: forced tool calls and JSON schemas on the random tiny model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from edmm.engine import Engine, EngineConfig, SamplingParams
from edmm.server.errors import BadRequestError
from edmm.server.guided import GuidedDecoding
from edmm.server.protocol import FunctionDefinition
from edmm.server.tool_parser import parse_reply

FUNCTIONS = [
    FunctionDefinition(name="get_weather", parameters={
        "type": "object", "additionalProperties": False, "required": ["city", "days"],
        "properties": {"city": {"enum": ["Paris", "Tokyo"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}}}),
    FunctionDefinition(name="noop"),  # no parameters: any object
]


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Any:
    with Engine(EngineConfig(model=str(tiny_dir), max_model_len=1024, num_slots=4,
                             max_num_seqs=4)) as e:
        yield e


@pytest.fixture(scope="module")
def guided(engine: Engine) -> GuidedDecoding:
    tok = engine.tokenizer
    return GuidedDecoding(tok, engine.model_config.vocab_size, tok.eos_token_id)


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
