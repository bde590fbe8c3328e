"""Render + encode time of an agent's resume prompt: whole vs `PromptEncoder` (CPU).

    python -m benchmarks.scripts.prompt_encode [--tokenizer DIR] [--out DIR]

A conversation of ~N tokens ends in a tool call (the turn the server encoded), then the resume
with a ~500-token tool result is rendered with the chat template and encoded: by the tokenizer
alone, and through a `PromptEncoder` that encoded the earlier turn. Both give the same ids
(checked on every run); 7 runs each. Writes prompt-encode.{csv,json,md}.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from edmm.bench.results import ResultWriter, collect_environment
from edmm.bench.stats import summarize
from edmm.model.prompt_encoder import PromptEncoder
from edmm.model.tiny import ensure_tiny_model
from edmm.server.prompts import render_chat

WORDS = ["agent", "tool", "memory", "result", "page", "cache", "token", "prefix", "branch",
         "commit", "session", "window"]
CALL = {"id": "c1", "type": "function",
        "function": {"name": "lookup", "arguments": "{\"key\": \"record\"}"}}
RUNS = 7


def _conversation(rng: random.Random, words: int) -> tuple[list[Any], list[Any]]:
    """The turn that emitted a tool call, and the resume with the tool's result."""
    turn = [{"role": "system", "content": "You are helpful."},
            {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(words))},
            {"role": "assistant", "content": None, "tool_calls": [CALL]}]
    result = " ".join(rng.choice(WORDS) for _ in range(400))
    return turn, [*turn, {"role": "tool", "tool_call_id": "c1", "content": result}]


def _measure(tok: Any, turn: list[Any], resume: list[Any]) -> dict[str, list[float]]:
    """Milliseconds of rendering + encoding the resume, whole and incrementally."""
    want = render_chat(tok, resume, None, None)
    times: dict[str, list[float]] = {"whole": [], "PromptEncoder": []}
    for _ in range(RUNS):
        encoder = PromptEncoder(tok)
        render_chat(tok, turn, None, None, encoder)  # the earlier turn, not timed
        for mode, enc in (("whole", None), ("PromptEncoder", encoder)):
            t0 = time.perf_counter()
            ids = render_chat(tok, resume, None, None, enc)
            times[mode].append((time.perf_counter() - t0) * 1e3)
            assert ids == want
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", type=Path, default=None, help="default: the tiny model's")
    parser.add_argument("--words", type=int, nargs="+", default=[3000, 12000, 24000])
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    tok = AutoTokenizer.from_pretrained(args.tokenizer or ensure_tiny_model())
    rng = random.Random(0)
    rows: list[dict[str, Any]] = []
    summary: list[dict[str, Any]] = []
    for n in args.words:
        turn, resume = _conversation(rng, n)
        tokens = len(render_chat(tok, resume, None, None))
        for mode, times in _measure(tok, turn, resume).items():
            rows += [{"prompt_tokens": tokens, "mode": mode, "ms": t} for t in times]
            s = summarize(times)
            summary.append({"prompt_tokens": tokens, "mode": mode, "min_ms": min(times),
                            "median_ms": s.median, "n": s.n})
    writer = ResultWriter(args.out, "prompt-encode", collect_environment("cpu"))
    writer.add_rows(rows)
    paths = writer.write(summary, title="render + encode of a resume prompt: whole vs "
                         "PromptEncoder (CPU)",
                         notes=["tokenizer: " + str(args.tokenizer or "the embedded tiny model's"),
                                f"{RUNS} runs each; the same ids checked on every run"])
    print(paths["md"].read_text())


if __name__ == "__main__":
    main()
