"""`edmm bench agents`: the policy x load x memory matrix on one trace, in process.

The KV pool of each run is sized from the trace: the working set of ``S`` concurrent sessions is
``S x`` the mean over jobs of the job's largest context (its last prompt plus output), in pages;
a run at oversubscription ``x`` gets ``working set / x`` pages (never fewer than one longest
sequence needs; the report gives the oversubscription actually reached). One engine is built per
offload setting, with the largest pool any of its runs needs, and each run shrinks it with a
`KVBallast` (engine builds dominate the wall time on a GPU).

The main matrix runs every policy at every load at the main oversubscription; then ``edmm``
and the best baseline (highest sustainable load, then shortest mean engine-wait at the top
load) run again at the check oversubscription (1x) and in the short-tool mix, at the highest
load ``lru`` sustains (p90 resume TTFT <= 1 s; the lowest load if it sustains none).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from edmm.agent import AgentEngine
from edmm.bench.agents.engine_io import KVBallast, ballast_slots, pages_in_use, pages_total
from edmm.bench.agents.fleet import FleetConfig, generate_fleet
from edmm.bench.agents.policies import BASELINES, POLICIES, Policy
from edmm.bench.agents.replay import ReplayClock, ReplayConfig, Replayer, ReplayError, RunResult
from edmm.bench.agents.trace import (
    GeneratorConfig,
    Job,
    ToolTimes,
    as_forced_calls,
    first_jobs,
    generate,
    read_jsonl,
    scale,
    subagents_of,
    top_level,
)
from edmm.bench.agents.tracelab import read_tracelab
from edmm.bench.results import Progress
from edmm.engine import Engine, EngineConfig
from edmm.engine.kv_policy import cache_policy
from edmm.engine.step_cost import STEP_TIME_MODELS
from edmm.memory import KVSpec
from edmm.model.config import PRESETS, ModelConfig, parse_dtype, resolve_preset

MIXES = ("long", "short")
TOKENS_PER_TURN_WRAP = 6  # BEFORE + AFTER + SUFFIX tokens a tool result adds
OPEN_LOOP_SESSIONS = 16  # the open loop's default working set, in sessions


@dataclass(frozen=True)
class AgentsBenchConfig:
    """Everything `run_matrix` needs (see the module docstring and ``edmm bench agents -h``)."""

    model: str | None = None
    device: str = "cpu"
    dtype: str | None = None
    trace: Path | None = None
    jobs: int = 64  # at least the closed loop's highest load
    seed: int = 0
    generator: GeneratorConfig | FleetConfig = field(default_factory=GeneratorConfig)
    token_scale: float = 1.0
    time_scale: float = 1.0
    policies: tuple[str, ...] = ("lru", "ttl", "offload", "rewarm", "edmm")
    loads: tuple[float, ...] = (8, 32, 64)
    mode: str = "closed"
    oversubscription: float = 2.0
    check_oversubscription: float | None = 1.0
    short_mix: bool = True
    working_set_sessions: int | None = None  # None: see `sessions_sized_for`
    clock: str = "virtual"
    step_model: str = "h200-qwen2.5-7b"  # with clock "model": a name of STEP_TIME_MODELS
    prefetch_lead_s: float = 0.05
    host_page_size: int = 1 << 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    cuda_graph_token_sizes: tuple[int, ...] | None = None
    speculative_tokens_when_busy: int | None = None
    speculation_fills_padding: bool = True
    offload_cap_bytes: int = 32 << 30
    warmup: bool = True
    mix: str = "long"  # the tool mix of the main matrix: "long" or "short"
    checks: bool = True  # after the main matrix, edmm and the best baseline at 1x and short
    lean: bool = False  # write agents.json, agents.md and the timeline only (for a merge)
    step_log: bool = False  # also write agents-steps.csv: one row per engine step
    # In process only: call turns decode this many tokens, the rest of their output joins the
    # result (`trace.as_forced_calls`: the HTTP replay's work, its forced call's length); 0: off
    call_tokens: int = 0

    def __post_init__(self) -> None:
        if self.mix not in MIXES:
            raise ValueError(f"mix must be one of {MIXES}, got {self.mix!r}")
        if self.step_model not in STEP_TIME_MODELS:
            raise ValueError(f"step_model must be one of {sorted(STEP_TIME_MODELS)}, "
                             f"got {self.step_model!r}")
        if self.call_tokens < 0:
            raise ValueError(f"call_tokens must be >= 0, got {self.call_tokens}")

    def sessions_sized_for(self, load: float) -> float:
        """Concurrent sessions the KV pool of a run at ``load`` is sized for: the
        ``working_set_sessions`` given, else the load (closed loop: sessions) or
        `OPEN_LOOP_SESSIONS` (open loop: the load is a rate, not sessions)."""
        if self.working_set_sessions:
            return self.working_set_sessions
        return load if self.mode == "closed" else OPEN_LOOP_SESSIONS


@dataclass(frozen=True)
class Condition:
    """One run of the matrix."""

    mix: str  # "long" or "short"
    oversubscription: float
    load: float
    policy: str

    @property
    def label(self) -> str:
        return f"{self.policy} {self.mix} x{self.oversubscription:g} load {self.load:g}"


@dataclass
class RunRecord:
    """A finished run: its condition, pool and what it measured."""

    condition: Condition
    pages: int  # pages the run could use
    working_set_pages: int
    result: RunResult


def trace_jobs(cfg: AgentsBenchConfig) -> list[Job]:
    """The trace before scaling: the user's (TraceLab CSV for a ``.csv`` file, else JSONL),
    or generated (``cfg.jobs`` top-level jobs: the first generator's, or a fleet's)."""
    if cfg.trace is not None:
        if cfg.trace.suffix.lower() == ".csv":
            return read_tracelab(cfg.trace)
        return read_jsonl(cfg.trace)
    gen = dataclasses.replace(cfg.generator, num_jobs=cfg.jobs)
    if isinstance(gen, FleetConfig):
        return generate_fleet(gen, cfg.seed)
    return generate(gen, cfg.seed)


def load_trace(cfg: AgentsBenchConfig) -> dict[str, list[Job]]:
    """The long-tool trace (the user's, or generated), scaled, and the same jobs with short
    tools."""
    jobs = scale(trace_jobs(cfg), tokens=cfg.token_scale, time=cfg.time_scale)
    if cfg.call_tokens:
        jobs = as_forced_calls(jobs, cfg.call_tokens)
    mixes = {"long": jobs}
    if cfg.short_mix or cfg.mix == "short":
        mixes["short"] = short_tools(jobs, cfg.seed, cfg.time_scale)
    return mixes


def short_tools(jobs: list[Job], seed: int, time_scale: float) -> list[Job]:
    """The same jobs with every tool call redrawn under a second (times ``time_scale``)."""
    times = ToolTimes(math.log(0.3), 0.6, 0.95)
    rng = random.Random(seed + 1)
    out = []
    for job in jobs:
        turns = tuple(dataclasses.replace(t, tool_s=times.draw(rng) * time_scale)
                      if t.tool is not None else t for t in job.turns)
        out.append(dataclasses.replace(job, turns=turns))
    return out


def model_config(cfg: AgentsBenchConfig) -> ModelConfig:
    """The model's shapes without building it."""
    if cfg.model is None:
        return PRESETS["tiny"]
    if Path(cfg.model).is_dir():
        return ModelConfig.from_folder(cfg.model)
    return resolve_preset(cfg.model)


def token_bytes(cfg: AgentsBenchConfig) -> int:
    """KV bytes of one token of the model in the run's dtype."""
    mc = model_config(cfg)
    dtype = parse_dtype(cfg.dtype) if cfg.dtype is not None else mc.torch_dtype
    return KVSpec(mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype).token_bytes


def page_size(cfg: AgentsBenchConfig) -> int:
    """Bytes of one KV page (2 MiB on CUDA, the host page size on the host twin)."""
    return 2 << 20 if torch.device(cfg.device).type == "cuda" else cfg.host_page_size


def max_model_len(jobs: list[Job]) -> int:
    """Longest sequence a job of the trace reaches, rounded up to 64 tokens."""
    longest = max(j.peak_context + TOKENS_PER_TURN_WRAP * len(j.turns) for j in jobs)
    return -(-longest // 64) * 64


def footprint(job: Job, subagents: dict[str, Job]) -> int:
    """Tokens a top-level job holds at its largest: its largest context and its largest
    subagent's (a subagent runs while its parent's call waits)."""
    children = [subagents[t.subagent].peak_context for t in job.turns if t.subagent]
    return job.peak_context + max(children, default=0)


def working_set_pages(jobs: list[Job], sessions: float, cfg: AgentsBenchConfig) -> int:
    """Pages ``sessions`` concurrent sessions of the trace hold at their largest context
    (each with its largest subagent)."""
    subagents = subagents_of(jobs)
    top = top_level(jobs)
    mean_ctx = sum(footprint(j, subagents) for j in top) / len(top)
    return math.ceil(sessions * mean_ctx * token_bytes(cfg) / page_size(cfg))


def pool_pages(jobs: list[Job], load: float, oversub: float, cfg: AgentsBenchConfig) -> int:
    """Pages of a run at ``load`` and ``oversub`` (at least one longest sequence)."""
    sessions = cfg.sessions_sized_for(load)
    per_seq = math.ceil(max_model_len(jobs) * token_bytes(cfg) / page_size(cfg))
    return max(math.ceil(working_set_pages(jobs, sessions, cfg) / oversub), per_seq + 1)


class Matrix:
    """Builds engines, runs conditions, keeps their records (see the module docstring)."""

    def __init__(self, cfg: AgentsBenchConfig,
                 log: Callable[[str], None] = lambda s: None) -> None:
        for name in cfg.policies:
            POLICIES.create(name)  # unknown names fail before any engine is built
        self.cfg = cfg
        self.mixes = load_trace(cfg)
        self.records: list[RunRecord] = []
        self._log = log
        self._engine: Engine | None = None
        self._engine_offload: bool | None = None
        self._engine_pages = 0  # pages a run may use with no ballast
        self._idle_pages = 0  # pages the engine holds with nothing running (CUDA graphs' pad)
        self._runs = 0

    # ------------------------------------------------------------------ plan
    def plan_main(self) -> list[Condition]:
        """Every policy at every load, in the main mix (long tools unless ``cfg.mix``), at
        the main oversubscription."""
        return [Condition(self.cfg.mix, self.cfg.oversubscription, load, p)
                for p in self.cfg.policies for load in self.cfg.loads]

    def plan_checks(self, best_baseline: str | None, check_load: float) -> list[Condition]:
        """``edmm`` and the best baseline at the check oversubscription and in the short mix."""
        names = [n for n in ("edmm", best_baseline) if n is not None and n in self.cfg.policies]
        out = []
        for name in names:
            if self.cfg.check_oversubscription is not None:
                out.append(Condition("long", self.cfg.check_oversubscription, check_load, name))
            if "short" in self.mixes:
                out.append(Condition("short", self.cfg.oversubscription, check_load, name))
        return out

    def all_pages(self) -> int:
        """The largest pool any planned run needs."""
        oversubs = [self.cfg.oversubscription]
        if self.cfg.check_oversubscription is not None:
            oversubs.append(self.cfg.check_oversubscription)
        jobs = self.mixes["long"]
        return max(pool_pages(jobs, load, o, self.cfg) for load in self.cfg.loads
                   for o in oversubs)

    # ------------------------------------------------------------------ running
    def run(self, conditions: list[Condition],
            on_record: Callable[[RunRecord], object] = lambda r: None) -> list[RunRecord]:
        """Run ``conditions``, grouped so each engine is built once; ``on_record`` after each
        (e.g. to write partial results)."""
        ordered = sorted(conditions, key=lambda c: (POLICIES.create(c.policy).offload
                                                    != self._engine_offload))
        out = []
        progress = Progress("bench agents", len(ordered))
        for cond in ordered:
            record = self._run_one(cond)
            out.append(record)
            self.records.append(record)
            progress.step(_progress_line(record))
            on_record(record)
        return out

    def close(self) -> None:
        """Close the engine this matrix built."""
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    def _run_one(self, cond: Condition) -> RunRecord:
        policy = POLICIES.create(cond.policy)
        jobs = self.mixes[cond.mix]
        engine = self._engine_for(policy.offload)
        pages = pool_pages(jobs, cond.load, cond.oversubscription, self.cfg)
        ws = working_set_pages(jobs, self.cfg.sessions_sized_for(cond.load), self.cfg)
        self._log(f"run {cond.label}: {pages} pages (working set {ws})")
        result = self._replay(engine, policy, jobs, cond.load, max(self._engine_pages - pages, 0))
        return RunRecord(cond, pages, ws, result)

    def _replay(self, engine: Engine, policy: Policy, jobs: list[Job], load: float,
                ballast_pages: int) -> RunResult:
        self._runs += 1
        ballast = KVBallast(engine, ballast_pages)
        rcfg = ReplayConfig(mode=self.cfg.mode, load=load, clock=self.cfg.clock,
                            prefetch_lead_s=self.cfg.prefetch_lead_s, seed=self.cfg.seed,
                            step_log=self.cfg.step_log)
        clock = ReplayClock(rcfg.clock)
        engine.kv.set_cache_policy(cache_policy(policy.cache))
        # The agent layer times tool windows (learned durations, retention, prefetch) on the
        # replay's clock: on a virtual or modelled clock, wall time says nothing of them.
        agent = AgentEngine(engine, policy.agent_config(rcfg.tool_timeout_s,
                                                        rcfg.prefetch_lead_s), clock=clock)
        try:
            result = Replayer(agent, policy, jobs, rcfg, clock,
                              f"r{self._runs}",
                              reserved_pages=ballast.num_pages + self._idle_pages).run()
            agent.check_integrity()
        finally:
            agent.close()
            ballast.release()
            engine.kv.set_cache_policy(cache_policy(engine.config.kv_cache_policy))
        engine.reset_prefix_cache()
        engine.check_integrity()
        if pages_in_use(engine) != self._idle_pages:
            raise ReplayError(f"{pages_in_use(engine) - self._idle_pages} KV pages not back "
                              "after a run")
        return result

    def _engine_for(self, offload: bool) -> Engine:
        if self._engine is not None and self._engine_offload == offload:
            return self._engine
        self.close()
        cfg = self.engine_config(offload)
        self._log(f"building the engine (offload {'on' if offload else 'off'}, "
                  f"{cfg.num_pages} pages)")
        self._engine = Engine(cfg)
        if self.cfg.clock == "model":
            self._engine.step_time_model = STEP_TIME_MODELS[self.cfg.step_model]
        self._engine_offload = offload
        self._idle_pages = pages_in_use(self._engine)
        self._engine_pages = pages_total(self._engine) - self._idle_pages
        if self.cfg.warmup:
            warm = first_jobs(self.mixes["long"], 2)
            self._replay(self._engine, POLICIES.create("lru"), warm, 2, 0)
        return self._engine

    def engine_config(self, offload: bool, cache: str = "sessions") -> EngineConfig:
        """The engine of every run with this offload setting (each run sets its policy's
        ``cache`` on it; a server is started with it)."""
        cfg = self.cfg
        jobs = self.mixes["long"]
        pages = self.all_pages() + 1  # + the page of the CUDA graphs' pad slot
        length = max_model_len(jobs)
        per_slot = math.ceil(length * token_bytes(cfg) / page_size(cfg))
        sessions = int(max(cfg.loads) if cfg.mode == "closed"
                       else cfg.sessions_sized_for(max(cfg.loads)))
        min_pages = min(pool_pages(jobs, load, cfg.oversubscription, cfg) for load in cfg.loads)
        slots = 4 * sessions + 16 + ballast_slots(pages, min_pages, per_slot)
        extra: dict[str, Any] = {}
        if cfg.cuda_graph_token_sizes is not None:
            extra["cuda_graph_token_sizes"] = cfg.cuda_graph_token_sizes
        ws_bytes = working_set_pages(jobs, sessions, cfg) * page_size(cfg)
        return EngineConfig(
            model=cfg.model, device=cfg.device, dtype=cfg.dtype, num_pages=pages,
            host_page_size=cfg.host_page_size, num_slots=slots, max_model_len=length,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_num_seqs=min(cfg.max_num_seqs, slots),
            speculative_tokens_when_busy=cfg.speculative_tokens_when_busy,
            speculation_fills_padding=cfg.speculation_fills_padding,
            kv_offload_bytes=min(ws_bytes, cfg.offload_cap_bytes) if offload else 0,
            kv_cache_policy=cache, **extra)


def _progress_line(record: RunRecord) -> str:
    ttfts = sorted(r["ttft_s"] for r in record.result.turns if r["resume"])
    p90 = ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else float("nan")
    return (f"{record.condition.label}: {len(record.result.jobs)} jobs, p90 resume TTFT "
            f"{p90 * 1e3:.0f} ms, makespan {record.result.makespan_s:.1f} s")


__all__ = ["BASELINES", "AgentsBenchConfig", "Condition", "Matrix", "RunRecord", "load_trace",
           "pool_pages", "working_set_pages"]
