"""Send the same OpenAI requests to a vLLM server and to ``edmm serve`` and compare the replies
field by field: the status code, then the shape of the body (every key path with the JSON type
of its value, and the value itself for enumerations such as ``object``, ``finish_reason`` and
error ``type``/``param``). Values that depend on the model's text are not compared.

Usage (both servers serving the same model folder)::

    python benchmarks/scripts/compare_openai_fields.py \\
        --a http://127.0.0.1:8001 --a-model MODEL --b http://127.0.0.1:8000 --b-model MODEL \\
        [--api-key KEY] [--out compare.md]

Each case is one request (`CASES`): the fields issue-tracked for the drop-in surface (``n``,
``logprobs``, penalties, ``logit_bias``, ``stream_options``, ``tool_choice: "none"``,
``parallel_tool_calls``, an unknown field, a refused field, ``/v1/models/{id}``,
``/v1/responses``). The report is a markdown table of the cases whose status or shape differ,
then the key paths only one side has.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

# Keys whose values are compared (enumerations), not only their types.
ENUM_KEYS = frozenset({"object", "finish_reason", "role", "type", "param", "code", "status"})
WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
HI = [{"role": "user", "content": "What is the weather in Paris?"}]


@dataclass(frozen=True)
class Case:
    """One request: its name, method, path and JSON body (``model`` is filled in)."""

    name: str
    path: str
    body: dict[str, Any] | None = None  # None: a GET

    def send(self, client: httpx.Client, base: str, model: str) -> tuple[int, Any]:
        """(status, the JSON body, or the list of SSE data chunks of a stream)."""
        path = self.path.replace("{model}", model)
        if self.body is None:
            r = client.get(base + path)
            return r.status_code, _json(r.text)
        body = {"model": model, **self.body}
        r = client.post(base + path, json=body)
        if body.get("stream") and r.status_code == 200:
            chunks = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
            return r.status_code, [_json(c) for c in chunks]
        return r.status_code, _json(r.text)


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _chat(name: str, **fields: Any) -> Case:
    return Case(name, "/v1/chat/completions",
                {"messages": HI, "max_tokens": 8, "temperature": 0, **fields})


CASES = [
    _chat("plain"),
    _chat("n=2", n=2, temperature=1.0),
    _chat("logprobs", logprobs=True, top_logprobs=2),
    _chat("top_logprobs without logprobs", top_logprobs=2),
    _chat("penalties", presence_penalty=1.0, frequency_penalty=0.5),
    _chat("penalty out of range", presence_penalty=3.0),
    _chat("logit_bias", logit_bias={"1": -100}),
    _chat("logit_bias out of range", logit_bias={"1": 101}),
    _chat("stream", stream=True),
    _chat("stream usage", stream=True, stream_options={"include_usage": True,
                                                       "continuous_usage_stats": True}),
    _chat("stream_options without stream", stream_options={"include_usage": True}),
    _chat("tool_choice none", tools=[WEATHER], tool_choice="none"),
    _chat("tool_choice required", tools=[WEATHER], tool_choice="required", max_tokens=64),
    _chat("parallel_tool_calls false", tools=[WEATHER], tool_choice="required",
          parallel_tool_calls=False, max_tokens=64),
    _chat("unknown field", no_such_field=1),
    _chat("legacy functions", functions=[{"name": "f", "parameters": {}}]),
    _chat("min_p", min_p=0.1),
    Case("completions logprobs", "/v1/completions",
         {"prompt": "Hello", "max_tokens": 4, "logprobs": 2, "temperature": 0}),
    Case("models", "/v1/models"),
    Case("model by id", "/v1/models/{model}"),
    Case("unknown model by id", "/v1/models/no-such-model"),
    Case("responses", "/v1/responses", {"input": "Say hello.", "max_output_tokens": 8}),
    Case("responses tools", "/v1/responses", {
        "input": "Weather in Paris?", "max_output_tokens": 64, "tool_choice": "required",
        "tools": [{"type": "function", **WEATHER["function"]}]}),
]


def shape(value: Any, path: str = "") -> Iterator[str]:
    """``path: type`` (``path = value`` for `ENUM_KEYS`) of every leaf of a JSON value; list
    items are merged under ``[]``."""
    if isinstance(value, dict):
        for key, item in value.items():
            sub = f"{path}.{key}" if path else key
            if key in ENUM_KEYS and isinstance(item, str | None):
                yield f"{sub} = {item!r}"
            else:
                yield from shape(item, sub)
        if not value:
            yield f"{path}: {{}}"
    elif isinstance(value, list):
        if not value:
            yield f"{path}: []"
        for item in value:
            yield from shape(item, f"{path}[]")
    else:
        kind = "null" if value is None else "number" if isinstance(
            value, int | float) and not isinstance(value, bool) else type(value).__name__
        yield f"{path}: {kind}"


@dataclass(frozen=True)
class Difference:
    """One case's differences between side a and side b."""

    case: str
    status: tuple[int, int]
    only_a: list[str]
    only_b: list[str]


def compare(a: tuple[int, Any], b: tuple[int, Any], case: str) -> Difference | None:
    """The differences of two replies to ``case`` (None: the same status and shape)."""
    sa, sb = set(shape(a[1])), set(shape(b[1]))
    if a[0] == b[0] and sa == sb:
        return None
    return Difference(case, (a[0], b[0]), sorted(sa - sb), sorted(sb - sa))


def report(differences: list[Difference], cases: int) -> str:
    """The markdown report."""
    lines = [f"{cases - len(differences)} of {cases} cases: same status and shape.", "",
             "| case | status a | status b | only a | only b |", "| --- | --- | --- | --- | --- |"]
    for d in differences:
        lines.append(f"| {d.case} | {d.status[0]} | {d.status[1]} | "
                     f"{'<br>'.join(d.only_a) or '-'} | {'<br>'.join(d.only_b) or '-'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Compare; print (and write ``--out``) the report; exit 0 (differences are data)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", required=True, help="base URL of side a (e.g. vLLM)")
    parser.add_argument("--a-model", required=True)
    parser.add_argument("--b", required=True, help="base URL of side b (e.g. edmm serve)")
    parser.add_argument("--b-model", required=True)
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--out", default=None, help="write the report here too")
    args = parser.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"}
    differences = []
    with httpx.Client(headers=headers, timeout=120) as client:
        for case in CASES:
            a = case.send(client, args.a.rstrip("/"), args.a_model)
            b = case.send(client, args.b.rstrip("/"), args.b_model)
            found = compare(a, b, case.name)
            if found is not None:
                differences.append(found)
    text = report(differences, len(CASES))
    sys.stdout.write(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
