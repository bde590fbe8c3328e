"""``edmm bench agents``: its options, and the run: the trace replayed in process
(`edmm.bench.agents.report`) or over HTTP (`edmm.bench.agents.http`)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from edmm.argparsing import float_at_least, int_at_least, int_list
from edmm.bench.commands.common import OUT_HELP, default_out_dir, device_tag, print_report

if TYPE_CHECKING:
    from edmm.bench.agents.fleet import FleetConfig
    from edmm.bench.agents.http import HttpReplayConfig
    from edmm.bench.agents.matrix import AgentsBenchConfig
    from edmm.bench.agents.trace import GeneratorConfig, Job

NAME = "agents"
HELP = ("many agent sessions replayed from a trace under KV policies (lru, ttl, offload, "
        "rewarm, edmm), in process or over HTTP beside vLLM")
DESCRIPTION = (
    "Replay a trace of agent jobs (generated: a fleet of agent types by default, or --trace: "
    "JSONL or TraceLab's replay CSV) against the engine under each KV policy on the same trace "
    "and seed, in process or over HTTP (with --peer: vLLM and others on the same trace); report "
    "TTFT of every turn by kind, job completion time, engine-wait, prefill amplification, "
    "offload traffic and KV pages by state over time. The trace's statistics are printed "
    "beside the published ones.")
GENERATORS = ("v1", "v2")
DEFAULT_TURNS = {"v1": (10, 40), "v2": (20, 60)}
MATRIX_POLICIES = "lru,ttl,offload,rewarm,edmm"
HTTP_POLICIES = "lru,offload,edmm"


def _step_model(text: str) -> str:
    from edmm.engine.step_cost import STEP_TIME_MODELS

    if text not in STEP_TIME_MODELS:
        raise argparse.ArgumentTypeError(
            f"unknown step-time model {text!r} (known: {', '.join(sorted(STEP_TIME_MODELS))})")
    return text


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from e


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``edmm bench agents``: the trace, the matrix, the engine, HTTP."""
    _add_trace_arguments(parser)
    _add_matrix_arguments(parser)
    _add_engine_arguments(parser)
    _add_http_arguments(parser)
    parser.add_argument("--write-trace", type=Path, default=None,
                        help="write the (scaled) trace here and exit: TraceLab's replay CSV "
                             "for a .csv name, else JSONL; prints its statistics")
    parser.add_argument("--out", type=Path, default=None, help=OUT_HELP)


def _add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default=None,
        help="preset or local HF folder (default: the embedded tiny model)")
    add("--device", default="cpu", help="cpu, or cuda (cuda:N)")
    add("--dtype", default=None,
        help="weights and KV dtype (default: float32 on the CPU, bfloat16 on CUDA)")
    add("--trace", type=Path, default=None,
        help="your own trace: JSONL (docs/benchmarks.md: 'Replaying your own trace') or "
             "TraceLab's replay CSV (a .csv name)")
    add("--generator", choices=GENERATORS, default="v2",
        help="the generated trace: v2 a fleet of agent types (shared prefixes, subagents, "
             "user messages, compaction; the default), v1 the first generator (no token "
             "shared between jobs; earlier results replay with it)")
    add("--jobs", type=int_at_least(1), default=64,
        help="top-level jobs of a generated trace (a closed loop's --loads need as many)")
    add("--seed", type=int, default=0, help="seed of the generated trace")
    add("--turns", type=int_list, default=None,
        help="low,high model calls per generated job (default: v2 20,60; v1 10,40)")
    add("--context-limit", type=int_at_least(1024), default=131072,
        help="v2: the model's context in trace tokens (before --token-scale); sessions "
             "compact near it (default %(default)s)")
    add("--agent-types", default=None,
        help="v2: comma-separated agent types to draw sessions from (default: all; "
             "claude-code, codex, mini-swe)")
    add("--token-scale", type=float_at_least(0.0), default=1.0,
        help="multiply every token count (e.g. 0.02 for the tiny CPU model)")
    add("--time-scale", type=float_at_least(0.0), default=1.0,
        help="multiply every tool time (a run that fits in minutes)")
    add("--call-tokens", type=int_at_least(1), default=None,
        help="in process: call turns decode this many tokens and the rest of their output "
             "joins the tool result, as --http's forced calls do (the HTTP run's call_tokens "
             "column), so the two runs do the same work")


def _add_matrix_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--policies", default=None,
        help=f"comma-separated (default: {MATRIX_POLICIES}; with --http {HTTP_POLICIES}, or "
             "none to run --peer alone); also "
             "edmm-no-<retention|offload|prefetch|template|streamed|predicted|gate|admission>")
    add("--loads", type=_floats, default=(8, 32, 64),
        help="concurrent sessions (closed loop) or jobs/s (open loop)")
    add("--mode", choices=("closed", "open"), default="closed",
        help="closed: --loads sessions at once; open: Poisson job arrivals")
    add("--oversub", type=float_at_least(1.0), default=2.0,
        help="working set / KV pool of the main matrix")
    add("--check-oversub", type=float_at_least(0.0), default=1.0,
        help="oversubscription of the edmm vs best-baseline check (0: none)")
    add("--no-short-mix", action="store_true", help="skip the short-tool (< 1 s) check")
    add("--mix", choices=("long", "short"), default="long",
        help="tool mix of the main matrix (short: every tool under a second)")
    add("--no-checks", action="store_true",
        help="run the main matrix only (no 1x / short-mix checks): a subset for `edmm bench "
             "agents-merge`")
    add("--lean", action="store_true",
        help="write agents.json, agents.md and the timeline only (the merge writes the rest)")
    add("--step-log", action="store_true",
        help="also write agents-steps.csv: one row per engine step (its tokens, speculative "
             "tokens, engine and agent-layer seconds)")
    add("--working-set-sessions", type=int_at_least(1), default=None,
        help="sessions the pool is sized for (default: the load; open loop: 16)")
    add("--clock", choices=("virtual", "wall", "model"), default="virtual",
        help="virtual: skip idle time (steps still timed for real); model: steps take "
             "--step-model's modelled seconds (explore policies at a GPU's speeds without it; "
             "deterministic)")
    add("--step-model", type=_step_model, default="h200-qwen2.5-7b",
        help="the step-time model of --clock model (fitted to measured runs)")


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--threads", type=int_at_least(1), default=None,
        help="torch CPU threads (default: torch's)")
    add("--max-num-batched-tokens", type=int_at_least(1), default=2048,
        help="the engine's token budget per step")
    add("--max-num-seqs", type=int_at_least(1), default=64,
        help="most sequences running at once")
    add("--graph-sizes", type=int_list, default=None,
        help="token counts of the captured mixed-batch CUDA graphs (default: the engine's)")
    add("--busy-spec-tokens", type=int_at_least(0), default=None,
        help="speculative tokens riding along busy steps (default: the engine's)")
    add("--no-spec-in-padding", action="store_true",
        help="CUDA: speculation never fills the padding of busy prefill steps")
    add("--host-page-size", type=int_at_least(4096), default=1 << 16,
        help="page size of the host twin in bytes (CPU runs)")


def _add_http_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--http", action="store_true",
        help="replay over HTTP instead: edmm serve (and each --peer) + the openai SDK, at "
             "every load (whole sessions) and --oversub, the same trace, KV pool and policies "
             "as in process (all but rewarm), wall clock, streamed; writes agents-http.*; needs "
             "the server extras")
    add("--http-overlap-tail", type=int_at_least(0), default=0,
        help="with --http: start the next policy's server once this many of the run's jobs "
             "are left (0: after the run)")
    add("--http-stages", action="store_true",
        help="with --http: each server logs its requests' stages (EDMM_STAGE_LOG); writes "
             "agents-http-stages.*")
    add("--http-clients", type=int_at_least(0), default=0,
        help="with --http: client processes the sessions run in, one thread a session (0: one "
             "per 4 sessions)")
    add("--tokenizer", default=None,
        help="with --http: the tokenizer folder of edmm serve and the clients (default: the "
             "model's; beside a preset the Qwen2.5 vocabulary; give the vLLM peers' folder so "
             "every engine counts the same tokens)")
    add("--server-arg", action="append", default=[],
        help="extra edmm serve option with --http, repeatable")
    add("--peer", action="append", default=[], metavar="PEER",
        help="with --http: also replay against vllm (prefix caching), vllm-offload (with its "
             "OffloadingConnector) or an http(s) URL, at every load (repeatable)")
    add("--peer-model-dir", default=None,
        help="the HF folder the vLLM peers load with random weights (the same model as "
             "--model)")
    add("--peer-python-path", default="",
        help="PYTHONPATH entries where vLLM is installed (default: none)")
    add("--peer-kv-bytes", type=int_at_least(1), default=None,
        help="vLLM's KV cache in bytes (default: EDMM's pool at each load)")
    add("--peer-offload-gib", type=float_at_least(0.0), default=None,
        help="host memory of vllm-offload's connector (default: EDMM's offload at each load)")
    add("--peer-max-model-len", type=int_at_least(1), default=None,
        help="vLLM's --max-model-len (default: EDMM's server's)")
    add("--peer-arg", action="append", default=[],
        help="extra vllm serve argument, repeatable (e.g. --peer-arg=--enforce-eager)")


def _config(args: argparse.Namespace) -> AgentsBenchConfig:
    from edmm.bench.agents.matrix import AgentsBenchConfig

    turns = tuple(args.turns or DEFAULT_TURNS[args.generator])
    if len(turns) != 2 or turns[0] > turns[1]:
        args.parser.error(f"--turns takes low,high with low <= high, got {args.turns}")
    policies = args.policies or (HTTP_POLICIES if args.http else MATRIX_POLICIES)
    if policies == "none":
        policies = ""
    return AgentsBenchConfig(
        model=args.model, device=args.device, dtype=args.dtype, trace=args.trace,
        jobs=args.jobs, seed=args.seed, generator=_generator(args, turns),
        token_scale=args.token_scale, time_scale=args.time_scale,
        policies=tuple(p for p in policies.split(",") if p), loads=args.loads,
        mode=args.mode, oversubscription=args.oversub,
        check_oversubscription=args.check_oversub or None, short_mix=not args.no_short_mix,
        working_set_sessions=args.working_set_sessions, clock=args.clock,
        step_model=args.step_model, host_page_size=args.host_page_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, cuda_graph_token_sizes=args.graph_sizes,
        speculative_tokens_when_busy=args.busy_spec_tokens,
        speculation_fills_padding=not args.no_spec_in_padding, mix=args.mix,
        checks=not args.no_checks, lean=args.lean, step_log=args.step_log,
        call_tokens=args.call_tokens or 0)


def _generator(args: argparse.Namespace, turns: tuple[int, ...]) -> GeneratorConfig | FleetConfig:
    """The generator's config of ``--generator`` (a bad v2 setting: a usage error)."""
    from edmm.bench.agents.fleet import FleetConfig
    from edmm.bench.agents.trace import GeneratorConfig, TraceError

    low, high = turns
    if args.generator == "v1":
        return dataclasses.replace(GeneratorConfig(), turns=(low, high))
    names = tuple(n for n in (args.agent_types or "").split(",") if n)
    try:
        return FleetConfig(turns=(low, high), context_limit=args.context_limit, names=names)
    except TraceError as e:
        args.parser.error(f"--turns / --context-limit / --agent-types: {e}")
        raise  # parser.error exits


def _trace(args: argparse.Namespace, cfg: AgentsBenchConfig) -> list[Job]:
    """The run's long-tool jobs; a bad ``--trace`` file, or a closed loop of more sessions than
    the trace has jobs (it would never hold that many), is a one-line usage error."""
    from edmm.bench.agents.matrix import load_trace
    from edmm.bench.agents.trace import TraceError, top_level

    try:
        jobs = load_trace(cfg)["long"]
    except (TraceError, OSError) as e:
        args.parser.error(f"--trace: {e}")
    top = len(top_level(jobs))
    if cfg.mode == "closed" and max(cfg.loads) > top:
        args.parser.error(
            f"--loads: a closed loop of {max(cfg.loads):g} sessions needs at least as many jobs; "
            f"the trace has {top} (raise --jobs, or give a longer --trace)")
    return jobs


def trace_stats_text(cfg: AgentsBenchConfig, jobs: list[Job]) -> str:
    """The trace's statistics beside the published ones (and as replayed, when scaled)."""
    from edmm.bench.agents.matrix import trace_jobs
    from edmm.bench.agents.trace_stats import stats_table, trace_statistics

    scaled = cfg.token_scale != 1 or cfg.time_scale != 1
    table = stats_table(trace_statistics(trace_jobs(cfg) if scaled else jobs),
                        trace_statistics(jobs, cfg.time_scale) if scaled else None,
                        f"tokens x{cfg.token_scale:g}, times x{cfg.time_scale:g}")
    what = cfg.trace or f"generated ({cfg.generator.__class__.__name__}), seed {cfg.seed}"
    return f"# Trace statistics\n\nTrace: {what}.\n\n{table}\n"


def _http_config(args: argparse.Namespace, cfg: AgentsBenchConfig) -> HttpReplayConfig:
    """The HTTP replay's config; bad loads, peers or policies are one-line usage errors."""
    from edmm.bench.agents.http import HttpBenchError, HttpReplayConfig
    from edmm.bench.peers import VLLM_PEERS, VLLMOptions

    if args.call_tokens is not None:
        args.parser.error("--call-tokens: in process only (over HTTP the forced call's grammar "
                          "sets its length)")
    loads = tuple(int(x) for x in args.loads)
    if any(x != int(x) or x < 1 for x in args.loads):
        args.parser.error(f"--loads: over HTTP, whole numbers of sessions >= 1, got {args.loads}")
    for peer in args.peer:
        if peer not in VLLM_PEERS and not peer.startswith(("http://", "https://")):
            args.parser.error(f"--peer: one of {', '.join(VLLM_PEERS)} or a URL, got {peer!r}")
        if peer in VLLM_PEERS and not args.peer_model_dir:
            args.parser.error(f"--peer {peer} needs --peer-model-dir (the HF folder vLLM loads)")
    vllm = VLLMOptions(args.peer_model_dir, args.peer_python_path, args.peer_kv_bytes,
                       max_model_len=args.peer_max_model_len,
                       extra_args=tuple(args.peer_arg)) if args.peer_model_dir else None
    try:
        hcfg = HttpReplayConfig(bench=cfg, load=loads[0], loads=loads, policies=cfg.policies,
                                tokenizer=args.tokenizer, server_args=tuple(args.server_arg),
                                overlap_tail=args.http_overlap_tail,
                                clients=args.http_clients, stages=args.http_stages,
                                peers=tuple(args.peer), vllm=vllm,
                                peer_offload_gib=args.peer_offload_gib)
    except HttpBenchError as e:
        args.parser.error(str(e))
    return hcfg


def _run_http(hcfg: HttpReplayConfig, out: Path) -> int:
    from edmm.bench.agents.http import run_http_bench
    from edmm.bench.peers import PeerError

    try:
        print_report(run_http_bench(hcfg, out))
    except PeerError as e:  # a peer failed to start: its log's tail says why
        print(f"edmm bench agents: {e}", file=sys.stderr)
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    """Build the trace (or write it and stop), replay it in process or over HTTP, print the
    report; a SIGTERM (a time limit) still leaves the files of the runs done."""
    import signal

    import torch

    from edmm.bench.agents.report import run_agents_bench
    from edmm.bench.agents.trace import write_jsonl
    from edmm.bench.agents.tracelab import write_tracelab

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cfg = _config(args)
    jobs = _trace(args, cfg)
    hcfg = _http_config(args, cfg) if args.http else None
    stats = trace_stats_text(cfg, jobs)
    if args.write_trace is not None:
        write = write_tracelab if args.write_trace.suffix.lower() == ".csv" else write_jsonl
        print(stats)
        print(f"wrote {write(jobs, args.write_trace)}")
        return 0
    print(stats, file=sys.stderr)
    out = args.out or default_out_dir(device_tag(args.device.startswith("cuda")))
    out.mkdir(parents=True, exist_ok=True)
    (out / "agents-trace-stats.md").write_text(stats, encoding="utf-8")
    if hcfg is not None:
        return _run_http(hcfg, out)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a time limit: files still written
    print_report(run_agents_bench(cfg, out, log=lambda s: print(s, file=sys.stderr, flush=True)))
    return 0
