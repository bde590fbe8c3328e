"""Embedded data of the tiny model: tokenizer training corpus and the chat template."""

# ruff: noqa: E501  (the Jinja template keeps Qwen's long lines verbatim)

from __future__ import annotations

import json

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOOL_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)

_ENGLISH = """\
The quick brown fox jumps over the lazy dog. A language model reads text as a sequence of
tokens and predicts the next one. An agent is a program that uses a model to decide which
tool to call, reads the result, and continues until the task is done. Each step of the loop
adds new messages to the conversation, so the prompt keeps growing while its beginning stays
the same. Caching the keys and values of that shared prefix saves a lot of work.

You are a helpful assistant. Please answer the question as briefly as possible. If you need
more information, ask the user. When a tool is available, call it with valid JSON arguments.
The weather in Paris is sunny today, with a high of 24 degrees and a light wind from the west.
Tomorrow it will rain in London and Berlin, and it will snow in the mountains near Zurich.
What is the capital of France? The capital of France is Paris. How many days are in a week?
There are seven days in a week: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and
Sunday. The meeting starts at nine in the morning and ends at half past ten.

Memory is managed in pages. When a request finishes, its pages return to the free list; when
a new request arrives, the scheduler checks whether enough pages are free before it admits it.
If memory runs out, the lowest priority request is preempted and its cache is swapped out or
dropped. Good scheduling keeps the GPU busy and the latency low. Throughput is measured in
tokens per second, and latency in milliseconds per token.

I think the user wants a list of files. Let me search the repository first. The search found
three matching files, so I will read the first one and summarize it. The file defines a class
with two methods and a small helper function. There is a bug on line twelve: the loop never
ends because the counter is not incremented. I fixed it and all tests pass now.

Once upon a time there was a small robot who loved to read books. Every night it would open
a new story and learn a few more words. One day it found a book about the sea, and it decided
to build a boat. The boat was small, but it was strong, and the robot sailed far away.
"""

_CODE = '''\
import json
import os
from dataclasses import dataclass


@dataclass
class Request:
    """One user request."""

    request_id: str
    prompt: list[int]
    max_tokens: int = 128

    def remaining(self, generated: int) -> int:
        return max(0, self.max_tokens - generated)


def read_config(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def main() -> None:
    cfg = read_config(os.environ.get("CONFIG", "config.json"))
    for key, value in sorted(cfg.items()):
        print(f"{key} = {value}")
    total = sum(x * x for x in range(10) if x % 2 == 0)
    if total > 100:
        raise ValueError("total is too large")


class Cache:
    def __init__(self, size: int) -> None:
        self.size = size
        self.items: dict[str, bytes] = {}

    def get(self, key: str) -> bytes | None:
        return self.items.get(key)

    def put(self, key: str, value: bytes) -> None:
        if len(self.items) >= self.size:
            self.items.pop(next(iter(self.items)))
        self.items[key] = value


if __name__ == "__main__":
    main()

$ ls -la /tmp && cat README.md | grep -n "install"
$ git status && git diff --stat
$ python -m pytest tests -q
for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }
function add(a, b) { return a + b; }
SELECT name, count(*) FROM users WHERE age > 30 GROUP BY name ORDER BY name;
'''

_TOOLS = {
    "get_weather": {
        "city": ["Paris", "London", "Berlin", "Tokyo", "New York"],
        "unit": ["celsius"],
    },
    "search_web": {"query": ["latest news", "python dataclass", "how to cook rice"]},
    "read_file": {"path": ["README.md", "src/main.py", "config.json", "/etc/hosts"]},
    "run_command": {"command": ["ls -la", "git status", "python -m pytest"]},
    "send_email": {"to": ["alice@example.com", "bob@example.org"], "subject": ["Hello"]},
    "calculator": {"expression": ["2 + 2", "17 * 3", "sqrt(144)"]},
}


def _tool_json() -> str:
    """Deterministic tool schemas, calls and results in the JSON shapes the template emits."""
    lines: list[str] = []
    for name, args in _TOOLS.items():
        schema = {
            "type": "function",
            "function": {
                "name": name,
                "description": f"Call {name.replace('_', ' ')}.",
                "parameters": {
                    "type": "object",
                    "properties": {k: {"type": "string"} for k in args},
                    "required": list(args),
                },
            },
        }
        lines.append(json.dumps(schema))
        for i in range(max(len(v) for v in args.values())):
            call = {k: v[i % len(v)] for k, v in args.items()}
            lines.append(json.dumps({"name": name, "arguments": call}))
            result = {"ok": True, "result": f"{name} returned {i + 1} items"}
            lines.append(json.dumps(result))
    lines.append(json.dumps({"temperature": 21.5, "humidity": 0.43, "wind": [3, 5, 8]}))
    lines.append(json.dumps({"error": None, "items": [{"id": 1}, {"id": 2}], "next": "abc"}))
    return "\n".join(lines)


def corpus() -> list[str]:
    """The tokenizer training corpus, as paragraphs."""
    text = _ENGLISH + "\n" + _CODE + "\n" + _tool_json()
    return [p for p in text.split("\n\n") if p.strip()]


# Qwen2.5/Qwen3-style template: tools listed in the system message, tool calls as
# <tool_call>{json}</tool_call>, tool results inside <tool_response> in a user turn, and
# <think> blocks kept only for assistant turns after the last real user query (like Qwen3).
CHAT_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
""".strip()
