"""The shipped tool model: loads through the ordinary code, equals transformers greedily, and
follows the tool-call format."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from edmm import LLM, SamplingParams
from edmm.model import load_tokenizer
from edmm.model.tiny import default_model
from edmm.server.tool_parser import parse_reply

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time.",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string"}}}}}
PROMPTS: list[tuple[list[dict[str, Any]], list[dict[str, Any]]]] = [
    ([{"role": "user", "content": "What is the weather in Paris?"}], [WEATHER]),
    ([{"role": "user", "content": "What time is it in Tokyo?"}], [WEATHER, TIME]),
    ([{"role": "user", "content": "What is the weather in Oslo and in Rome?"}], [WEATHER]),
    ([{"role": "user", "content": "Hello!"}], [WEATHER]),
    ([{"role": "user", "content": "What is the weather in Paris?"},
      {"role": "assistant", "content": "", "tool_calls": [{"id": "c0", "type": "function",
       "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
      {"role": "tool", "tool_call_id": "c0", "content": "sunny, 24 C"}], [WEATHER]),
]
GREEDY = SamplingParams(temperature=0, max_tokens=40)


@pytest.fixture(scope="module")
def llm() -> Any:
    """``LLM()``: the default model, which is the shipped tool model."""
    with LLM() as engine:
        yield engine


@pytest.fixture(scope="module")
def replies(llm: Any) -> list[Any]:
    """Greedy replies of the engine to every prompt of PROMPTS."""
    return [llm.chat(m, GREEDY, tools=t)[0].outputs[0] for m, t in PROMPTS]


def test_default_model_is_the_shipped_folder(llm: Any) -> None:
    folder = default_model()
    assert (folder / "model.safetensors").stat().st_size < 8 * 2**20
    assert llm.llm_engine.model_config.vocab_size == 1024


def test_greedy_equals_transformers(replies: list[Any]) -> None:
    from transformers import AutoModelForCausalLM

    folder = default_model()
    tok = load_tokenizer(folder)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    for (messages, tools), reply in zip(PROMPTS, replies, strict=True):
        text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                       tokenize=False)
        ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=GREEDY.max_tokens, do_sample=False,
                              eos_token_id=[2, 0], pad_token_id=0)
        expected = out[0, ids.shape[1]:].tolist()
        if expected and expected[-1] in (0, 2):
            expected = expected[:-1]  # the engine drops the EOS from the token ids
        assert list(reply.token_ids)[: len(expected)] == expected


def _calls(text: str) -> list[tuple[str, dict[str, Any]]]:
    return [(c.name, json.loads(c.arguments)) for c in parse_reply(text).tool_calls]


def test_it_follows_the_format(replies: list[Any]) -> None:
    """A weather and a time question get a call of the right tool with the city copied from the
    question (a random model writes no parseable call); a JSON request gets the JSON."""
    weather, clock = (r.text for r in replies[:2])
    assert _calls(weather) == [("get_weather", {"city": "Paris"})], weather
    assert _calls(clock) == [("get_time", {"city": "Tokyo"})], clock
    answer = replies[4].text
    assert _calls(answer) == [] and answer.strip(), answer  # after the result: text, no call


def test_json_when_asked(llm: Any) -> None:
    out = llm.chat([{"role": "user", "content": "Lisbon is a city in Portugal. Return the city "
                     "and country as JSON."}], GREEDY)[0].outputs[0].text
    assert json.loads(out) == {"city": "Lisbon", "country": "Portugal"}
