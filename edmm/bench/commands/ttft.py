"""``edmm bench ttft``: its options and device-dependent defaults, and the run: the A/B/C resume
groups (`edmm.bench.resume`, beside transformers in `edmm.bench.resume_peer`), then the
model-level ops (`edmm.bench.model_ops`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from edmm.argparsing import fraction, int_at_least, int_list, resolve_device
from edmm.bench.commands.common import (
    OUT_HELP,
    cpu_note,
    default_out_dir,
    device_tag,
    plot_line,
)

NAME = "ttft"
HELP = "A/B/C resume groups, then decode step and prefills beside transformers"
DESCRIPTION = (
    "Time to first token of a resumed agent turn: A, the tool result appended (prefix hit); B, "
    "the result inserted mid-prompt (recompute from it); C, B's prompt speculated during the "
    "tool call (zero-copy commit). Then the model-level ops (decode step, prefill on a cached "
    "prefix, full prefill) beside transformers. With no GPU it runs the tiny model on the CPU "
    "in small sizes; its targets are GPU targets.")


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``edmm bench ttft``; sizes left unset take `TTFT_DEFAULTS` of the device."""
    add = parser.add_argument
    add("--only", choices=("groups", "model"), default=None,
        help="run only the A/B/C groups or only the model-level ops (default: both)")
    add("--device", default="auto",
        help="auto (CUDA if present, else the CPU), cpu, or cuda (cuda:N)")
    add("--model", default=None, help=f"preset name or local HF folder {_by_device('model')}")
    add("--dtype", default=None, help=f"weights and KV dtype {_by_device('dtype')}")
    add("--contexts", type=int_list, default=None,
        help=f"context lengths in tokens, comma-separated {_by_device('contexts')}")
    add("--result-tokens", type=int_at_least(1), default=None,
        help="tool result length of the A/B/C groups; every context must exceed it by 2 "
             f"{_by_device('result_tokens')}")
    add("--insert-fraction", type=fraction, default=0.5,
        help="where B and C insert the result, as a fraction of the context in [0, 1)")
    add("--repeats", type=int_at_least(1), default=None,
        help=f"timed repetitions per measurement {_by_device('repeats')}")
    add("--full-prefill-repeats", type=int_at_least(1), default=None,
        help=f"timed full prefills per context {_by_device('full_prefill_repeats')}")
    add("--new-tokens", type=int_at_least(1), default=None,
        help=f"tokens prefilled on a cached prefix; below every context "
             f"{_by_device('new_tokens')}")
    add("--no-peer", action="store_true", help="skip transformers")
    add("--eager", action="store_true",
        help="EDMM with reference SDPA attention and no CUDA graphs")
    add("--prefill-kernel", choices=("warp-specialized", "default"), default="warp-specialized",
        help="launch config of the Triton prefill kernel on CUDA ('default': the plain "
             "kernel's), for comparisons")
    add("--full-prefill-chunk", type=int_at_least(0), default=0,
        help="run the full prefill in passes of this many tokens, as the engine's token budget "
             "does (both engines; 0: one pass)")
    add("--attention", type=_attentions, default=("auto",),
        help="EDMM's attention backend(s), comma-separated, timed one after the other in this "
             "run: auto (FlashAttention-4 prefill where it runs, else Triton), fa4, triton, "
             "sdpa; the first also runs the A/B/C groups")
    add("--decode-routes", default=None, metavar="JSON",
        help="the decode kernel's measured routing table (written by python -m "
             "benchmarks.kernels.decode_sweep; default: the committed one, else the kernel's "
             "heuristic)")
    add("--matmul-routes", default=None, metavar="JSON",
        help="the projections' measured skinny-matmul routing table (written by python -m "
             "benchmarks.kernels.matmul_sweep; default: the committed one; off: cuBLAS for "
             "every projection)")
    add("--kv-cache-dtype", type=_kv_dtypes, default=("auto",),
        help="KV cache dtype(s) of the model-level ops, comma-separated, each EDMM side timed "
             "with each in this run: auto (the weights'), bf16, fp8 (e4m3, per-head scales); "
             "rows of all but the first are labelled -kv-<dtype>")
    add("--decode-batch", type=int_list, default=(1,),
        help="also time decode steps of this many sequences at each context (comma-separated; "
             "each sequence on its own pages; EDMM only)")
    add("--tensor-parallel-size", type=int_at_least(1), default=None,
        help="split the model over this many GPUs; the model-level ops then run as engine "
             "requests (no transformers peer; default: one device, the model driven directly)")
    add("--out", type=Path, default=None, help=OUT_HELP)


def _fill_defaults(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Resolve --device and the device-dependent defaults, then check the sizes together."""
    args.device = resolve_device(parser, args.device)
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


def _run_groups(args: argparse.Namespace, out: Path) -> None:
    """The A/B/C groups in the engine, then (unless --no-peer) through transformers."""
    from edmm.bench.resume import ResumeBenchConfig, run_resume_bench
    from edmm.bench.resume_peer import plot_groups, run_peer_bench

    cfg = ResumeBenchConfig(model=args.model, device=args.device, dtype=args.dtype,
                            contexts=args.contexts, result_tokens=args.result_tokens,
                            insert_fraction=args.insert_fraction, iterations=args.repeats,
                            enforce_eager=args.eager, attention=args.attention[0],
                            tensor_parallel_size=args.tensor_parallel_size or 1)
    print(Path(run_resume_bench(cfg, out)["md"]).read_text())
    if not args.no_peer:
        print(Path(run_peer_bench(cfg, out)["md"]).read_text())
    plot_line(lambda: plot_groups(out, args.model))


def _run_model_ops(args: argparse.Namespace, out: Path) -> None:
    """Decode step, prefill on a cached prefix and full prefill, beside transformers."""
    from edmm.bench.model_ops import ModelOpsConfig, run_model_ops_bench

    cfg = ModelOpsConfig(model=args.model, device=args.device, dtype=args.dtype,
                         contexts=args.contexts, repeats=args.repeats,
                         full_prefill_repeats=args.full_prefill_repeats,
                         new_tokens=args.new_tokens, peer=not args.no_peer, eager=args.eager,
                         prefill_kernel=args.prefill_kernel,
                         full_prefill_chunk=args.full_prefill_chunk, attentions=args.attention,
                         decode_routes=args.decode_routes, matmul_routes=args.matmul_routes,
                         tensor_parallel_size=args.tensor_parallel_size,
                         kv_cache_dtypes=args.kv_cache_dtype,
                         decode_batches=tuple(args.decode_batch))
    print(Path(run_model_ops_bench(cfg, out)["md"]).read_text())


def run(args: argparse.Namespace) -> int:
    """Fill the device's defaults, run the parts asked for, print their reports."""
    _fill_defaults(args.parser, args)
    cpu_note(args.device)
    out = args.out or default_out_dir(device_tag(args.device.startswith("cuda")))
    if args.only != "model":
        _run_groups(args, out)
    if args.only != "groups":
        _run_model_ops(args, out)
    print(f"wrote {out}")
    return 0
