"""What the ``edmm bench`` commands share: the device, the output folder, the printed report.

Light to import (torch loads on first call), so that building the command line stays quick.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import shlex
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from edmm.argparsing import float_at_least, int_at_least

if TYPE_CHECKING:
    from edmm.bench.peers import ServerSpec

OUT_HELP = "output folder (default: benchmarks/results/<date>-<device>)"


def default_out_dir(device_tag: str) -> Path:
    """``benchmarks/results/<UTC date>-<device>``."""
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    return Path("benchmarks/results") / f"{date}-{device_tag}"


def device_tag(use_cuda: bool) -> str:
    """``cpu``, or the GPU's name in lower case, spaces as dashes, without ``NVIDIA``
    (``h200``)."""
    import torch

    if not use_cuda or not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name().replace("NVIDIA ", "").replace(" ", "-").lower()


def cpu_note(device: str) -> None:
    """Say, before a CPU run's tables, that its sizes and numbers are not the GPU targets."""
    if not device.startswith("cuda"):
        print("(CPU run: the tiny model in small sizes shows that every mechanism works; the "
              "README's targets and H200 numbers are GPU targets, not expected here.)\n")


def plot_line(make: Callable[[], Path]) -> None:
    """Print the plot ``make`` writes, or why it was skipped (no matplotlib)."""
    try:
        print(f"plot: {make()}")
    except RuntimeError as e:  # no matplotlib
        print(f"plot skipped: {e}")


def print_report(paths: Mapping[str, str | Path]) -> None:
    """Print a run's Markdown report (``paths["md"]``), then every file it wrote."""
    print(Path(paths["md"]).read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))


def add_server_arguments(parser: argparse.ArgumentParser, served_name: str) -> None:
    """The options naming the servers a client-side bench measures: ``edmm serve`` started
    here (``--edmm-args``, ``--edmm-name``, ``--no-edmm``) and its peers
    (`add_peer_arguments`)."""
    parser.add_argument("--edmm-args", default="", metavar="ARGS",
                        help="arguments of the EDMM server started here, one string (e.g. "
                             "\"--model DIR --device cuda\"); default: the embedded model on "
                             "the CPU")
    parser.add_argument("--edmm-name", default="EDMM", metavar="NAME",
                        help="the EDMM server's label in tables and plots (default EDMM; "
                             "e.g. a variant's flags, so runs merged later stay apart)")
    parser.add_argument("--no-edmm", action="store_true",
                        help="measure the peers only (no EDMM server)")
    add_peer_arguments(parser, served_name)


def add_peer_arguments(parser: argparse.ArgumentParser, served_name: str) -> None:
    """The options naming a client-side bench's peers: ``--peer`` and how vLLM starts (read
    back by `peer_specs`)."""
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
    parser.add_argument("--served-model-name", default=served_name,
                        help="model name the vLLM peers serve under (default %(default)s)")


def peer_specs(args: argparse.Namespace) -> list[ServerSpec]:
    """The peers `add_peer_arguments`'s options name; a usage error (exit 2, naming the
    flag) when one is unknown or a vLLM peer lacks its model folder."""
    from edmm.bench.peers import PeerError, VLLMOptions, parse_peer

    vllm = (VLLMOptions(args.peer_model_dir, args.peer_python_path, args.peer_kv_bytes,
                        args.peer_offload_gib, args.peer_max_model_len)
            if args.peer_model_dir else None)
    specs: list[ServerSpec] = []
    try:
        specs = [parse_peer(p, vllm, args.served_model_name) for p in args.peer]
    except PeerError as e:
        args.parser.error(f"--peer: {e}")
    return specs


def server_specs(args: argparse.Namespace) -> list[ServerSpec]:
    """The servers `add_server_arguments`'s options name, EDMM first; a usage error (exit 2,
    naming the flag) when a peer is unknown or nothing is left to measure."""
    from edmm.bench.peers import edmm_spec

    specs = [] if args.no_edmm else [edmm_spec(shlex.split(args.edmm_args),
                                               name=args.edmm_name)]
    specs += peer_specs(args)
    if not specs:
        args.parser.error("nothing to measure: --no-edmm needs at least one --peer")
    return specs


GPU_TOKEN_RANGE = "1000,100000"  # ordinary ids of Qwen2.5's vocabulary (151,665 tokens)
EMBEDDED_TOKEN_RANGE = "3,1024"  # the embedded model's vocabulary past its special ids (0, 2)


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a client-side bench's requests and report: ``--token-range``,
    ``--device``, ``--out`` (read back by `token_range`)."""
    parser.add_argument("--token-range", default=None,
                        help="[low,high) of the random prompt token ids (default "
                             f"{GPU_TOKEN_RANGE}; {EMBEDDED_TOKEN_RANGE} when EDMM runs the "
                             "embedded model, no --model in --edmm-args: its vocabulary is "
                             "1024)")
    parser.add_argument("--device", default="cuda",
                        help="where the servers run, for the report (default cuda)")
    parser.add_argument("--out", type=Path, default=None, help=OUT_HELP)


def token_range(args: argparse.Namespace) -> tuple[int, int]:
    """``--token-range`` as (low, high), by default `EMBEDDED_TOKEN_RANGE` when the EDMM server
    runs the embedded model (``--edmm-args`` name no ``--model``) and `GPU_TOKEN_RANGE`
    otherwise; `ValueError` when it is not two integers."""
    text = args.token_range
    if text is None:
        named = any(a == "--model" or a.startswith("--model=")
                    for a in shlex.split(args.edmm_args))
        embedded = not args.no_edmm and not named
        text = EMBEDDED_TOKEN_RANGE if embedded else GPU_TOKEN_RANGE
    try:
        low, high = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--token-range: two integers LOW,HIGH, not {text!r}") from None
    return low, high
