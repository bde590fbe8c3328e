"""``edmm bench single``: its options, and the run (`edmm.bench.single` measures)."""

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

NAME = "single"
HELP = "one request at a time (resume A/B, full prefill, HTTP floor, decode) of EDMM and peers"
DESCRIPTION = (
    "Start `edmm serve` (and each --peer: vLLM with prefix caching, with its offloading "
    "connector or FP8 KV, or any OpenAI-compatible URL) one after the other on this machine, "
    "and time the same token-id requests on /v1/completions against each: a result appended "
    "to a cached context (A), inserted mid-context (B), a full prefill, a 16-token request "
    "(the HTTP floor), and decode at several batch sizes. One table with every server side "
    "by side.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``edmm bench single``."""
    add_server_arguments(parser, "edmm-single")
    parser.add_argument("--contexts", type=int_list, default=(16384,),
                        help="cached context lengths, comma-separated (default 16384)")
    parser.add_argument("--result-tokens", type=int_at_least(1), default=512,
                        help="tokens appended (A) or inserted (B) (default %(default)s)")
    parser.add_argument("--insert-fraction", type=float_at_least(0.0), default=0.5,
                        help="where B inserts, as a fraction of the context in (0, 1) "
                             "(default %(default)g)")
    parser.add_argument("--repeats", type=int_at_least(1), default=8,
                        help="timed repetitions of each measurement (default %(default)s)")
    parser.add_argument("--decode-batches", type=int_list, default=(1, 8, 32, 64),
                        help="concurrent requests of the decode measurement (default "
                             "1,8,32,64)")
    parser.add_argument("--decode-tokens", type=int_at_least(2), default=256,
                        help="output tokens of each decode request (default %(default)s)")
    add_client_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Measure every server, print the table and the files written."""
    from edmm.bench.peers import PeerError
    from edmm.bench.single import SingleBenchError, SingleConfig, run_single_bench

    try:
        low, high = token_range(args)
        cfg = SingleConfig(contexts=tuple(args.contexts), result_tokens=args.result_tokens,
                           insert_fraction=args.insert_fraction, repeats=args.repeats,
                           decode_batches=tuple(args.decode_batches),
                           decode_tokens=args.decode_tokens, token_range=(low, high),
                           device=args.device)
    except ValueError as e:
        args.parser.error(str(e))
    specs = server_specs(args)
    out = args.out or default_out_dir(device_tag(args.device.startswith("cuda")))
    try:
        paths = run_single_bench(cfg, specs, out)
    except (PeerError, SingleBenchError) as e:
        print(f"edmm bench single: {e}", file=sys.stderr)
        return 1
    print_report(paths)
    return 0
