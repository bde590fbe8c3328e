"""``edmm demo``: an agent tool loop on the embedded tiny model, EDMM on and off, in seconds.

Three agent sessions (chat template with tools, as an OpenAI-compatible client would render
them) run interleaved on the CPU (host twin, nothing downloaded). Each turn ends in scripted tool
calls (the tiny model's weights are random, so its text is noise): an idempotent tool whose
result another session already got (memoised prediction), a tool whose output is streamed while
it runs, a tool whose result the client predicts, and a plain one. The client sends the tool-call
arguments back re-serialised. The loop runs with EDMM on (speculation, retention, zero-copy
commit) and off (none of them); the greedy outputs must be identical. Then the A/B/C TTFT
groups of ``edmm bench ttft`` run in their CPU smoke size.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edmm.agent import AgentConfig, AgentEngine, SessionState, ToolCall, ToolResult, ToolSpec
from edmm.agent.render import assistant_message
from edmm.bench.report import markdown_table
from edmm.engine import EngineConfig, EngineStats, SamplingParams

TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"Call {name.replace('_', ' ')}.",
    "parameters": {"type": "object", "properties": {arg: {"type": "string"}},
                   "required": [arg]}}}
    for name, arg in (("get_weather", "city"), ("read_file", "path"),
                      ("run_command", "command"), ("search_web", "query"))]


@dataclass(frozen=True)
class ScriptedCall:
    """A tool call of the script: what it returns, how long it runs, how EDMM learns of it."""

    name: str
    args: dict[str, str]
    result: str
    ticks: int  # engine steps the tool runs for
    mode: str = "plain"  # plain | predict (the client predicts it) | stream (output streamed)


SESSIONS: dict[str, tuple[str, list[ScriptedCall]]] = {
    "weather": ("What is the weather in Paris and in London?", [
        ScriptedCall("get_weather", {"city": "Paris"}, '{"temperature": 21.5, "sky": "sunny"}', 4),
        ScriptedCall("get_weather", {"city": "London"}, '{"temperature": 14, "sky": "rain"}', 3,
                     "predict"),
        ScriptedCall("search_web", {"query": "latest news"}, '{"items": [1, 2, 3]}', 5)]),
    "coder": ("There is a bug in src/main.py, please fix it.", [
        ScriptedCall("read_file", {"path": "src/main.py"},
                     "def main() -> None:\n    for x in range(10):\n        print(x)\n", 3),
        ScriptedCall("run_command", {"command": "python -m pytest"},
                     "collected 12 items\n............\n12 passed in 0.4s", 6, "stream"),
        ScriptedCall("read_file", {"path": "README.md"}, "# Demo\nA small project.", 2,
                     "predict")]),
    "planner": ("Plan my day: check the weather in Paris first.", [
        ScriptedCall("get_weather", {"city": "Paris"}, '{"temperature": 21.5, "sky": "sunny"}', 4),
        ScriptedCall("run_command", {"command": "git status"}, "nothing to commit", 3, "stream"),
        ScriptedCall("search_web", {"query": "how to cook rice"}, '{"items": [4, 5]}', 2,
                     "predict")]),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@dataclass
class _Session:
    """The client side of one agent conversation."""

    sid: str
    messages: list[dict[str, Any]]
    calls: list[ScriptedCall]
    turn: int = 0
    pending: ScriptedCall | None = None
    ticks_left: int = 0
    streamed: int = 0
    outputs: list[list[int]] = field(default_factory=list)
    done: bool = False


def _call_id(session: _Session) -> str:
    return f"{session.sid}-call{session.turn}"


def _render(agent: AgentEngine, messages: list[dict[str, Any]]) -> list[int]:
    tok = agent.tokenizer
    text = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True,
                                   tokenize=False)
    return list(tok.encode(text, add_special_tokens=False))


def _on_turn_end(agent: AgentEngine, s: _Session, output: list[int]) -> None:
    """The model's turn ended: record it, then report the next scripted tool call."""
    s.outputs.append(output)
    if s.turn == len(s.calls):
        s.done = True
        return
    sc = s.calls[s.turn]
    emitted = ToolCall(_call_id(s), sc.name, json.dumps(sc.args, separators=(",", ":")))
    # The client keeps the assistant message with the arguments parsed and re-serialised;
    # EDMM is told what the model emitted and re-serialises them the same way.
    s.messages.append(assistant_message(agent.tokenizer.decode(output), [emitted]))
    predictions = {emitted.id: sc.result} if sc.mode == "predict" else None
    agent.await_tools(s.sid, [emitted], messages=s.messages, tools=TOOLS,
                      predictions=predictions)
    for tc in s.messages[-1]["tool_calls"]:
        tc["function"]["arguments"] = json.dumps(json.loads(tc["function"]["arguments"]))
    s.pending, s.ticks_left, s.streamed = sc, sc.ticks, 0


def _tool_tick(agent: AgentEngine, s: _Session) -> None:
    """One engine step of a running tool: stream a slice of its output, or return it."""
    sc = s.pending
    assert sc is not None
    s.ticks_left -= 1
    if sc.mode == "stream" and s.ticks_left > 0:
        end = len(sc.result) * (sc.ticks - s.ticks_left) // sc.ticks
        agent.feed_tool_output(s.sid, _call_id(s), sc.result[s.streamed:end])
        s.streamed = end
    if s.ticks_left > 0:
        return
    s.messages.append({"role": "tool", "tool_call_id": _call_id(s), "content": sc.result})
    prompt = _render(agent, s.messages)
    agent.resume(s.sid, f"{s.sid}-t{s.turn + 1}", [ToolResult(_call_id(s), sc.result)], GREEDY,
                 prompt=prompt)
    s.pending, s.turn = None, s.turn + 1


def run_agent_loop(agent: AgentEngine, turns: int = 3) -> dict[str, list[list[int]]]:
    """Run every scripted session to its end, interleaved; each session's turn outputs."""
    agent.declare_tool(ToolSpec("get_weather", cacheable=True, expected_duration_s=0.2))
    sessions = [_Session(sid, [{"role": "user", "content": q}], calls[:turns])
                for sid, (q, calls) in SESSIONS.items()]
    for s in sessions:
        agent.add_request(f"{s.sid}-t0", _render(agent, s.messages), GREEDY, session_id=s.sid)
    while not all(s.done for s in sessions):
        finished = {o.request_id: o for o in agent.step() if o.finished}
        for s in sessions:
            out = finished.get(f"{s.sid}-t{s.turn}")
            if out is not None and agent.session_state(s.sid) == SessionState.FINISHED:
                _on_turn_end(agent, s, out.outputs[0].token_ids)
            elif s.pending is not None:
                _tool_tick(agent, s)
    return {s.sid: s.outputs for s in sessions}


def _metrics_rows(agent: AgentEngine) -> list[dict[str, Any]]:
    rows = []
    for sid in agent.session_ids():
        m = agent.session_metrics(sid)
        ttft = sum(m.resume_ttft_s) / len(m.resume_ttft_s) * 1e3 if m.resume_ttft_s else None
        commit = sum(m.commit_s) / len(m.commit_s) * 1e6 if m.commit_s else None
        rows.append({"session": sid, "turns": m.turns, "resumes": m.resumes,
                     "tokens reused": m.tokens_reused, "recomputed": m.tokens_recomputed,
                     "speculated": m.tokens_speculated, "hit": m.spec_hits,
                     "partial": m.spec_partial, "miss": m.spec_misses,
                     "resume TTFT ms": ttft, "commit us": commit})
    return rows


def _engine_line(stats: EngineStats) -> str:
    """What the engine computed and reused over the run, from its stats snapshot."""
    return (f"Engine: {stats.prompt_tokens} prompt tokens in finished requests, "
            f"{stats.prompt_tokens_computed} computed and {stats.prompt_tokens_reused} reused; "
            f"{stats.speculation_tokens_computed} tokens prefilled speculatively; "
            f"{stats.kv.cached_pages} of {stats.kv.pages_total} KV pages held by the prefix "
            "cache at the end.")


def _run(edmm: bool, model_dir: str | None, turns: int,
         ) -> tuple[dict[str, Any], list[dict], EngineStats]:
    config = AgentConfig() if edmm else AgentConfig.off()
    engine = EngineConfig(model=model_dir, dtype="float32", max_model_len=1024,
                          host_page_size=16384, num_slots=24, max_num_seqs=4)
    with AgentEngine(engine, config) as agent:
        outputs = run_agent_loop(agent, turns)
        return outputs, _metrics_rows(agent), agent.engine.stats()


def _agent_section(model_dir: str | None, turns: int) -> bool:
    t0 = time.perf_counter()
    on, on_rows, on_stats = _run(True, model_dir, turns)
    off, off_rows, off_stats = _run(False, model_dir, turns)
    same = on == off
    print(f"## Agent tool loop: {len(on)} sessions x {turns} tool turns "
          f"({time.perf_counter() - t0:.1f} s for both runs)\n")
    print(f"Greedy outputs identical with EDMM on and off: {'yes' if same else 'NO'}\n")
    print("EDMM on (speculation: template, streamed, predicted; retention: cost):\n")
    print(markdown_table(on_rows) + "\n")
    print(_engine_line(on_stats) + "\n")
    print("EDMM off (no speculation, LRU retention):\n")
    print(markdown_table(off_rows) + "\n")
    print(_engine_line(off_stats) + "\n")
    return same


def _bench_section(contexts: tuple[int, ...], iterations: int, out: Path | None) -> None:
    import tempfile

    from edmm.bench.agent import AgentBenchConfig, ratio_notes, run_agent_bench

    cfg = AgentBenchConfig.cpu_smoke(contexts=contexts, iterations=iterations)
    with tempfile.TemporaryDirectory() as tmp:
        paths = run_agent_bench(cfg, out or Path(tmp))
        doc = json.loads(paths["json"].read_text())
    cols = ("context_tokens", "group", "what", "ttft_trimmed_mean_ms", "prefilled_tokens",
            "cached_tokens", "commit_ms", "speculation", "ratio_to_A")
    rows = [{c: r[c] for c in cols} for r in doc["summary"]]
    print(f"## TTFT of a resume (edmm bench ttft groups; tiny model, CPU, {iterations} "
          "iterations, trimmed means)\n")
    print(markdown_table(rows) + "\n")
    for line in ratio_notes(doc["summary"]):
        print(f"- {line}")
    if out is not None:
        print(f"\nfiles: {', '.join(str(p) for p in paths.values())}")


def build_parser() -> argparse.ArgumentParser:
    """Arguments of ``edmm demo``."""
    p = argparse.ArgumentParser(prog="edmm demo", description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=3, choices=(1, 2, 3),
                   help="tool turns per session")
    p.add_argument("--contexts", default="256,1024",
                   help="context lengths of the TTFT groups (comma-separated tokens)")
    p.add_argument("--iterations", type=int, default=5, help="timed resumes per group")
    p.add_argument("--no-bench", action="store_true", help="skip the TTFT groups")
    p.add_argument("--out", type=Path, default=None,
                   help="also write the TTFT groups' CSV/JSON/Markdown here")
    p.add_argument("--model", default=None, help="a local HF folder (default: the tiny model)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; 0 if EDMM on and off gave identical outputs."""
    import torch

    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)  # tiny models: one thread is fastest
    print("# EDMM demo: agent sessions on the embedded tiny model (CPU, host twin)\n")
    same = _agent_section(args.model, args.turns)
    if not args.no_bench:
        contexts = tuple(int(x) for x in args.contexts.split(",") if x)
        _bench_section(contexts, args.iterations, args.out)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
