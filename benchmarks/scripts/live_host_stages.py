"""Host-side costs of a live resume, stage by stage, without HTTP or a model (CPU).

    python -m benchmarks.scripts.live_host_stages --tokenizer DIR [--contexts 16384,31744]

The conversation of `edmm bench live` (its `Prompts`, tool and 512-token result) at each
context: the first turn is rendered and encoded as the server does (not timed), then the A
resume is timed, each stage alone, min and median of ``--runs``:

- ``sdk``: the openai SDK's ``chat.completions.create`` up to its HTTP transport (a mock that
  answers at once), i.e. its conversion of the messages and the body's JSON;
- ``parse``: the body's JSON parsed and validated in one pass, as the server does
  (`edmm.server.body.parse_body`); ``parse, FastAPI's way``: ``json.loads`` then validation,
  as FastAPI's body parameter did;
- ``convert``: the server's checks and message conversion before rendering (a body that
  passed the one-pass parse needs no surrogate check); ``surrogate check``: `check_text` of
  the whole request, which that parse spares;
- ``render+tokenize``: the prompt ids on the tokenizing thread (`ChatPrompts.ids`: the
  incremental render and `PromptEncoder`), each run after the first turn and the
  `ChatPrompts.prepare_resume` the server runs while the tool runs (with the turn's reply:
  the resume is joined from its prepared pieces, no template runs); ``... window``: prepared
  without the reply (the window from the last user query is rendered, as before the pieces
  were made); ``... unprepared``: not prepared at all; ``... uncut``: the tool result
  encoded as one piece (`PromptEncoder`'s cuts off), as before they were made;
- ``full render+tokenize``: the same conversation rendered whole (`render_chat`), for scale;
- ``request``: the engine's `RequestValidator` on those ids.

Writes live-host-stages.{csv,json,md} into ``--out``.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from typing import Any

from benchmarks.scripts import live_script_parser
from edmm.bench.live import TOOL, TOOL_NAME, LiveBenchConfig, Prompts, load_tokenizer
from edmm.bench.results import ResultWriter, collect_environment
from edmm.bench.stats import summarize
from edmm.engine import RequestValidator, SamplingParams
from edmm.model.ascii_bpe import AsciiBPE
from edmm.model.prompt_encoder import PromptEncoder, cuttable_split
from edmm.server.body import parse_body
from edmm.server.chat_prompts import ChatPrompts
from edmm.server.prompts import render_chat, template_messages, template_tools
from edmm.server.protocol import ChatCompletionRequest
from edmm.server.validation import check_conversation, check_text

CALL = {"id": "call_1", "type": "function",
        "function": {"name": TOOL_NAME, "arguments": '{"key": "record"}'}}
REPLY = {"role": "assistant", "content": "", "tool_calls": [CALL]}


def _times(fn: Callable[[], Any], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _sdk_call(messages: list[dict[str, Any]]) -> Callable[[], Any]:
    """``chat.completions.create`` against a transport that answers at once."""
    import httpx2  # the openai SDK's HTTP client
    import openai

    reply = {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
             "choices": [{"index": 0, "finish_reason": "stop",
                          "message": {"role": "assistant", "content": "ok"}}],
             "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
    http = openai.DefaultHttpxClient(
        transport=httpx2.MockTransport(lambda request: httpx2.Response(200, json=reply)))
    client = openai.OpenAI(base_url="http://127.0.0.1:1/v1", api_key="k", http_client=http)
    create: Any = client.chat.completions.create
    return lambda: create(model="m", messages=messages, tools=[TOOL], tool_choice="none",
                          temperature=0, max_tokens=8, extra_body={"ignore_eos": True})


def measure(tok: Any, context: int, runs: int) -> list[dict[str, Any]]:
    """One row per stage at ``context``."""
    cfg = LiveBenchConfig(contexts=(context,), result_tokens=512)
    prompts = Prompts(tok, cfg, random.Random(0))
    first = prompts.conversation(context)
    resume = prompts.resume("A", first, REPLY, "call_1", prompts.text(512))
    body = json.dumps({"model": "m", "messages": resume, "tools": [TOOL],
                       "tool_choice": "none", "max_tokens": 8, "stream": True}).encode()
    req = ChatCompletionRequest.model_validate_json(body)
    msgs, tools = template_messages(req.messages), template_tools(req.tools)
    first_msgs = template_messages(ChatCompletionRequest.model_validate(
        {"model": "m", "messages": first}).messages)

    split = cuttable_split(tok._tokenizer)  # the ASCII fast path, built once (~1 s)
    bpe: AsciiBPE | bool = (AsciiBPE.of(tok._tokenizer, split) or False) if split else False

    def convert() -> None:
        check_conversation(req.messages)
        template_messages(req.messages)
        template_tools(req.tools)

    def incremental(prepared: str = "slots", cut: bool = True) -> Any:
        encoder = PromptEncoder(tok, fast_bpe=bpe)
        encoder._cut = encoder._cut and cut
        chat = ChatPrompts(tok, encoder)
        turn = chat.render(first_msgs, tools, None, None)  # the first turn, as the server saw it
        if prepared == "slots":  # as the server does when the turn ends in the call
            chat.prepare_resume(turn.prompt, REPLY)
        elif prepared == "window":
            chat.prepare_resume(turn.prompt)
        t0 = time.perf_counter()
        ids = chat.ids(msgs, tools, None, None)
        return ids, (time.perf_counter() - t0) * 1e3

    def full() -> float:
        encoder = PromptEncoder(tok, fast_bpe=bpe)
        render_chat(tok, first_msgs, tools, None, encoder)
        t0 = time.perf_counter()
        render_chat(tok, msgs, tools, None, encoder)
        return (time.perf_counter() - t0) * 1e3

    ids, _ = incremental()
    validator = RequestValidator(vocab_size=len(tok), max_model_len=2 * context,
                                 has_tokenizer=True)
    stages = {"sdk": _times(_sdk_call(resume), runs),
              "parse": _times(lambda: parse_body(ChatCompletionRequest, body,
                                                 "application/json"), runs),
              "parse, FastAPI's way": _times(lambda: ChatCompletionRequest.model_validate(
                  json.loads(body)), runs),
              "convert": _times(convert, runs),
              "surrogate check": _times(lambda: check_text(
                  req.model_dump(by_alias=True, exclude_defaults=True)), runs),
              "render+tokenize": [incremental()[1] for _ in range(runs)],
              "render+tokenize window": [incremental("window")[1] for _ in range(runs)],
              "render+tokenize unprepared": [incremental("no")[1] for _ in range(runs)],
              "render+tokenize uncut": [incremental(cut=False)[1] for _ in range(runs)],
              "full render+tokenize": [full() for _ in range(runs)],
              "request": _times(lambda: validator.make("r", ids, SamplingParams()), runs)}
    return [{"context_tokens": context, "prompt_tokens": len(ids), "stage": name,
             "min_ms": min(t), "median_ms": summarize(t).median, "n": len(t)}
            for name, t in stages.items()]


def main() -> None:
    args = live_script_parser(15).parse_args()
    tok = load_tokenizer(str(args.tokenizer))
    rows = [row for c in args.contexts.split(",") for row in measure(tok, int(c), args.runs)]
    writer = ResultWriter(args.out, "live-host-stages", collect_environment("cpu"))
    writer.add_rows(rows)
    paths = writer.write(rows, title="Host-side stages of a live A resume (CPU, no HTTP)",
                         notes=[f"tokenizer: {args.tokenizer} ({len(tok)} tokens); "
                                "milliseconds, min and median of "
                                f"{args.runs} runs; see the script's docstring"])
    print("wrote " + ", ".join(str(p) for p in paths.values()))


if __name__ == "__main__":
    main()
