"""Replay a trace over HTTP at load points of the matrix: ``edmm serve`` (and peers: vLLM, or
any OpenAI-compatible URL) + the ``openai`` SDK.

The same trace as the in-process matrix (`edmm.bench.agents.matrix.load_trace`: the same seed
and scales), the same engine (`Matrix.engine_config` of a matrix of this one load and
oversubscription: its KV pool is the in-process run's, host offload on where the policy uses
it) and the same agent-layer policy (`Policy.agent_config`), both passed to ``edmm serve`` as
flags (`serve_args`). Every policy whose mechanisms live in the server maps; ``rewarm`` does
not (its re-sent history is a client's request, not a server setting).

Each job is a chat conversation: a system message of about the job's ``system_tokens`` (less
the chat template's own tokens with the tool), a user task, then per turn one streamed
``chat.completions`` request with the session's ``X-Session-Id``. A turn that ends in a tool
call is forced to call the bench's tool (random weights would not emit one; its length is the
grammar's, `call_tokens`), the client sleeps the tool's duration (wall clock; with ``streamed``
the first half of the result is posted to ``/v1/edmm/sessions/{id}/tool_output`` half-way
through a streamed call) and sends the result as the ``tool`` message: the trace's
``result_tokens``, padded by the output tokens the trace's turn has beyond the forced call, so
every prompt reaches the trace's context and the pool is as oversubscribed. With
``predicted``, a predictable call's result is sent ahead as ``predicted_tool_results``. The
last turn generates the trace's output length (EOS ignored). Results are appended (the trace's
``mid_prompt`` and ``reasoning_stripped`` are not replayed: the chat template decides).

Fleet traces (`edmm.bench.agents.fleet`) replay as chat too (`edmm.bench.agents.chat`): each
agent type's system prompt and tools, the same in all its sessions; every call turn forced to
the trace's tool; user messages after the user's time; a compaction keeps the system prompt
and sends the summary as a user message before the call's result; a subagent runs in its
parent's thread while the parent's call waits. The reasoning a user message drops in process
is not dropped over HTTP (it is part of the padded result, as any output beyond the call).

``load`` jobs run at once (closed loop), in client processes of a few sessions each
(`edmm.bench.agents.http_client`: one process of 32 threads made the load generator, not the
server, set the pace), after a warm-up as in process (the first two jobs, two at once, with
other text and no tool time).
Measured at the client per turn: the streamed TTFT (first content or tool-call delta) by kind
of turn, prompt and cached tokens and the truly new ones (`chat.Conversation`), a digest of the
output (greedy outputs compared with ``lru``'s); per job the JCT and engine-wait (JCT minus
tool and user time); from ``/metrics`` before and after: lost context tokens, restores,
offloads, preemptions, speculation outcomes, and KV pages by state (sampled;
`edmm.bench.agents.http_metrics`). Recomputed tokens and the prefix hit rate are the
in-process matrix's (`client_columns`). With several loads every engine runs at each, the
lowest first; peers (`edmm.bench.agents.http_peers`) after EDMM's policies at each load.

Every policy's server starts and warms up first, all at once, before anything is measured;
they then run one after the other. ``overlap_tail``: the next run starts once this run has no
job left to start and at most that many running (0: once it ended). A trace's heavy tail
leaves one job alone for minutes of tool time at the end of a run (wall clock, where the
in-process run skips idle time); the next run then overlaps only those jobs (the turns they
send meanwhile are counted, ``overlapped_turns``).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import math
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edmm.bench.agents.chat import agent_tools
from edmm.bench.agents.http_client import (
    CALL_MAX_TOKENS,
    ClientSpec,
    ClientStats,
    HttpBenchError,
    JobResult,
    client_processes,
    new_event,
    prefix_excess,
    replay_clients,
    template_tokens,
)
from edmm.bench.agents.http_metrics import (
    Probe,
    Sampler,
    edmm_counters,
    edmm_states,
    parse_metrics,
)
from edmm.bench.agents.matrix import (
    AgentsBenchConfig,
    Matrix,
    load_trace,
    page_size,
    token_bytes,
)
from edmm.bench.agents.policies import POLICIES, Policy
from edmm.bench.agents.report import prefill_columns, run_meta, state_columns, ttft_columns
from edmm.bench.agents.targets import ALL_TURN_P90, knee_line, peer_checks
from edmm.bench.agents.trace import Job, first_jobs, subagents_of, top_level
from edmm.bench.live import LiveBenchConfig, launched_server, load_tokenizer, resolve_tokenizer
from edmm.bench.peers import VLLMOptions
from edmm.bench.results import Environment, Progress, ResultWriter, collect_environment
from edmm.bench.stages import stage_summary
from edmm.bench.stats import mean, percentile
from edmm.engine import EngineConfig
from edmm.model.tiny import default_model
from edmm.server.stages import read_log

NAME = "agents-http"
TOOL_TIMEOUT_S = 1e6  # the in-process replay's (`ReplayConfig.tool_timeout_s`)
TEMPLATE_TOKENS_PER_TURN = 24  # a fleet turn's chat-template tokens beyond the trace's
SERVER_NAMES = {"edmm": "edmm serve", "vllm": "vLLM", "url": "URL"}  # the rows' ``server``


def http_policies() -> list[str]:
    """Names of `POLICIES` that map onto ``edmm serve`` flags (all but client-side ones)."""
    return [n for n in POLICIES if not POLICIES.create(n).rewarm]


@dataclass(frozen=True)
class HttpReplayConfig:
    """One load point over HTTP (see the module docstring): ``bench`` is the in-process
    matrix's config (trace, scales, model, engine sizes, ``oversubscription``), ``load`` the
    concurrent sessions."""

    bench: AgentsBenchConfig = field(default_factory=AgentsBenchConfig)
    load: int = 2
    policies: tuple[str, ...] = ("lru", "offload", "edmm")
    loads: tuple[int, ...] = ()  # every load point (empty: ``load`` alone)
    peers: tuple[str, ...] = ()  # `edmm.bench.peers.parse_peer` names: vllm, vllm-offload, URL
    vllm: VLLMOptions | None = None  # how vLLM peers start (None: no vLLM peer)
    peer_offload_gib: float | None = None  # None: EDMM's offload memory at the load
    tokenizer: str | None = None  # see `LiveBenchConfig.tokenizer`
    server_args: tuple[str, ...] = ()
    start_timeout_s: float = 300.0
    request_timeout_s: float = 600.0
    overlap_tail: int = 0
    sample_s: float = 0.25  # spacing of the /metrics samples of KV pages in use
    clients: int = 0  # client processes (0: one per `SESSIONS_PER_CLIENT` sessions)
    stages: bool = False  # each server logs its requests' stages (`edmm.server.stages`)
    log_dir: Path | None = None  # every started server's output kept here (None: not kept)

    def __post_init__(self) -> None:
        allowed = http_policies()
        unknown = [p for p in self.policies if p not in allowed]
        if unknown:
            raise HttpBenchError(f"over HTTP only {allowed} run (rewarm re-sends the history "
                                 f"from the client), got {unknown}")
        if not self.policies and not self.peers:
            raise HttpBenchError("no policy and no peer to run")
        if self.bench.call_tokens:
            raise HttpBenchError("call_tokens is the in-process replay's: over HTTP a forced "
                                 "call's grammar sets its length")
        if min(self.all_loads) < 1:
            raise HttpBenchError(f"loads must be >= 1, got {self.all_loads}")
        if self.overlap_tail < 0:
            raise HttpBenchError(f"overlap_tail must be >= 0, got {self.overlap_tail}")
        if self.clients < 0:
            raise HttpBenchError(f"clients must be >= 0, got {self.clients}")

    @property
    def all_loads(self) -> tuple[int, ...]:
        """The load points, ascending."""
        return tuple(sorted(set(self.loads))) if self.loads else (self.load,)

    def matrix_config(self) -> AgentsBenchConfig:
        """The in-process matrix of this one load point (its pool is this run's)."""
        return dataclasses.replace(self.bench, loads=(float(self.load),), policies=self.policies,
                                   check_oversubscription=None, short_mix=False, mode="closed",
                                   checks=False)


# ---------------------------------------------------------------- server flags


def serve_args(policy: Policy, engine: EngineConfig, prefetch_lead_s: float,
               tool_timeout_s: float = TOOL_TIMEOUT_S) -> list[str]:
    """``edmm serve`` flags that build ``engine`` and the agent layer of ``policy`` (what the
    in-process matrix builds for it; `edmm.server.cli.config_from_args` reads them back)."""
    agent = policy.agent_config(tool_timeout_s, prefetch_lead_s)
    args = ["--retention", agent.retention,
            "--speculation", ",".join(agent.speculation) or "none",
            "--admission", agent.admission, "--prefetch-lead-s", repr(agent.prefetch_lead_s),
            "--tool-timeout-s", repr(agent.tool_timeout_s)]
    quota = agent.quota  # the in-process run's (no bound: one client)
    args += ["--max-sessions-per-key", str(quota.max_sessions or 0),
             "--max-awaiting-per-key", str(quota.max_awaiting or 0),
             "--max-kv-pages-per-key", str(quota.max_kv_pages or 0)]
    if not agent.prefetch:
        args.append("--no-prefetch")
    args.append("--speculation-gate" if agent.speculation_gate is not None
                else "--no-speculation-gate")
    if agent.speculation_gate is not None and not agent.speculation_gate.pool_sessions:
        args.append("--no-pooled-gate")
    if not agent.speculate_in_place:
        args.append("--no-speculate-in-place")
    if not agent.learn_tool_durations:
        args.append("--no-learned-durations")
    assert engine.num_pages is not None and engine.max_model_len is not None
    args += ["--num-pages", str(engine.num_pages), "--num-slots", str(engine.num_slots),
             "--max-model-len", str(engine.max_model_len),
             "--max-num-batched-tokens", str(engine.max_num_batched_tokens),
             "--max-num-seqs", str(engine.max_num_seqs),
             "--cuda-graph-sizes", ",".join(str(n) for n in engine.cuda_graph_token_sizes),
             "--host-page-size", str(engine.host_page_size)]
    if engine.dtype is not None:
        args += ["--dtype", str(engine.dtype).removeprefix("torch.")]
    args += ["--kv-offload-gib", repr(engine.kv_offload_bytes / 2**30)]  # 0: off
    args += ["--kv-cache-policy", engine.kv_cache_policy]
    if engine.speculative_tokens_when_busy is not None:
        args += ["--busy-spec-tokens", str(engine.speculative_tokens_when_busy)]
    if not engine.speculation_fills_padding:
        args.append("--no-spec-in-padding")
    return args


# ---------------------------------------------------------------- one run


@dataclass
class HttpRun:
    """One policy's replay: its rows, its client side and the tail signal of `overlap_tail`."""

    policy: Policy
    cfg: HttpReplayConfig
    engine: str = "edmm"  # what the server is (`http_client.ENGINES`)
    label: str = ""  # the rows' name of a peer (default: the policy's)
    call_tokens: int = 0  # tokens of the forced tool call (measured in the warm-up)
    turns: list[dict[str, Any]] = field(default_factory=list)
    jobs: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    clients: ClientStats | None = None  # the measured run's
    stage_records: list[dict[str, Any]] = field(default_factory=list)  # the measured run's
    samples: list[dict[str, float]] = field(default_factory=list)  # /metrics over the run
    tail: threading.Event = field(default_factory=threading.Event)
    overlapped: Any = field(default_factory=new_event)  # the next run started (processes read it)

    def replay(self, url: str, tokenizer: str | None, jobs: Sequence[Job], tag: str = "run",
               load: int | None = None, on_ready: Callable[[], None] = lambda: None) -> None:
        """Every top-level job of ``jobs``, ``load`` (default: the config's) at a time, in
        client processes (a subagent with its parent); ``on_ready`` runs once they are up,
        before the first job. The measured run (``tag`` "run") records its rows and its
        client side and, with `overlap_tail`, sets ``tail`` once at most that many jobs run
        and none is left to start."""
        load = load or self.cfg.load
        record, overlap = tag == "run", self.cfg.overlap_tail
        spec = ClientSpec(url, tokenizer, self.policy.name, self.cfg.request_timeout_s, tag,
                          self.call_tokens, self.engine, self.label, subagents_of(jobs),
                          agent_tools(jobs))
        jobs = top_level(jobs)
        progress = Progress(f"http {spec.name} {tag}", len(jobs))
        count = {"started": 0, "running": 0}

        def check_tail() -> None:
            if (record and overlap and count["started"] == len(jobs)
                    and count["running"] <= overlap):
                self.tail.set()

        def on_start(job_id: str) -> None:
            count["started"] += 1
            count["running"] += 1
            check_tail()

        def on_done(result: JobResult) -> None:
            count["running"] -= 1
            self.call_tokens = self.call_tokens or result.call_tokens
            if record:
                self.jobs += [result.job, *result.subagent_jobs]
                self.turns.extend(result.turns)
            progress.step(f"job {result.job['job']}")
            check_tail()

        stats = replay_clients(spec, jobs, load, client_processes(load, self.cfg.clients),
                               self.overlapped, on_start, on_done, on_ready)
        if record:
            self.clients = stats


def untimed(jobs: Sequence[Job]) -> list[Job]:
    """The warm-up: the first two top-level jobs of ``jobs`` (with their subagents), with no
    tool or user time (it compiles and captures, nothing else)."""
    return [dataclasses.replace(j, turns=tuple(dataclasses.replace(t, tool_s=0.0, user_s=0.0)
                                               for t in j.turns)) for j in first_jobs(jobs, 2)]


# ---------------------------------------------------------------- the bench


def live_config(cfg: HttpReplayConfig) -> LiveBenchConfig:
    b = cfg.bench
    live = LiveBenchConfig(model=b.model, tokenizer=cfg.tokenizer, device=b.device,
                           server_args=cfg.server_args,
                           start_timeout_s=cfg.start_timeout_s,
                           request_timeout_s=cfg.request_timeout_s)
    return resolve_tokenizer(live)


def chat_tokenizer(live: LiveBenchConfig) -> Any:
    """The server's chat tokenizer (the embedded tool model's without a model)."""
    folder = live.tokenizer or live.model
    return load_tokenizer(folder if folder is not None else str(default_model()))


def replay_http(cfg: HttpReplayConfig,
                on_run: Callable[[list[HttpRun]], object] = lambda runs: None) -> list[HttpRun]:
    """Every policy's replay, in order. All servers start and warm up first, at once (nothing
    is measured meanwhile); then each run starts when the previous one ended (or reached its
    tail, with `overlap_tail`); ``on_run`` gets the finished runs after each."""
    import httpx  # noqa: F401  (imported once here: lazy imports are not thread-safe)

    matrix = Matrix(cfg.matrix_config())
    jobs = matrix.mixes["long"]
    live = live_config(cfg)
    tok = chat_tokenizer(live)
    runs = [HttpRun(POLICIES.create(name), cfg) for name in cfg.policies]
    errors: list[BaseException] = []
    lock = threading.Lock()
    ready = threading.Barrier(len(runs))

    def one(i: int) -> None:
        try:
            _run_policy(runs[i], matrix, jobs, cfg, live, tok,
                        lambda: _wait_turn(runs, i, ready))
            with lock:
                on_run([r for r in runs if r.summary])
        except BaseException as e:  # reported after the join
            errors.append(e)
            ready.abort()  # the others stop waiting for this server
        finally:
            runs[i].tail.set()

    threads = [threading.Thread(target=one, args=(i,), name=f"policy-{i}")
               for i in range(len(runs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)),
                   errors[0])
    return runs


def _wait_turn(runs: Sequence[HttpRun], i: int, ready: threading.Barrier) -> None:
    """Block until every server is warm, then until run ``i - 1`` ended or reached its tail."""
    ready.wait()
    if i > 0:
        runs[i - 1].tail.wait()
        runs[i - 1].overlapped.set()


def _run_policy(run: HttpRun, matrix: Matrix, jobs: list[Job], cfg: HttpReplayConfig,
                live: LiveBenchConfig, tok: Any, wait_turn: Callable[[], None]) -> None:
    folder = live.tokenizer or live.model  # the client processes load the same tokenizer
    engine = matrix.engine_config(run.policy.offload, run.policy.cache)
    args = serve_args(run.policy, server_engine(engine, matrix.cfg, jobs, tok),
                      matrix.cfg.prefetch_lead_s)
    live = dataclasses.replace(live, server_args=(*args, *live.server_args),
                               name=f"edmm-{run.policy.name}-{cfg.load}")
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        log = None
        if cfg.stages:
            log = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "stages.jsonl"
        url = stack.enter_context(launched_server(live, log, cfg.log_dir))
        start_s = time.perf_counter() - t0
        probe = Probe(url, cfg.request_timeout_s)
        stack.callback(probe.close)
        if matrix.cfg.warmup:  # as in process: the first two jobs, two at once
            run.replay(url, folder, untimed(jobs), "warm", load=2)
        wait_turn()
        before = probe.metrics()
        page_bytes = page_size(matrix.cfg)
        sampler = Sampler(probe, cfg.sample_s,
                          lambda text: edmm_states(parse_metrics(text), page_bytes))
        measured_ns = time.time_ns()
        try:
            run.replay(url, folder, jobs, on_ready=sampler.restart)
        finally:
            run.samples = sampler.stop()
        after = probe.metrics()
        if log is not None and log.exists():  # the measured run's requests, not the warm-up's
            run.stage_records = [r for r in read_log(str(log)).values()
                                 if r["marks"].get("arrive", 0) >= measured_ns]
    assert run.clients is not None
    pool = server_engine(engine, matrix.cfg, jobs, tok).num_pages
    assert pool is not None
    run.summary = {**summarize_http(run, matrix.cfg, pool - 1, run.clients.makespan_s,
                                    start_s), **edmm_counters(before, after)}
    run.summary["prefilled_tokens"] += run.summary["spec_tokens"]
    if run.summary.get("new_tokens"):
        run.summary["prefill_amp"] = run.summary["prefilled_tokens"] / run.summary["new_tokens"]


def new_token_rows(turns: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``turns`` with the first session of each agent type charged its shared prefix as new
    (a client counts a shared prefix as cached; the first session to start had nothing to
    share it with)."""
    first: dict[str, Mapping[str, Any]] = {}
    for t in turns:
        if t["turn"] == 0 and t.get("agent") and t.get("started_s") is not None:
            seen = first.get(t["agent"])
            if seen is None or t["started_s"] < seen["started_s"]:
                first[t["agent"]] = t
    firsts = {id(t) for t in first.values()}
    return [dict(t, new_tokens=t["new_tokens"] + t.get("shared_tokens", 0))
            if id(t) in firsts else dict(t) for t in turns]


def client_columns(turns: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Summary columns of one run's turn rows, defined as the in-process matrix defines them:
    resume TTFT percentiles (every resume; and those that stream content, whose first delta is
    the first token, where a forced call's comes once its name is decoded), recomputed tokens
    (prompt less cached tokens of resumes) and the prefix hit rate (cached / prompt of
    resumes)."""
    res = [t for t in turns if t["resume"]]
    ttft = [t["ttft_s"] * 1e3 for t in res]
    content = [t["ttft_s"] * 1e3 for t in res if not t["ends_in_call"]]
    cached = sum(t["cached_tokens"] for t in res)
    prompt = sum(t["prompt_tokens"] for t in res)
    return {"resume_ttft_p50_ms": _pct(ttft, 50), "resume_ttft_p90_ms": _pct(ttft, 90),
            "resume_ttft_p99_ms": _pct(ttft, 99),
            "content_resume_ttft_p50_ms": _pct(content, 50),
            "content_resume_ttft_p90_ms": _pct(content, 90),
            "recomputed_tokens": prompt - cached,
            "prefix_hit_rate": cached / prompt if prompt else None}


def _pct(xs: list[float], q: float) -> float | None:
    return percentile(xs, q) if xs else None


def server_engine(engine: EngineConfig, cfg: AgentsBenchConfig, jobs: Sequence[Job],
                  tokenizer: Any) -> EngineConfig:
    """``engine`` with room for a chat prompt of ``tokenizer``: the template's tokens where
    they exceed a job's system prompt (tiny traces), the agent types' rendered prefixes where
    they exceed the trace's (`prefix_excess`), a forced call's token limit; the pool then
    holds at least one such sequence (as `pool_pages` keeps one longest sequence)."""
    assert engine.max_model_len is not None and engine.num_pages is not None
    template = template_tokens(tokenizer)
    extra = max(0, template - min(j.system_tokens for j in jobs)) + CALL_MAX_TOKENS
    if any(j.agent for j in jobs):  # chat messages' own tokens, turn after turn
        extra += TEMPLATE_TOKENS_PER_TURN * max(len(j.turns) for j in jobs)
        extra += max(0, prefix_excess(tokenizer, jobs))
    longest = -(-(engine.max_model_len + extra) // 64) * 64
    per_seq = math.ceil(longest * token_bytes(cfg) / page_size(cfg))
    return dataclasses.replace(engine, max_model_len=longest,
                               num_pages=max(engine.num_pages, per_seq + 2))


def summarize_http(run: HttpRun, cfg: AgentsBenchConfig, pool: int, makespan: float,
                   start_s: float) -> dict[str, Any]:
    """The summary row of one run as the client saw it (``pool``: the KV pages the engine
    was given): JCT and engine-wait of top-level jobs, TTFT by kind, prefill (without the
    server's speculative prefill), pages by state from the samples."""
    top = [j for j in run.jobs if not j.get("subagent")]
    jct = [j["jct_s"] for j in top]
    wait = [j["engine_wait_s"] for j in top]
    # The working set as the server saw it: each job's largest context (last prompt + output).
    last: dict[str, int] = {}
    for t in run.turns:
        last[t["job"]] = max(last.get(t["job"], 0), t["prompt_tokens"] + t["completion_tokens"])
    ws_pages = run.cfg.load * mean(last.values()) * token_bytes(cfg) / page_size(cfg)
    minutes = makespan / 60
    turns = [{**t, "turn_kind": t["turn_kind"]} for t in new_token_rows(run.turns)]
    usage = [s["kv_usage"] for s in run.samples if "kv_usage" in s]
    return {
        "policy": run.label or run.policy.name, "server": SERVER_NAMES[run.engine],
        "tools": "long",
        "oversub": cfg.oversubscription, "oversub_reached": round(ws_pages / pool, 2),
        "load": float(run.cfg.load), "jobs": len(top), "pages": pool,
        "jct_mean_s": mean(jct), "jct_p50_s": percentile(jct, 50),
        "jct_p90_s": percentile(jct, 90), "wait_mean_s": mean(wait),
        "wait_p50_s": percentile(wait, 50), "wait_p90_s": percentile(wait, 90),
        **client_columns(run.turns), **ttft_columns(turns),
        **prefill_columns(turns, 0),
        "jobs_per_min": len(top) / minutes if minutes > 0 else None,
        "out_tok_per_s": sum(j["output_tokens"] for j in run.jobs) / makespan
        if makespan > 0 else None,
        "pages_used_mean": _mean_of(run.samples, "pages_used"),
        "pages_used_max": max((s["pages_used"] for s in run.samples if "pages_used" in s),
                              default=None),
        **state_columns(run.samples),
        "kv_usage_mean": mean(usage) if usage else None,
        "kv_usage_max": max(usage) if usage else None,
        "host_device_MiB": None,  # no server reports bytes moved on /metrics
        "makespan_s": makespan, "server_start_s": start_s,
        "overlapped_turns": sum(1 for t in run.turns if t["overlapped"]),
        "call_tokens": run.call_tokens,
        "client_procs": run.clients.processes if run.clients else None,
        "client_cpu_max": run.clients.cpu_max if run.clients else None,
    }


def _mean_of(samples: Sequence[Mapping[str, float]], key: str) -> float | None:
    xs = [s[key] for s in samples if key in s]
    return mean(xs) if xs else None


def _identity(runs: Sequence[HttpRun]) -> None:
    """``outputs_as_lru``: every turn's output digest equal to ``lru``'s of the same turn at
    the same load (EDMM's servers only: a peer's random weights are its own)."""
    for r in runs:
        ref = next((x for x in runs if x.policy.name == "lru" and x.engine == "edmm"
                    and x.cfg.load == r.cfg.load and not x.label), None)
        if ref is None or r.engine != "edmm" or not r.summary:
            continue
        want = {(t["job"], t["turn"]): t["output"] for t in ref.turns}
        got = {(t["job"], t["turn"]): t["output"] for t in r.turns}
        r.summary["outputs_as_lru"] = got == want


def in_process_rows(out_dir: Path, cfg: HttpReplayConfig) -> list[dict[str, Any]]:
    """The in-process summary rows of the same load point (``agents.json`` in ``out_dir``,
    same trace), one per policy run over HTTP; none if there is no such file."""
    path = out_dir / "agents.json"
    if not path.is_file():
        return []
    doc = json.loads(path.read_text())
    b = cfg.bench
    meta = doc.get("meta") or {}
    if (meta.get("seed"), meta.get("jobs"), meta.get("token_scale"), meta.get("time_scale")) != (
            b.seed, b.jobs, b.token_scale, b.time_scale):
        return []
    loads = {float(x) for x in cfg.all_loads}
    return [r for r in doc["summary"] if r.get("tools") == "long"
            and float(r.get("load", -1)) in loads
            and r.get("oversub") == b.oversubscription and r.get("policy") in cfg.policies]


COMPARED = ("ttft_p90_ms", "resume_ttft_p50_ms", "resume_ttft_p90_ms", "wait_mean_s",
            "jct_mean_s", "recomputed_tokens", "prefix_hit_rate", "prefill_amp")


def comparison_lines(http_rows: Sequence[Mapping[str, Any]],
                     inproc: Sequence[Mapping[str, Any]]) -> list[str]:
    """A Markdown table: each metric over HTTP beside in process, per policy and load."""
    by_key = {(r["policy"], float(r["load"])): r for r in inproc}
    rows = [r for r in http_rows if (r["policy"], float(r["load"])) in by_key]
    if not rows:
        return []
    head = "| policy | load | " + " | ".join(f"{m} (HTTP / in process)" for m in COMPARED) + \
        " |"
    lines = ["", "## Beside the in-process run of the same load points (`agents.json`)", "",
             head, "|" + "---|" * (len(COMPARED) + 2)]
    for r in rows:
        ref = by_key[(r["policy"], float(r["load"]))]
        cells = [f"{_fmt(r.get(m))} / {_fmt(ref.get(m))}" for m in COMPARED]
        lines.append(f"| {r['policy']} | {float(r['load']):g} | " + " | ".join(cells) + " |")
    return lines


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
    return "" if x is None else str(x)


def run_http_bench(cfg: HttpReplayConfig, out_dir: Path) -> dict[str, Path]:
    """Replay over HTTP at every load (lowest first): EDMM's policies, then each peer; write
    ``agents-http.{csv,json,md}`` and the timeline after each run (with the in-process rows
    of the same load points beside, when ``out_dir`` holds them)."""
    from edmm.bench.agents.http_peers import replay_peer

    env = collect_environment(cfg.bench.device)
    paths: dict[str, Path] = {}
    done: list[HttpRun] = []

    def write(runs: Sequence[HttpRun]) -> None:
        paths.update(write_http_results([*done, *runs], cfg, env, out_dir))

    cfg = dataclasses.replace(cfg, log_dir=cfg.log_dir or out_dir / "logs")
    for load in cfg.all_loads:
        at = dataclasses.replace(cfg, load=load)
        if cfg.policies:
            done += replay_http(at, on_run=write)
        for peer in cfg.peers:
            done.append(replay_peer(at, peer, cfg.log_dir))
            write([])
    write([])
    return paths


def write_http_results(runs: Sequence[HttpRun], cfg: HttpReplayConfig, env: Environment,
                       out_dir: Path) -> dict[str, Path]:
    """The three files of the finished ``runs``."""
    _identity(runs)
    b = cfg.bench
    writer = ResultWriter(out_dir, NAME, env)
    for r in runs:  # each row with its condition, as in process (the merge's plots select by it)
        condition = {"tools": "long", "oversub": b.oversubscription, "load": float(r.cfg.load)}
        writer.add_rows([{**row, **condition} for row in (*r.jobs, *r.turns)])
    summary = [r.summary for r in runs if r.summary]
    loads = ", ".join(f"{x:g}" for x in cfg.all_loads)
    notes = [
        knee_line(summary, b.oversubscription, ALL_TURN_P90),
        knee_line(summary, b.oversubscription),
        *(c.line() for c in peer_checks(summary, b.oversubscription)),
        f"edmm serve (and peers: {', '.join(cfg.peers) or 'none'}) + the openai SDK, closed "
        f"loop of {loads} sessions, wall clock; trace: "
        f"{b.trace or f'generated, {b.jobs} jobs, seed {b.seed}'}; tokens x{b.token_scale:g}, "
        f"tool times x{b.time_scale:g}; KV pool and agent policy as the in-process matrix "
        f"at x{b.oversubscription:g} (edmm serve flags from `serve_args`)",
        "resume TTFT: streamed, request sent to the first content or tool-call delta (a forced"
        " call's first delta comes once its name and the start of its arguments are known: "
        "decoded one step a token, or on edmm serve, where its grammar forces them, computed "
        "with the prompt); content_resume_ttft: the resumes that stream content (first delta ="
        " first token); engine-wait = JCT minus tool time; recomputed_tokens = prompt less "
        "cached tokens of resumes, prefix_hit_rate = cached / prompt tokens of resumes (usage,"
        " as in process); lost_context_tokens: /metrics edmm_recomputed_tokens (a session's "
        "earlier context computed again)",
        "tool-call turns are forced (call_tokens: the grammar's length); their results are "
        "padded by the trace's output tokens beyond it so contexts reach the trace's; the last "
        "turn generates the trace's output length; results appended (mid_prompt and "
        "reasoning_stripped not replayed)",
        "lost_context_tokens, restores, offloads, preemptions, spec_*, engine_steps, "
        "memory_wait_steps (steps whose admissions stopped for lack of KV memory): the change "
        "of the server's /metrics over the run; pages_used: /metrics samples; oversub_reached: the "
        "measured working set / pool; "
        "outputs_as_lru: every turn's greedy output (content and calls) equal to lru's",
        f"overlap_tail {cfg.overlap_tail}: " + (
            "each policy's run starts after the previous one ended" if not cfg.overlap_tail
            else f"the next policy's run starts once {cfg.overlap_tail} job(s) of this run "
                 "are left; overlapped_turns: this run's turns sent while it ran"),
        "every server started and warmed up (the first two jobs, other text, no tool time) "
        "before the first run; server_start_s: its start, in parallel with the others",
        "client_procs: the client processes the sessions ran in (the openai SDK, one thread "
        "a session); client_cpu_max: the busiest one's CPU time over its wall time (near 1.0 "
        "its threads, which share one GIL, waited on the client, not the server); makespan_s "
        "from every client ready to the last job's end",
        "ttft_* every turn, first_ttft_* first turns (subagents' too), tool_ttft_* after a "
        "tool result, user_ttft_* after a user message; new_tokens: each prompt less the "
        "context before it (the server's prompt and completion tokens of the turn before; "
        "after a compaction the messages kept), the shared prefix of an agent type counted "
        "once; prefill_amp = (prompt less cached tokens, plus EDMM's speculative prefill) / "
        "new_tokens; pages by state from EDMM's /metrics (kv pages in use, cached pages, host "
        "bytes); vLLM's kv_usage (blocks held by requests; its cached free blocks, paused "
        "sessions' KV, are not reported) and prefix-cache counters; host_device_MiB empty: "
        "no server reports bytes moved on /metrics",
    ]
    paths = writer.write(summary, "Agent workloads over HTTP", notes,
                         meta={**run_meta(cfg.matrix_config(), load_trace(b)["long"]),
                               "clock": "wall", "mode": "closed", "http": True,
                               "load": cfg.load, "loads": list(cfg.all_loads),
                               "peers": list(cfg.peers), "check_oversub": None})
    paths["timeline"] = _write_timeline(runs, out_dir / f"{NAME}-timeline.csv")
    extra = comparison_lines(summary, in_process_rows(out_dir, cfg))
    if extra:
        with paths["md"].open("a", encoding="utf-8") as f:
            f.write("\n".join(extra) + "\n")
    if any(r.stage_records for r in runs):
        paths.update({f"stages_{k}": v for k, v in _write_stages(runs, env, out_dir).items()})
    return paths


def _write_timeline(runs: Sequence[HttpRun], path: Path) -> Path:
    """Every run's /metrics samples (pages by state; vLLM's KV usage), one row each, with
    the run's condition and KV pool (``pages_total``) as the in-process timeline has them."""
    rows = [{"policy": r.label or r.policy.name, "load": r.cfg.load, "tools": "long",
             "oversub": r.cfg.bench.oversubscription, "pages_total": r.summary.get("pages", ""),
             **s} for r in runs for s in r.samples]
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=keys or ["policy", "load", "t_s"])
        w.writeheader()
        w.writerows(rows)
    return path


def _write_stages(runs: Sequence[HttpRun], env: Environment, out_dir: Path) -> dict[str, Path]:
    """``agents-http-stages.{csv,json,md}``: each policy's stage spans (`stage_summary`)."""
    writer = ResultWriter(out_dir, f"{NAME}-stages", env)
    summary: list[dict[str, Any]] = []
    for r in runs:
        writer.add_rows([{"policy": r.policy.name, **rec} for rec in r.stage_records])
        summary += stage_summary(r.stage_records, {"policy": r.policy.name})
    notes = ["every chat request of the measured run (not the warm-up), as the server logged "
             "it (`EDMM_STAGE_LOG`, edmm.server.stages); p50 / p90 / max in milliseconds "
             "from one stage to the next",
             "step_start -> output_put: from the engine's first step after the request was "
             "queued to its first output; (step_start -> scheduled): the part before the "
             "scheduler admitted it (waiting for KV memory, the token budget or a place among "
             "the running sequences), (scheduled -> output_put): the engine's work after it; "
             "memory_wait_steps: the steps a request headed the queue and was not admitted "
             "for lack of KV memory",
             "first_output -> first_event of a forced tool call: the tool parser waits for "
             "the call's name and the start of its arguments"]
    return writer.write(summary, "Agent workloads over HTTP: where each request's time goes",
                        notes)


__all__ = ["HttpBenchError", "HttpReplayConfig", "comparison_lines", "http_policies",
           "in_process_rows", "parse_metrics", "replay_http", "run_http_bench", "serve_args"]
