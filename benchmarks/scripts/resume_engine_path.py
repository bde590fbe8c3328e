"""The engine thread's Python on a speculation-hit resume (group C), without HTTP (CPU).

    python -m benchmarks.scripts.resume_engine_path --model DIR [--contexts 16384] [--runs 8]

``--model``: a model folder with a tokenizer (a small model is enough: what is timed is the
Python around the model). Each run is a session of the server's `ServerSessions` (no event
loop, no engine thread: called directly): a first turn of random ids of about the context,
ended in a tool call with a predicted next prompt (the result inserted mid-prompt), the
speculation run to its end, then the resume sending exactly that prompt. Timed, min and median
over the runs after one warm-up:

- ``begin``: `ServerSessions.begin` of the resume (the stage log's ``engine_picked->begun``:
  the session named, the tool results matched, the turn queued);
- ``cache match``: the KV match in the resume's admission, as the scheduler times it
  (`PrefixHit.seconds`: the claimed branch matched, adopted, the session's old entry retired);
- ``first step``: the step that admits the resume and gives its first token (the model's
  forward included).

Writes resume-engine-path.{csv,json,md} into ``--out``.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edmm.bench.results import ResultWriter, collect_environment
from edmm.bench.stats import summarize
from edmm.engine import SamplingParams
from edmm.server.sessions import session_key
from edmm.server.state import ServerConfig, ServerState
from edmm.server.tool_parser import ParsedToolCall
from edmm.server.turns import Turn

RESULT_TOKENS = 512


def _timed(fn: Callable[..., Any], out: list[float]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            out.append((time.perf_counter() - t0) * 1e3)
    return call


def _run_out(state: ServerState) -> None:
    while state.sessions.has_unfinished():
        state.sessions.step()


def _resume(state: ServerState, rng: random.Random, context: int, tag: str,
            times: dict[str, list[float]] | None) -> None:
    """One session's first turn, tool window (speculation done) and timed resume."""
    sessions, engine = state.sessions, state.engine
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    vocab = engine.validator.vocab_size
    first = [rng.randrange(vocab) for _ in range(context - RESULT_TOKENS)]
    ended = Turn(engine.make_request(f"{tag}-0", first, params), asked_session=tag)
    ended.session_id = sessions.begin(ended)
    _run_out(state)
    agent_id = session_key(ended.owner, tag)  # the agent layer's id of the client's name
    ctx = sessions.agent.session_context(agent_id)
    mid = len(ctx) // 2
    predicted = [*ctx[:mid], *(rng.randrange(vocab) for _ in range(RESULT_TOKENS)), *ctx[mid:]]
    call = ParsedToolCall("lookup", "{}", id=f"call-{tag}")
    ended.calls, ended.predicted_prompt = [call], predicted
    sessions.end(ended)
    _run_out(state)
    turn = Turn(engine.make_request(f"{tag}-1", predicted, params), asked_session=tag,
                tool_results=((call.id, "stored"),))
    spans: dict[str, list[float]] = {"begin": [], "cache match": [], "first step": []}
    _timed(sessions.begin, spans["begin"])(turn)
    outputs = _timed(sessions.step, spans["first step"])()
    hit = next((o.prefix_hit for o in outputs if o.request_id == f"{tag}-1"), None)
    if hit is None:
        raise RuntimeError(f"session {tag}: the resume matched no cached KV")
    spans["cache match"].append(hit.seconds * 1e3)
    _run_out(state)
    if sessions.agent.session_metrics(agent_id).spec_hits != 1:
        raise RuntimeError(f"session {tag}: the resume was no speculation hit")
    sessions.agent.close_session(agent_id)
    if times is not None:
        for name, span in spans.items():
            times[name].append(span[0])


def measure(model: str, context: int, runs: int) -> list[dict[str, Any]]:
    """One row per timed part at ``context`` tokens."""
    state = ServerState(ServerConfig(model=model, device="cpu",
                                     engine={"max_model_len": context + 256}))
    rng = random.Random(0)
    _resume(state, rng, context, "warm", None)
    times: dict[str, list[float]] = {"begin": [], "cache match": [], "first step": []}
    for i in range(runs):
        _resume(state, rng, context, f"s{i}", times)
    return [{"context_tokens": context, "part": name, "min_ms": min(t),
             "median_ms": summarize(t).median, "n": len(t)} for name, t in times.items()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="model folder with a tokenizer")
    parser.add_argument("--contexts", default="16384")
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    rows = [row for c in args.contexts.split(",")
            for row in measure(args.model, int(c), args.runs)]
    writer = ResultWriter(args.out, "resume-engine-path", collect_environment("cpu"))
    writer.add_rows(rows)
    paths = writer.write(rows, title="The engine thread's Python on a C resume (CPU)",
                         notes=[f"model: {args.model}; milliseconds, min and median of "
                                f"{args.runs} runs; see the script's docstring"])
    print("wrote " + ", ".join(str(p) for p in paths.values()))


if __name__ == "__main__":
    main()
