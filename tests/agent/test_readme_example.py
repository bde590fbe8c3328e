"""The README's agent-loop example, verbatim, runs."""

from __future__ import annotations

from pathlib import Path

import pytest

README_EXAMPLE = '''
from edmm.agent import AgentEngine, ToolCall, ToolResult, assistant_message
from edmm.engine import SamplingParams
from edmm.server.tool_parser import parse_reply

agent = AgentEngine()                       # the embedded tool model on the CPU (host twin)
tok = agent.tokenizer
tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
messages = [{"role": "user", "content": "What is the weather in Paris?"}]
greedy = SamplingParams(temperature=0, max_tokens=48)

def render(msgs):                           # what an OpenAI-compatible server does
    text = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True,
                                   tokenize=False)
    return tok.encode(text, add_special_tokens=False)

def run(request_id):                        # the engine loop, until this request ends
    while True:
        for out in agent.step():
            if out.request_id == request_id and out.finished:
                return out

agent.add_request("t0", render(messages), greedy, session_id="s1")
reply = parse_reply(run("t0").outputs[0].text)   # the model's own call
name, args = reply.tool_calls[0].name, reply.tool_calls[0].arguments
print(name, args)                           # get_weather {"city": "Paris"}
call = ToolCall("call-1", name, args)
messages.append(assistant_message(reply.content or "", [call]))
agent.await_tools("s1", [call], messages=messages, tools=tools,
                  predictions={"call-1": '{"temp": 21}'})      # a prediction is optional
while agent.has_speculation():              # the tool runs: the loop keeps stepping and
    agent.step()                            # speculation prefills the next prompt
messages.append({"role": "tool", "tool_call_id": "call-1", "content": '{"temp": 21}'})
agent.resume("s1", "t1", [ToolResult("call-1", '{"temp": 21}')], greedy,
             prompt=render(messages))       # the prompt exactly as the client sent it
print(run("t1").outputs[0].text)
print(agent.session_metrics("s1"))          # reused / recomputed tokens, hit / partial / miss
agent.close()
'''


def test_readme_example_runs(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("EDMM_CACHE", str(tiny_dir.parent))  # the tiny model, already built
    exec(compile(README_EXAMPLE, "README", "exec"), {})
    printed = capsys.readouterr().out
    assert printed.startswith('get_weather {"city": "Paris"}\n'), printed
    assert "spec_hits=1" in printed and "tokens_recomputed=1," in printed
