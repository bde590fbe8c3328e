"""The agent TTFT groups (``edmm bench ttft`` A/B/C): time to first token of a resume turn.

For each context length n (the resume prompt's length, so that n = the model's context fits),
prompts are synthetic token ids (no tokenizer needed, so presets with random weights run
unchanged on a GPU): a tool result R of ``result_tokens`` tokens, a session context C of
n - |R| tokens (the first turn's prompt and its one generated token), and an insertion point
p = ``insert_fraction`` x |C|.

- **A, cached prefix**: the next prompt is the session's context + R appended; the session's KV
  is retained, so only R (and the last context token) is prefilled.
- **B, mid-prompt contamination**: R is inserted at p, before the suffix C[p:], and the prompt
  is submitted as a plain request, as engines do today: the prefix cache hits up to p (a
  branch of the paused session's KV) and everything after it is recomputed.
- **C, speculative prefill + zero-copy commit**: the same prompt as B, but R was predicted: the
  predicted-result speculation prefilled it in a branch during the tool window (untimed); the
  resume commits the branch by slot swap and prefills only the last token.

Every iteration opens a fresh session on the cached context (a branch of one base prefill),
reports its tool calls, and times ``resume`` to the first token (the device is synchronised by
the sampled token's copy to the host). The CSV holds every iteration; the summary trimmed means
(10% each side) and B/A, C/A ratios beside the seed's; ``commit_ms`` is the admission's
lookup + commit + truncate.
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from edmm.agent import AgentConfig, AgentEngine, TokenLayout, ToolCall, ToolResult
from edmm.bench.results import Progress, ResultWriter, collect_environment
from edmm.bench.stats import ratio, summarize
from edmm.engine import EngineConfig, EntryRank, SamplingParams, SlotHints
from edmm.engine.tp import build_engine

GROUPS = ("A", "B", "C")
GROUP_NAMES = {"A": "cached prefix, result appended",
               "B": "result inserted mid-prompt, recompute from it",
               "C": "B's prompt, speculative prefill + zero-copy commit"}
# The seed document's ratios (Qwen2.5-7B, H100): vLLM 0.6.6's live engine / its standalone
# transformers benchmark at 16K.
SEED_RATIOS = {"B/A": (8.21, 4.18), "C/A": (1.17, 0.96)}
# The seed document's live table: vLLM 0.6.6's engine, Qwen2.5-7B, one H100, its own client
# (context not stated), ms.
SEED_VLLM_066 = {"A": 33.35, "B": 273.80}
_ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
_BASE_TAG, _B_TAG = "bench:base", "bench:B"


@dataclass(frozen=True)
class ResumeBenchConfig:
    """What to run. ``model``: a preset or local HF folder (None: the embedded tiny model);
    ``max_num_batched_tokens`` None: large enough to prefill the longest prompt in one step."""

    model: str | None = "qwen2.5-7b"
    device: str = "cuda"
    dtype: str | None = "bfloat16"
    contexts: tuple[int, ...] = (4096, 16384, 32768)
    result_tokens: int = 512
    insert_fraction: float = 0.5
    iterations: int = 20
    warmup: int = 2
    max_num_batched_tokens: int | None = None
    num_pages: int | None = None
    host_page_size: int = 64 * 1024
    enforce_eager: bool = False
    seed: int = 0
    attention: str = "auto"  # the engine's attention backend (`EngineConfig.attention`)
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.result_tokens < 1 or self.iterations < 1 or self.warmup < 0:
            raise ValueError("result_tokens and iterations must be >= 1, warmup >= 0")
        if not self.contexts or min(self.contexts) < self.result_tokens + 3:
            raise ValueError(f"contexts must exceed result_tokens + 2, got {self.contexts}")
        if not 0.0 <= self.insert_fraction < 1.0:
            raise ValueError(f"insert_fraction must be in [0, 1), got {self.insert_fraction}")

    @classmethod
    def cpu_smoke(cls, **overrides: Any) -> ResumeBenchConfig:
        """The tiny model on the CPU, small contexts: seconds."""
        base = dict(model=None, device="cpu", dtype="float32", contexts=(256, 1024),
                    result_tokens=32, iterations=5, warmup=1, host_page_size=16384)
        return cls(**{**base, **overrides})

    def engine_config(self) -> EngineConfig:
        """One engine for every context: the longest prompt fits, and prefills in one step."""
        longest = max(self.contexts)
        budget = self.max_num_batched_tokens or longest
        return EngineConfig(model=self.model, device=self.device, dtype=self.dtype,
                            max_model_len=longest, max_num_batched_tokens=budget,
                            num_pages=self.num_pages, host_page_size=self.host_page_size,
                            num_slots=16, max_num_seqs=4, enforce_eager=self.enforce_eager,
                            attention=self.attention,
                            tensor_parallel_size=self.tensor_parallel_size)


@dataclass(frozen=True)
class _Iteration:
    """One timed resume."""

    ttft_ms: float
    prompt_tokens: int
    cached_tokens: int
    commit_ms: float
    speculation: str  # hit / partial / miss / none


class _Runner:
    """Sessions on one agent engine, each resumed once in the way its group prescribes."""

    def __init__(self, agent: AgentEngine, cfg: ResumeBenchConfig, rng: random.Random) -> None:
        self.agent = agent
        self.cfg = cfg
        self.rng = rng
        self.vocab = agent.engine.model_config.vocab_size
        self._ids = 0

    def tokens(self, n: int) -> list[int]:
        """``n`` random token ids (their values do not change the work)."""
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def prefill_base(self, context: list[int]) -> None:
        """Cache the context once (a tagged entry: branched from, never adopted)."""
        self.agent.engine.add_request(self._next_id("base"), context, _ONE_TOKEN,
                                      SlotHints(_BASE_TAG, EntryRank.RETAINED))
        self._run_until_idle()

    def drop_base(self) -> None:
        self.agent.engine.kv.discard([_BASE_TAG])
        self.agent.engine.reclaim()

    def iteration(self, group: str, context: list[int]) -> _Iteration:
        """One session on the cached context: a first turn, a tool window, a timed resume."""
        sid = self._next_id(f"s{group}")
        result, position = self._open_window(sid, group, context)
        request_id = f"{sid}-t1"
        if group == "B":  # no session: the engine alone, its prefix cache only
            ctx = self.agent.session_context(sid)
            prompt = [*ctx[:position], *result, *ctx[position:]]
            t0 = time.perf_counter()
            self.agent.engine.add_request(request_id, prompt, _ONE_TOKEN, SlotHints(_B_TAG))
        else:
            t0 = time.perf_counter()
            self.agent.resume(sid, request_id, [ToolResult("c", result)], _ONE_TOKEN)
        out = self._first_token(request_id)
        ttft = (time.perf_counter() - t0) * 1e3
        spec = _speculation(self.agent.session_metrics(sid))
        self.agent.close_session(sid)
        self.agent.engine.kv.discard([_B_TAG])
        self.agent.engine.reclaim()  # off the clock: only the base entry stays
        hit = out.prefix_hit
        return _Iteration(ttft, len(out.prompt_token_ids), out.num_cached_tokens,
                          hit.seconds * 1e3 if hit is not None else 0.0, spec)

    def _open_window(self, sid: str, group: str, context: list[int]) -> tuple[list[int], int]:
        """The session's first turn, then its tool call (C: with the result predicted) and
        the tool window, in which speculation prefills (untimed). Returns the result and its
        insertion position (the end of the context for A)."""
        self.agent.add_request(f"{sid}-t0", context, _ONE_TOKEN, session_id=sid)
        self._run_until_idle()
        result = self.tokens(self.cfg.result_tokens)
        ctx_len = len(self.agent.session_context(sid))  # the prompt and its generated token
        position = ctx_len if group == "A" else int(self.cfg.insert_fraction * ctx_len)
        predictions = {"c": result} if group == "C" else None
        self.agent.await_tools(sid, [ToolCall("c", "tool")], predictions=predictions,
                               layout=TokenLayout(positions={"c": position}))
        self._run_until_idle()
        # The tool window has passed: the device has finished the speculation's queued work
        # (its steps sample nothing, so nothing waited for them).
        if torch.device(self.agent.engine.config.device).type == "cuda":
            torch.cuda.synchronize()
        return result, position

    def _first_token(self, request_id: str) -> Any:
        while True:
            for out in self.agent.step():
                if out.request_id == request_id:
                    self._run_until_idle()
                    return out

    def _run_until_idle(self) -> None:
        while self.agent.has_unfinished() or self.agent.has_speculation():
            self.agent.step()

    def _next_id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}-{self._ids}"


def _speculation(m: Any) -> str:
    for name, count in (("hit", m.spec_hits), ("partial", m.spec_partial),
                        ("miss", m.spec_misses)):
        if count:
            return name
    return "none"


def measure(agent: AgentEngine, cfg: ResumeBenchConfig) -> list[dict[str, Any]]:
    """Per-iteration rows of every group at every context (warm-up iterations dropped)."""
    runner = _Runner(agent, cfg, random.Random(cfg.seed))
    rows: list[dict[str, Any]] = []
    progress = Progress("groups", len(cfg.contexts) * len(GROUPS) * (cfg.warmup + cfg.iterations))
    for ctx in cfg.contexts:
        context = runner.tokens(ctx - cfg.result_tokens - 1)  # + 1 generated token + R = ctx
        runner.prefill_base(context)
        for group in GROUPS:
            for i in range(cfg.warmup + cfg.iterations):
                it = runner.iteration(group, context)
                progress.step(f"context {ctx} group {group}")
                if i >= cfg.warmup:
                    rows.append({"context_tokens": ctx, "group": group,
                                 "iteration": i - cfg.warmup, **dataclasses.asdict(it),
                                 "prefilled_tokens": it.prompt_tokens - it.cached_tokens})
        runner.drop_base()
    return rows


def summarize_groups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per context and group: TTFT trimmed mean / median / p10 / p90, tokens, commit time,
    and the group's ratio to A."""
    out = []
    for ctx in dict.fromkeys(r["context_tokens"] for r in rows):
        means: dict[str, float] = {}
        for group in GROUPS:
            sel = [r for r in rows if r["context_tokens"] == ctx and r["group"] == group]
            if not sel:
                continue
            s = summarize([r["ttft_ms"] for r in sel])
            means[group] = s.trimmed_mean
            out.append({
                "context_tokens": ctx, "group": group, "what": GROUP_NAMES[group],
                "ttft_trimmed_mean_ms": s.trimmed_mean, "median_ms": s.median,
                "p10_ms": s.p10, "p90_ms": s.p90, "n": s.n,
                "prefilled_tokens": sel[0]["prefilled_tokens"],
                "cached_tokens": sel[0]["cached_tokens"],
                "commit_ms": summarize([r["commit_ms"] for r in sel]).trimmed_mean,
                "speculation": sel[0]["speculation"],
                "ratio_to_A": ratio(s.trimmed_mean, means["A"]) if "A" in means else None,
            })
    return out


RIDE_ALONG_TOKENS = (0, 32, 128)  # speculative_tokens_when_busy of the interference phases


def measure_interference(agent: AgentEngine, cfg: ResumeBenchConfig, context: int,
                         steps: int = 40) -> list[dict[str, Any]]:
    """Decode steps of one running request at ``context`` tokens, alone and while a long
    speculative prefill is queued, with ``speculative_tokens_when_busy`` at each of
    `RIDE_ALONG_TOKENS` (0: speculation waits for steps with no request); per-step wall time
    and the speculation's progress, as rows."""
    engine, rng = agent.engine, random.Random(cfg.seed + 1)
    steps = max(1, min(steps, context // (2 * len(RIDE_ALONG_TOKENS) + 2)))  # CPU smoke runs
    vocab = engine.model_config.vocab_size
    phases = [("decode alone", None)] + [
        (f"decode + speculation, {n} tokens riding along", n) for n in RIDE_ALONG_TOKENS]
    prompt = [rng.randrange(vocab) for _ in range(context - len(phases) * steps - 2)]
    params = SamplingParams(temperature=0.0, max_tokens=len(phases) * steps + 1,
                            ignore_eos=True)
    engine.add_request("interference", prompt, params)
    engine.step()  # the prompt's prefill (one step: the budget holds the longest prompt)
    base = engine.update_scheduler_config()
    rows = []
    try:
        for phase, busy in phases:
            if busy is not None:
                engine.update_scheduler_config(speculative_tokens_when_busy=busy)
                spec = [rng.randrange(vocab) for _ in range(context // 2)]
                engine.speculate(f"interference-{busy}", spec,
                                 SlotHints("bench:spec", EntryRank.SPECULATIVE))
            for i in range(steps):
                t0 = time.perf_counter()
                engine.step()  # samples: the host waits for the device
                elapsed = (time.perf_counter() - t0) * 1e3
                progress = engine.speculation_progress(f"interference-{busy}")
                rows.append({"phase": phase, "context_tokens": context, "iteration": i,
                             "step_ms": elapsed,
                             "speculated_tokens": progress[0] if progress else None})
            if busy is not None:
                engine.stop_speculation(f"interference-{busy}")
    finally:
        engine.update_scheduler_config(
            speculative_tokens_when_busy=base.speculative_tokens_when_busy)
    while engine.has_unfinished() or engine.has_speculation():
        engine.step()
    engine.kv.discard(["bench:spec"])
    engine.reclaim()
    return rows


def _interference_notes(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    phases = list(dict.fromkeys(r["phase"] for r in rows))
    alone = summarize([r["step_ms"] for r in rows if r["phase"] == phases[0]]).median
    notes = [f"decode step at {rows[0]['context_tokens']} tokens, medians of "
             f"{sum(r['phase'] == phases[0] for r in rows)} steps: alone {alone:.3f} ms"]
    for phase in phases[1:]:
        shared = summarize([r["step_ms"] for r in rows if r["phase"] == phase]).median
        done = max((r["speculated_tokens"] or 0 for r in rows if r["phase"] == phase),
                   default=0)
        notes.append(f"{phase}: {shared:.3f} ms ({shared / alone:.2f}x), speculative tokens "
                     f"computed meanwhile: {done}")
    return notes


def _write_interference(rows: list[dict[str, Any]], cfg: ResumeBenchConfig,
                        out_dir: Path) -> None:
    summary = []
    for phase in dict.fromkeys(r["phase"] for r in rows):
        s = summarize([r["step_ms"] for r in rows if r["phase"] == phase])
        summary.append({"phase": phase, "context_tokens": rows[0]["context_tokens"],
                        "median_ms": s.median, "p10_ms": s.p10, "p90_ms": s.p90, "n": s.n})
    writer = ResultWriter(out_dir, "agent-interference", collect_environment(cfg.device))
    writer.add_rows(rows)
    writer.write(summary, title=f"decode steps with and without speculation ({cfg.device})",
                 notes=_interference_notes(rows))


def run_resume_bench(cfg: ResumeBenchConfig, out_dir: Path) -> dict[str, Path]:
    """Run the A/B/C groups and the decode-interference check; write
    ``agent-ttft.{csv,json,md}`` and ``agent-interference.{csv,json,md}`` into ``out_dir``."""
    engine = build_engine(cfg.engine_config())
    agent = AgentEngine(engine, AgentConfig(speculation=("predicted",)))
    try:
        rows = measure(agent, cfg)
        interference = measure_interference(agent, cfg, max(cfg.contexts) // 2)
        mcfg = agent.engine.model_config
        stats = agent.engine.stats()
    finally:
        agent.close()
        engine.close()
    summary = summarize_groups(rows)
    _write_interference(interference, cfg, out_dir)
    writer = ResultWriter(out_dir, "agent-ttft", collect_environment(cfg.device))
    writer.add_rows(rows)
    notes = [f"model: {cfg.model or 'tiny (embedded)'} ({mcfg.architecture}, "
             f"{mcfg.num_layers} layers), {cfg.dtype}, random token ids",
             f"result: {cfg.result_tokens} tokens; B/C insert it at {cfg.insert_fraction:.2f}"
             " of the context",
             f"iterations: {cfg.iterations} after {cfg.warmup} warm-up; trimmed mean drops 10% "
             "each side",
             f"engine over the whole run (warm-up included): {stats.prompt_tokens_computed} "
             f"prompt tokens computed, {stats.prompt_tokens_reused} reused, "
             f"{stats.speculation_tokens_computed} prefilled speculatively, "
             f"{stats.num_preemptions} preemptions",
             *ratio_notes(summary), *_interference_notes(interference)]
    return writer.write(summary, title=f"edmm bench ttft: agent resume groups ({cfg.device})",
                        notes=notes)


def ratio_notes(summary: list[dict[str, Any]]) -> list[str]:
    """B/A and C/A per context, beside the seed's (vLLM 0.6.6 live / standalone, H100)."""
    seed = "; ".join(f"{k} {' / '.join(f'{v:.2f}x' for v in vals)}"
                     for k, vals in SEED_RATIOS.items())
    lines = [f"for comparison, the seed's H100 figures (vLLM 0.6.6 live engine / standalone "
             f"transformers benchmark): {seed}"]
    for ctx in dict.fromkeys(r["context_tokens"] for r in summary):
        by = {r["group"]: r for r in summary if r["context_tokens"] == ctx}
        parts = [f"{g}/A {by[g]['ratio_to_A']:.2f}x" for g in ("B", "C") if g in by]
        lines.append(f"{ctx} tokens: " + ", ".join(parts))
    return lines
