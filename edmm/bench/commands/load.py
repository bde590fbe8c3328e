"""``edmm bench load``: its options, and the run (`edmm.bench.load` measures)."""

from __future__ import annotations

import argparse
import sys

from edmm.argparsing import float_at_least, int_at_least, int_list
from edmm.bench.commands.common import (
    add_client_arguments,
    add_server_arguments,
    default_out_dir,
    device_tag,
    print_report,
    server_specs,
    token_range,
)

NAME = "load"
HELP = "a streaming load curve (TTFT, inter-token latency, tokens/s) of EDMM and its peers"
DESCRIPTION = (
    "Start `edmm serve` (and each --peer: vLLM with prefix caching, with its offloading "
    "connector or FP8 KV, or any OpenAI-compatible URL) one after the other on this machine, "
    "and drive each with the same streamed /v1/completions requests at rising concurrency: "
    "fixed prompt and output lengths, fresh or shared-prefix prompts. Writes one table and one "
    "plot with every server side by side.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``edmm bench load``."""
    add_server_arguments(parser, "edmm-load")
    parser.add_argument("--prompt-tokens", type=int_list, default=(2048,),
                        help="prompt lengths, comma-separated (default 2048)")
    parser.add_argument("--output-tokens", type=int_at_least(1), default=256,
                        help="tokens each request generates (default %(default)s)")
    parser.add_argument("--concurrency", type=int_list, default=(1, 2, 4, 8, 16, 32, 64),
                        help="concurrency levels, comma-separated (default 1,2,4,8,16,32,64)")
    parser.add_argument("--prefixes", default="fresh",
                        help="prefix modes, comma-separated: fresh, shared (default fresh)")
    parser.add_argument("--shared-fraction", type=float, default=0.75,
                        help="share of a shared-prefix prompt common to all (default 0.75)")
    parser.add_argument("--min-requests", type=int_at_least(1), default=8,
                        help="fewest requests a level completes (default %(default)s)")
    parser.add_argument("--rounds", type=float_at_least(0.0), default=2.0,
                        help="a level completes max(--min-requests, rounds x concurrency) "
                             "requests (default %(default)g)")
    parser.add_argument("--stages", action="store_true",
                        help="the EDMM server logs each request's stages (EDMM_STAGE_LOG); "
                             "their spans per level go to load-stages.*")
    add_client_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Measure every server, print the table and the files written."""
    from edmm.bench.load import LoadBenchError, LoadConfig, run_load_bench
    from edmm.bench.peers import PeerError

    try:
        low, high = token_range(args)
        cfg = LoadConfig(prompt_tokens=tuple(args.prompt_tokens),
                         output_tokens=args.output_tokens, concurrency=tuple(args.concurrency),
                         prefixes=tuple(x for x in args.prefixes.split(",") if x),
                         shared_fraction=args.shared_fraction, min_requests=args.min_requests,
                         rounds=args.rounds, token_range=(low, high), device=args.device)
    except ValueError as e:
        args.parser.error(str(e))
    specs = server_specs(args)
    out = args.out or default_out_dir(device_tag(args.device.startswith("cuda")))
    try:
        paths = run_load_bench(cfg, specs, out, stages=args.stages)
    except (PeerError, LoadBenchError) as e:  # a server failed to start, or every request
        print(f"edmm bench load: {e}", file=sys.stderr)
        return 1
    print_report(paths)
    return 0
