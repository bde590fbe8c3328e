"""Replay a trace over HTTP at one load point of the matrix: ``edmm serve`` + the ``openai`` SDK.

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

``load`` jobs run at once (closed loop), in client processes of a few sessions each
(`edmm.bench.agents.http_client`: one process of 32 threads made the load generator, not the
server, set the pace), after a warm-up as in process (the first two jobs, two at once, with
other text and no tool time).
Measured at the client per turn: the streamed TTFT (first content or tool-call delta), prompt
and cached tokens, a digest of the output (greedy outputs compared with ``lru``'s); per job the
JCT and engine-wait (JCT minus tool time); from ``/metrics`` before and after: lost context
tokens, restores, offloads, preemptions, speculation outcomes, and KV pages in use (sampled).
Recomputed tokens and the prefix hit rate are the in-process matrix's (`client_columns`).

Every policy's server starts and warms up first, all at once, before anything is measured;
they then run one after the other. ``overlap_tail``: the next run starts once this run has no
job left to start and at most that many running (0: once it ended). A trace's heavy tail
leaves one job alone for minutes of tool time at the end of a run (wall clock, where the
in-process run skips idle time); the next run then overlaps only those jobs (the turns they
send meanwhile are counted, ``overlapped_turns``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edmm.bench.agents.http_client import (
    CALL_MAX_TOKENS,
    ClientSpec,
    ClientStats,
    HttpBenchError,
    JobResult,
    client_processes,
    new_event,
    replay_clients,
    template_tokens,
)
from edmm.bench.agents.matrix import AgentsBenchConfig, Matrix, page_size, token_bytes
from edmm.bench.agents.policies import POLICIES, Policy
from edmm.bench.agents.trace import Job
from edmm.bench.live import LiveBenchConfig, launched_server, load_tokenizer, resolve_tokenizer
from edmm.bench.results import Environment, Progress, ResultWriter, collect_environment
from edmm.bench.stats import mean, percentile
from edmm.engine import EngineConfig
from edmm.model.tiny import default_model
from edmm.server.stages import engine_split_ms, read_log, spans_ms

NAME = "agents-http"
TOOL_TIMEOUT_S = 1e6  # the in-process replay's (`ReplayConfig.tool_timeout_s`)
_METRIC_RE = re.compile(r'^(edmm_\w+?)(?:_total)?(?:\{([^}]*)\})?\s+(\S+)$')
_OUTCOME_RE = re.compile(r'outcome="(\w+)"')
# /metrics counters kept per run (the change over the run) and the summary's names for them.
COUNTERS = {"edmm_recomputed_tokens": "lost_context_tokens", "edmm_kv_restores": "restores",
            "edmm_kv_offloads": "offloads", "edmm_preemptions": "preemptions",
            "edmm_speculated_tokens": "spec_tokens", "edmm_speculation_outcomes:hit": "spec_hit",
            "edmm_speculation_outcomes:partial": "spec_partial",
            "edmm_speculation_outcomes:miss": "spec_miss",
            "edmm_session_resumes": "server_resumes", "edmm_engine_steps": "engine_steps",
            "edmm_admission_memory_waits": "memory_wait_steps"}


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
    tokenizer: str | None = None  # see `LiveBenchConfig.tokenizer`
    server_args: tuple[str, ...] = ()
    start_timeout_s: float = 300.0
    request_timeout_s: float = 600.0
    overlap_tail: int = 0
    sample_s: float = 0.25  # spacing of the /metrics samples of KV pages in use
    clients: int = 0  # client processes (0: one per `SESSIONS_PER_CLIENT` sessions)
    stages: bool = False  # each server logs its requests' stages (`edmm.server.stages`)

    def __post_init__(self) -> None:
        allowed = http_policies()
        unknown = [p for p in self.policies if p not in allowed]
        if unknown:
            raise HttpBenchError(f"over HTTP only {allowed} run (rewarm re-sends the history "
                                 f"from the client), got {unknown}")
        if not self.policies:
            raise HttpBenchError("no policy to run")
        if self.load < 1:
            raise HttpBenchError(f"load must be >= 1, got {self.load}")
        if self.overlap_tail < 0:
            raise HttpBenchError(f"overlap_tail must be >= 0, got {self.overlap_tail}")
        if self.clients < 0:
            raise HttpBenchError(f"clients must be >= 0, got {self.clients}")

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
    if not agent.prefetch:
        args.append("--no-prefetch")
    if agent.speculation_gate is not None:
        args.append("--speculation-gate")
    assert engine.num_pages is not None and engine.max_model_len is not None
    args += ["--num-pages", str(engine.num_pages), "--num-slots", str(engine.num_slots),
             "--max-model-len", str(engine.max_model_len),
             "--max-num-batched-tokens", str(engine.max_num_batched_tokens),
             "--max-num-seqs", str(engine.max_num_seqs),
             "--cuda-graph-sizes", ",".join(str(n) for n in engine.cuda_graph_token_sizes),
             "--host-page-size", str(engine.host_page_size)]
    if engine.dtype is not None:
        args += ["--dtype", str(engine.dtype)]
    if engine.kv_offload_bytes:
        args += ["--kv-offload-gib", repr(engine.kv_offload_bytes / 2**30)]
    args += ["--kv-cache-policy", engine.kv_cache_policy]
    if engine.speculative_tokens_when_busy is not None:
        args += ["--busy-spec-tokens", str(engine.speculative_tokens_when_busy)]
    if not engine.speculation_fills_padding:
        args.append("--no-spec-in-padding")
    return args


# ---------------------------------------------------------------- metrics


def parse_metrics(text: str) -> dict[str, float]:
    """``edmm_*`` samples of a Prometheus text page: ``name`` (``_total`` dropped), with
    ``:outcome`` for the speculation outcomes."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC_RE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        outcome = _OUTCOME_RE.search(labels)
        out[f"{name}:{outcome.group(1)}" if outcome else name] = float(value)
    return out


class _Pages:
    """Samples ``edmm_kv_pages_in_use`` every ``every_s`` until stopped."""

    def __init__(self, client: _Probe, every_s: float) -> None:
        self.samples: list[float] = []
        self._client, self._every = client, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pages", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            try:
                self.samples.append(self._client.metrics()["edmm_kv_pages_in_use"])
            except Exception:  # a sample lost to a busy server: the next one counts
                continue

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join()
        return self.samples


# ---------------------------------------------------------------- the server's metrics


class _Probe:
    """The server's ``/metrics`` (httpx), from the bench's own process."""

    def __init__(self, url: str, timeout: float) -> None:
        import httpx

        self.url = url
        self.http = httpx.Client(timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def metrics(self) -> dict[str, float]:
        """The server's ``/metrics``, parsed."""
        return parse_metrics(self.http.get(f"{self.url}/metrics").text)


# ---------------------------------------------------------------- one run


@dataclass
class _Run:
    """One policy's replay: its rows, its client side and the tail signal of `overlap_tail`."""

    policy: Policy
    cfg: HttpReplayConfig
    call_tokens: int = 0  # tokens of the forced tool call (measured in the warm-up)
    turns: list[dict[str, Any]] = field(default_factory=list)
    jobs: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    clients: ClientStats | None = None  # the measured run's
    stage_records: list[dict[str, Any]] = field(default_factory=list)  # the measured run's
    tail: threading.Event = field(default_factory=threading.Event)
    overlapped: Any = field(default_factory=new_event)  # the next run started (processes read it)

    def replay(self, url: str, tokenizer: str | None, jobs: Sequence[Job], tag: str = "run",
               load: int | None = None) -> None:
        """Every job, ``load`` (default: the config's) at a time, in client processes. The
        measured run (``tag`` "run") records its rows and its client side and, with
        `overlap_tail`, sets ``tail`` once at most that many jobs run and none is left to
        start."""
        load = load or self.cfg.load
        record, overlap = tag == "run", self.cfg.overlap_tail
        spec = ClientSpec(url, tokenizer, self.policy.name, self.cfg.request_timeout_s, tag,
                          self.call_tokens)
        progress = Progress(f"http {self.policy.name} {tag}", len(jobs))
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
                self.jobs.append(result.job)
                self.turns.extend(result.turns)
            progress.step(f"job {result.job['job']}")
            check_tail()

        stats = replay_clients(spec, jobs, load, client_processes(load, self.cfg.clients),
                               self.overlapped, on_start, on_done)
        if record:
            self.clients = stats


def _untimed(jobs: Sequence[Job]) -> list[Job]:
    """The warm-up: ``jobs`` with no tool time (it compiles and captures, nothing else)."""
    return [dataclasses.replace(j, turns=tuple(dataclasses.replace(t, tool_s=0.0)
                                               for t in j.turns)) for j in jobs]


# ---------------------------------------------------------------- the bench


def _live_config(cfg: HttpReplayConfig) -> LiveBenchConfig:
    b = cfg.bench
    live = LiveBenchConfig(model=b.model, tokenizer=cfg.tokenizer, device=b.device,
                           server_args=cfg.server_args,
                           start_timeout_s=cfg.start_timeout_s,
                           request_timeout_s=cfg.request_timeout_s)
    return resolve_tokenizer(live)


def _tokenizer(live: LiveBenchConfig) -> Any:
    """The server's chat tokenizer (the embedded tool model's without a model)."""
    folder = live.tokenizer or live.model
    return load_tokenizer(folder if folder is not None else str(default_model()))


def replay_http(cfg: HttpReplayConfig,
                on_run: Callable[[list[_Run]], object] = lambda runs: None) -> list[_Run]:
    """Every policy's replay, in order. All servers start and warm up first, at once (nothing
    is measured meanwhile); then each run starts when the previous one ended (or reached its
    tail, with `overlap_tail`); ``on_run`` gets the finished runs after each."""
    import httpx  # noqa: F401  (imported once here: lazy imports are not thread-safe)

    matrix = Matrix(cfg.matrix_config())
    jobs = matrix.mixes["long"]
    live = _live_config(cfg)
    tok = _tokenizer(live)
    runs = [_Run(POLICIES.create(name), cfg) for name in cfg.policies]
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


def _wait_turn(runs: Sequence[_Run], i: int, ready: threading.Barrier) -> None:
    """Block until every server is warm, then until run ``i - 1`` ended or reached its tail."""
    ready.wait()
    if i > 0:
        runs[i - 1].tail.wait()
        runs[i - 1].overlapped.set()


def _run_policy(run: _Run, matrix: Matrix, jobs: list[Job], cfg: HttpReplayConfig,
                live: LiveBenchConfig, tok: Any, wait_turn: Callable[[], None]) -> None:
    folder = live.tokenizer or live.model  # the client processes load the same tokenizer
    engine = matrix.engine_config(run.policy.offload, run.policy.cache)
    args = serve_args(run.policy, server_engine(engine, matrix.cfg, jobs, template_tokens(tok)),
                      matrix.cfg.prefetch_lead_s)
    live = dataclasses.replace(live, server_args=(*args, *live.server_args))
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        log = None
        if cfg.stages:
            log = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "stages.jsonl"
        url = stack.enter_context(launched_server(live, log))
        start_s = time.perf_counter() - t0
        probe = _Probe(url, cfg.request_timeout_s)
        stack.callback(probe.close)
        if matrix.cfg.warmup:  # as in process: the first two jobs, two at once
            run.replay(url, folder, _untimed(jobs[:2]), "warm", load=2)
        wait_turn()
        before = probe.metrics()
        pages = _Pages(probe, cfg.sample_s)
        measured_ns = time.time_ns()
        try:
            run.replay(url, folder, jobs)
        finally:
            samples = pages.stop()
        after = probe.metrics()
        if log is not None and log.exists():  # the measured run's requests, not the warm-up's
            run.stage_records = [r for r in read_log(str(log)).values()
                                 if r["marks"].get("arrive", 0) >= measured_ns]
    assert run.clients is not None
    run.summary = _summary(run, matrix, jobs, engine, before, after, samples,
                           run.clients.makespan_s, start_s)


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
                  template: int) -> EngineConfig:
    """``engine`` with room for a chat prompt: the template's ``template`` tokens where they
    exceed a job's system prompt (tiny traces), a forced call's token limit; the pool then
    holds at least one such sequence (as `pool_pages` keeps one longest sequence)."""
    assert engine.max_model_len is not None and engine.num_pages is not None
    extra = max(0, template - min(j.system_tokens for j in jobs)) + CALL_MAX_TOKENS
    longest = -(-(engine.max_model_len + extra) // 64) * 64
    per_seq = math.ceil(longest * token_bytes(cfg) / page_size(cfg))
    return dataclasses.replace(engine, max_model_len=longest,
                               num_pages=max(engine.num_pages, per_seq + 2))


def _summary(run: _Run, matrix: Matrix, jobs: list[Job], engine: EngineConfig,
             before: Mapping[str, float], after: Mapping[str, float], pages: list[float],
             makespan: float, start_s: float) -> dict[str, Any]:
    cfg = matrix.cfg
    jct = [j["jct_s"] for j in run.jobs]
    wait = [j["engine_wait_s"] for j in run.jobs]
    delta = {v: after.get(k, 0.0) - before.get(k, 0.0) for k, v in COUNTERS.items()}
    # The working set as the server saw it: each job's largest context (last prompt + output).
    last: dict[int, int] = {}
    for t in run.turns:
        last[t["job"]] = max(last.get(t["job"], 0), t["prompt_tokens"] + t["completion_tokens"])
    ws_pages = run.cfg.load * mean(last.values()) * token_bytes(cfg) / page_size(cfg)
    assert engine.num_pages is not None
    pool = engine.num_pages - 1  # the in-process run's pool (one page: the graphs' pad)
    minutes = makespan / 60
    return {
        "policy": run.policy.name, "tools": "long", "oversub": cfg.oversubscription,
        "oversub_reached": round(ws_pages / pool, 2), "load": float(run.cfg.load),
        "jobs": len(run.jobs), "pages": pool,
        "jct_mean_s": mean(jct), "jct_p50_s": percentile(jct, 50),
        "jct_p90_s": percentile(jct, 90), "wait_mean_s": mean(wait),
        "wait_p50_s": percentile(wait, 50), "wait_p90_s": percentile(wait, 90),
        **client_columns(run.turns),
        "jobs_per_min": len(run.jobs) / minutes if minutes > 0 else None,
        "out_tok_per_s": sum(j["output_tokens"] for j in run.jobs) / makespan
        if makespan > 0 else None,
        **{k: int(v) for k, v in delta.items()},
        "pages_used_mean": mean(pages) if pages else None,
        "pages_used_max": max(pages) if pages else None,
        "makespan_s": makespan, "server_start_s": start_s,
        "overlapped_turns": sum(1 for t in run.turns if t["overlapped"]),
        "call_tokens": run.call_tokens,
        "client_procs": run.clients.processes if run.clients else None,
        "client_cpu_max": run.clients.cpu_max if run.clients else None,
    }


def _identity(runs: Sequence[_Run]) -> None:
    """``outputs_as_lru``: every turn's output digest equal to ``lru``'s of the same turn."""
    ref = next((r for r in runs if r.policy.name == "lru"), None)
    if ref is None:
        return
    want = {(t["job"], t["turn"]): t["output"] for t in ref.turns}
    for r in runs:
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
    return [r for r in doc["summary"] if r.get("tools") == "long" and r.get("load") == cfg.load
            and r.get("oversub") == b.oversubscription and r.get("policy") in cfg.policies]


COMPARED = ("resume_ttft_p50_ms", "resume_ttft_p90_ms", "wait_mean_s", "jct_mean_s",
            "recomputed_tokens", "prefix_hit_rate")


def comparison_lines(http_rows: Sequence[Mapping[str, Any]],
                     inproc: Sequence[Mapping[str, Any]]) -> list[str]:
    """A Markdown table: each metric over HTTP beside in process, per policy."""
    by_policy = {r["policy"]: r for r in inproc}
    rows = [r for r in http_rows if r["policy"] in by_policy]
    if not rows:
        return []
    head = "| policy | " + " | ".join(f"{m} (HTTP / in process)" for m in COMPARED) + " |"
    lines = ["", "## Beside the in-process run of the same load point (`agents.json`)", "",
             head, "|" + "---|" * (len(COMPARED) + 1)]
    for r in rows:
        cells = [f"{_fmt(r.get(m))} / {_fmt(by_policy[r['policy']].get(m))}" for m in COMPARED]
        lines.append(f"| {r['policy']} | " + " | ".join(cells) + " |")
    return lines


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
    return "" if x is None else str(x)


def run_http_bench(cfg: HttpReplayConfig, out_dir: Path) -> dict[str, Path]:
    """Replay over HTTP and write ``agents-http.{csv,json,md}`` after each policy (with the
    in-process rows of the same load point beside, when ``out_dir`` holds them)."""
    env = collect_environment(cfg.bench.device)
    paths: dict[str, Path] = {}

    def write(runs: list[_Run]) -> None:
        paths.update(write_http_results(runs, cfg, env, out_dir))

    write(replay_http(cfg, on_run=write))
    return paths


def write_http_results(runs: Sequence[_Run], cfg: HttpReplayConfig, env: Environment,
                       out_dir: Path) -> dict[str, Path]:
    """The three files of the finished ``runs``."""
    _identity(runs)
    b = cfg.bench
    writer = ResultWriter(out_dir, NAME, env)
    for r in runs:
        writer.add_rows(r.jobs)
        writer.add_rows(r.turns)
    summary = [r.summary for r in runs]
    notes = [
        f"edmm serve + the openai SDK, closed loop of {cfg.load} sessions, wall clock; trace: "
        f"{b.trace or f'generated, {b.jobs} jobs, seed {b.seed}'}; tokens x{b.token_scale:g}, "
        f"tool times x{b.time_scale:g}; KV pool and agent policy as the in-process matrix "
        f"at x{b.oversubscription:g} (edmm serve flags from `serve_args`)",
        "resume TTFT: streamed, request sent to the first content or tool-call delta (a "
        "forced call's first delta comes once its name and the start of its arguments are "
        "decoded); content_resume_ttft: the resumes that stream content (first delta = first "
        "token); engine-wait = JCT minus tool time; recomputed_tokens = prompt less cached "
        "tokens of resumes, prefix_hit_rate = cached / prompt tokens of resumes (usage, as in "
        "process); lost_context_tokens: /metrics edmm_recomputed_tokens (a session's earlier "
        "context computed again)",
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
    ]
    paths = writer.write(summary, "Agent workloads over HTTP", notes,
                         meta={"seed": b.seed, "jobs": b.jobs, "token_scale": b.token_scale,
                               "time_scale": b.time_scale, "model": b.model,
                               "load": cfg.load, "oversub": b.oversubscription})
    extra = comparison_lines(summary, in_process_rows(out_dir, cfg))
    if extra:
        with paths["md"].open("a", encoding="utf-8") as f:
            f.write("\n".join(extra) + "\n")
    if any(r.stage_records for r in runs):
        paths.update({f"stages_{k}": v for k, v in _write_stages(runs, env, out_dir).items()})
    return paths


def stage_summary(policy: str, records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per stage span of ``records`` (one run's stage log): its count, median, p90
    and largest milliseconds; then the engine span split at the scheduler's admission
    (`engine_split_ms`) and the requests' steps waiting for memory."""
    spans: dict[str, list[float]] = {}
    for rec in records:
        marks = rec["marks"]
        for name, ms in {**spans_ms(marks), **engine_split_ms(marks)}.items():
            spans.setdefault(name, []).append(ms)
        waits = (rec.get("counts") or {}).get("memory_wait_steps")
        if waits is not None:
            spans.setdefault("memory_wait_steps (count)", []).append(float(waits))
    return [{"policy": policy, "span": name, "n": len(xs), "p50": percentile(xs, 50),
             "p90": percentile(xs, 90), "max": max(xs)} for name, xs in spans.items()]


def _write_stages(runs: Sequence[_Run], env: Environment, out_dir: Path) -> dict[str, Path]:
    """``agents-http-stages.{csv,json,md}``: each policy's stage spans (`stage_summary`)."""
    writer = ResultWriter(out_dir, f"{NAME}-stages", env)
    summary: list[dict[str, Any]] = []
    for r in runs:
        writer.add_rows([{"policy": r.policy.name, **rec} for rec in r.stage_records])
        summary += stage_summary(r.policy.name, r.stage_records)
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
