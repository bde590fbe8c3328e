"""``edmm bench load``: its options, and the run (`edmm.bench.load` measures)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from edmm.argparsing import float_at_least, int_at_least, int_list
from edmm.bench.commands.common import OUT_HELP, default_out_dir, device_tag, print_report

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
    parser.add_argument("--edmm-args", default="", metavar="ARGS",
                        help="arguments of the EDMM server started here, one string (e.g. "
                             "\"--model DIR --device cuda\"); default: the embedded model on "
                             "the CPU")
    parser.add_argument("--no-edmm", action="store_true",
                        help="measure the peers only (no EDMM server)")
    parser.add_argument("--peer", action="append", default=[], metavar="PEER",
                        help="also measure: vllm, vllm-offload, vllm-fp8 or an http(s) URL "
                             "(repeatable)")
    parser.add_argument("--peer-model-dir", default=None,
                        help="the HF folder (config.json + tokenizer) the vLLM peers load with "
                             "random weights (--load-format dummy)")
    parser.add_argument("--peer-python-path", default="",
                        help="PYTHONPATH entries where vLLM is installed (default: none)")
    parser.add_argument("--peer-kv-bytes", type=int_at_least(1), default=None,
                        help="vLLM's KV cache in bytes, to match EDMM's pool (default: vLLM "
                             "sizes it)")
    parser.add_argument("--peer-offload-gib", type=float_at_least(0.0), default=16.0,
                        help="host memory of vllm-offload's connector (default %(default)g)")
    parser.add_argument("--peer-max-model-len", type=int_at_least(1), default=None,
                        help="vLLM's --max-model-len (default: the model's)")
    parser.add_argument("--served-model-name", default="edmm-load",
                        help="model name the vLLM peers serve under (default %(default)s)")
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
    parser.add_argument("--token-range", default="1000,100000",
                        help="[low,high) of the random prompt token ids (default 1000,100000; "
                             "the embedded model's vocabulary is 1024)")
    parser.add_argument("--device", default="cuda",
                        help="where the servers run, for the report (default cuda)")
    parser.add_argument("--out", type=Path, default=None, help=OUT_HELP)


def run(args: argparse.Namespace) -> int:
    """Measure every server, print the table and the files written."""
    from edmm.bench.load import LoadBenchError, LoadConfig, run_load_bench
    from edmm.bench.peers import PeerError, VLLMOptions, edmm_spec, parse_peer

    try:
        low, high = (int(x) for x in args.token_range.split(","))
        cfg = LoadConfig(prompt_tokens=tuple(args.prompt_tokens),
                         output_tokens=args.output_tokens, concurrency=tuple(args.concurrency),
                         prefixes=tuple(x for x in args.prefixes.split(",") if x),
                         shared_fraction=args.shared_fraction, min_requests=args.min_requests,
                         rounds=args.rounds, token_range=(low, high), device=args.device)
    except ValueError as e:
        args.parser.error(str(e))
    vllm = (VLLMOptions(args.peer_model_dir, args.peer_python_path, args.peer_kv_bytes,
                        args.peer_offload_gib, args.peer_max_model_len)
            if args.peer_model_dir else None)
    try:
        specs = [] if args.no_edmm else [edmm_spec(shlex.split(args.edmm_args))]
        specs += [parse_peer(p, vllm, args.served_model_name) for p in args.peer]
    except PeerError as e:
        args.parser.error(str(e))
    if not specs:
        args.parser.error("nothing to measure: --no-edmm needs at least one --peer")
    out = args.out or default_out_dir(device_tag(args.device.startswith("cuda")))
    try:
        paths = run_load_bench(cfg, specs, out)
    except (PeerError, LoadBenchError) as e:  # a server failed to start, or every request
        print(f"edmm bench load: {e}", file=sys.stderr)
        return 1
    print_report(paths)
    return 0
