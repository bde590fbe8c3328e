"""``edmm``: the command line (doctor, bench)."""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def _command(name: str) -> Callable[[Callable[[argparse.Namespace], int]],
                                    Callable[[argparse.Namespace], int]]:
    def register(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        COMMANDS[name] = fn
        return fn
    return register


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e


def _attentions(text: str) -> tuple[str, ...]:
    from edmm.model.attention_choice import ATTENTION_CHOICES

    names = tuple(x for x in text.split(",") if x)
    bad = [n for n in names if n not in ATTENTION_CHOICES]
    if not names or bad:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated names of {ATTENTION_CHOICES}, got {text!r}")
    return names


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from e
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def default_out_dir(device_tag: str) -> Path:
    """``benchmarks/results/<UTC date>-<device>``."""
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    return Path("benchmarks/results") / f"{date}-{device_tag}"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="edmm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="which VMM backend is usable here, and why")
    doctor.add_argument("--device-index", type=int, default=0)

    # `serve` and `demo` parse their own arguments (see `main`); listed here for --help.
    sub.add_parser("serve", add_help=False,
                   help="OpenAI-compatible server (default: the tiny model); serve --help")

    sub.add_parser("proxy", add_help=False,
                   help="OpenAI-compatible proxy in front of vLLM (speculative prefill); "
                   "proxy --help")

    sub.add_parser("demo", add_help=False,
                   help="agent tool loop on the tiny model: EDMM on vs off, A/B/C TTFT")

    bench = sub.add_parser("bench", help="benchmarks (results stamped with device and date)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    vmm = bsub.add_parser("vmm", help="VMM page costs, branch and commit, copy baseline")
    vmm.add_argument("--backend", choices=("auto", "cuda", "host"), default="auto")
    vmm.add_argument("--contexts", type=_ints, default=(4096, 16384, 32768),
                     help="prefix lengths in tokens (comma-separated)")
    vmm.add_argument("--repeats", type=int, default=20)
    vmm.add_argument("--pages", type=int, default=64, help="pages per per-page batch")
    vmm.add_argument("--host-page-size", type=int, default=2 * 1024 * 1024)
    vmm.add_argument("--out", type=Path, default=None,
                     help="output folder (default benchmarks/results/<date>-<device>)")
    ttft = bsub.add_parser("ttft", help="the seed's A/B/C resume groups, then decode step, "
                           "cached-prefix prefill and full prefill beside transformers")
    ttft.add_argument("--only", choices=("groups", "model"), default=None,
                      help="run only the A/B/C groups or only the model-level ops")
    ttft.add_argument("--result-tokens", type=int, default=512,
                      help="tool result length of the A/B/C groups")
    ttft.add_argument("--insert-fraction", type=float, default=0.5,
                      help="where B/C insert the result, as a fraction of the context")
    ttft.add_argument("--model", default="qwen2.5-7b", help="preset name or local HF folder")
    ttft.add_argument("--device", default="cuda")
    ttft.add_argument("--dtype", default="bfloat16")
    ttft.add_argument("--contexts", type=_ints, default=(4096, 16384, 32768))
    ttft.add_argument("--repeats", type=int, default=20)
    ttft.add_argument("--full-prefill-repeats", type=int, default=5)
    ttft.add_argument("--new-tokens", type=int, default=512)
    ttft.add_argument("--no-peer", action="store_true", help="skip transformers")
    ttft.add_argument("--eager", action="store_true",
                      help="EDMM with reference SDPA attention and no CUDA graphs")
    ttft.add_argument("--prefill-kernel", choices=("warp-specialized", "default"),
                      default="warp-specialized",
                      help="the Triton prefill kernel's launch config (default: the plain "
                           "kernel's), for comparisons")
    ttft.add_argument("--attention", type=_attentions, default=("auto",),
                      help="EDMM's attention backend(s), comma-separated, timed one after "
                           "the other in this run: auto (FlashAttention-4 prefill where it "
                           "runs, else Triton), fa4, triton, sdpa; the first also runs the "
                           "A/B/C groups (default: auto)")
    ttft.add_argument("--decode-routes", default=None, metavar="JSON",
                      help="the decode kernel's measured routing table (written by "
                           "python -m edmm.bench.scripts.decode_sweep; default: the committed one, "
                           "else the kernel's heuristic)")
    ttft.add_argument("--full-prefill-chunk", type=_non_negative, default=0,
                      help="run the full prefill in passes of this many tokens, as the "
                           "engine's token budget does (both engines; default 0: one pass)")
    ttft.add_argument("--out", type=Path, default=None)
    live = bsub.add_parser("live", help="A/B/C resume groups at the client: the openai SDK over "
                           "HTTP against edmm serve (started on a free port, or --url)")
    live.add_argument("--model", default=None,
                      help="local HF folder with a tokenizer (default: the embedded tiny model)")
    live.add_argument("--tokenizer", default=None,
                      help="local tokenizer folder with a chat template (with a preset --model)")
    live.add_argument("--device", default="cpu")
    live.add_argument("--url", default=None, help="a running server instead of starting one")
    live.add_argument("--contexts", type=_ints, default=(1024, 4096))
    live.add_argument("--result-tokens", type=int, default=256)
    live.add_argument("--insert-fraction", type=float, default=0.5)
    live.add_argument("--iterations", type=int, default=10)
    live.add_argument("--warmup", type=int, default=2)
    live.add_argument("--tool-duration", type=float, default=0.2,
                      help="seconds the client waits before resuming (expected_tool_duration_s)")
    live.add_argument("--resume-tokens", type=int, default=8,
                      help="tokens the resume generates (1: the non-streamed total is a TTFT)")
    live.add_argument("--server-arg", action="append", default=[],
                      help="extra edmm serve option, repeatable: --server-arg=--dtype=bfloat16")
    live.add_argument("--out", type=Path, default=None)
    _agents_parser(bsub)
    return parser


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from e


def _agents_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    agents = bsub.add_parser("agents", help="many agent sessions replayed from a trace under KV "
                             "policies (lru, ttl, offload, rewarm, edmm), in process")
    agents.add_argument("--model", default=None,
                        help="preset or local HF folder (default: the embedded tiny model)")
    agents.add_argument("--device", default="cpu")
    agents.add_argument("--dtype", default=None)
    agents.add_argument("--trace", type=Path, default=None,
                        help="your own JSONL trace (README: 'Replaying your own trace')")
    agents.add_argument("--jobs", type=int, default=16, help="jobs of a generated trace")
    agents.add_argument("--seed", type=int, default=0)
    agents.add_argument("--turns", type=_ints, default=(10, 40),
                        help="low,high turns per generated job")
    agents.add_argument("--token-scale", type=float, default=1.0,
                        help="multiply every token count (e.g. 0.02 for the tiny CPU model)")
    agents.add_argument("--time-scale", type=float, default=1.0,
                        help="multiply every tool time (a run that fits in minutes)")
    agents.add_argument("--policies", default="lru,ttl,offload,rewarm,edmm",
                        help="comma-separated; also edmm-no-<retention|offload|prefetch|"
                             "template|streamed|predicted>")
    agents.add_argument("--loads", type=_floats, default=(8, 32, 64),
                        help="concurrent sessions (closed loop) or jobs/s (open loop)")
    agents.add_argument("--mode", choices=("closed", "open"), default="closed")
    agents.add_argument("--oversub", type=float, default=2.0,
                        help="working set / KV pool of the main matrix")
    agents.add_argument("--check-oversub", type=float, default=1.0,
                        help="oversubscription of the edmm vs best-baseline check (0: none)")
    agents.add_argument("--no-short-mix", action="store_true",
                        help="skip the short-tool (< 1 s) check")
    agents.add_argument("--working-set-sessions", type=int, default=None,
                        help="sessions the pool is sized for (default: the load; open loop: 16)")
    agents.add_argument("--clock", choices=("virtual", "wall"), default="virtual",
                        help="virtual: skip idle time (steps still timed for real)")
    agents.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    agents.add_argument("--max-num-batched-tokens", type=int, default=2048)
    agents.add_argument("--max-num-seqs", type=int, default=64)
    agents.add_argument("--graph-sizes", type=_ints, default=None,
                        help="token counts of the captured mixed-batch CUDA graphs")
    agents.add_argument("--busy-spec-tokens", type=int, default=None,
                        help="speculative tokens riding along busy steps (default: engine's)")
    agents.add_argument("--no-spec-in-padding", action="store_true",
                        help="CUDA: speculation never fills the padding of busy prefill steps")
    agents.add_argument("--host-page-size", type=int, default=1 << 16)
    agents.add_argument("--http", action="store_true",
                        help="replay over HTTP instead (edmm serve + the openai SDK; lru and "
                             "edmm at the first load, wall clock; needs the server extras)")
    agents.add_argument("--server-arg", action="append", default=[],
                        help="extra edmm serve option with --http, repeatable")
    agents.add_argument("--write-trace", type=Path, default=None,
                        help="write the (scaled) trace here and exit")
    agents.add_argument("--out", type=Path, default=None)


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


def _device_tag(use_cuda: bool) -> str:
    import torch

    if not use_cuda or not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name().replace("NVIDIA ", "").replace(" ", "-").lower()


def _bench_agents(args: argparse.Namespace) -> int:
    import dataclasses

    import torch

    from edmm.bench.agents.matrix import AgentsBenchConfig, load_trace
    from edmm.bench.agents.report import run_agents_bench
    from edmm.bench.agents.trace import GeneratorConfig, write_jsonl

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if len(args.turns) != 2:
        raise SystemExit("--turns takes low,high")
    cfg = AgentsBenchConfig(
        model=args.model, device=args.device, dtype=args.dtype, trace=args.trace,
        jobs=args.jobs, seed=args.seed,
        generator=dataclasses.replace(GeneratorConfig(), turns=tuple(args.turns)),
        token_scale=args.token_scale, time_scale=args.time_scale,
        policies=tuple(p for p in args.policies.split(",") if p), loads=args.loads,
        mode=args.mode, oversubscription=args.oversub,
        check_oversubscription=args.check_oversub or None, short_mix=not args.no_short_mix,
        working_set_sessions=args.working_set_sessions, clock=args.clock,
        host_page_size=args.host_page_size, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, cuda_graph_token_sizes=args.graph_sizes,
        speculative_tokens_when_busy=args.busy_spec_tokens,
        speculation_fills_padding=not args.no_spec_in_padding)
    if args.write_trace is not None:
        print(f"wrote {write_jsonl(load_trace(cfg)['long'], args.write_trace)}")
        return 0
    out = args.out or default_out_dir(_device_tag(args.device.startswith("cuda")))
    if args.http:
        from edmm.bench.agents.http import SERVER_FLAGS, HttpReplayConfig, run_http_bench

        hcfg = HttpReplayConfig(load=int(args.loads[0]), model=args.model, device=args.device,
                                policies=tuple(p for p in cfg.policies if p in SERVER_FLAGS),
                                server_args=tuple(args.server_arg))
        paths = run_http_bench(load_trace(cfg)["long"], hcfg, out)
        print(Path(paths["md"]).read_text())
        return 0
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a time limit: files still written
    paths = run_agents_bench(cfg, out, log=lambda s: print(s, file=sys.stderr, flush=True))
    print(Path(paths["md"]).read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


@_command("bench")
def _bench(args: argparse.Namespace) -> int:
    if args.bench == "agents":
        return _bench_agents(args)
    if args.bench == "vmm":
        from edmm.bench.vmm import VMMBenchConfig, run_vmm_bench

        cfg = VMMBenchConfig(backend=args.backend, contexts=args.contexts,
                             repeats=args.repeats, pages=args.pages,
                             host_page_size=args.host_page_size)
        paths = run_vmm_bench(cfg, args.out or default_out_dir(_device_tag(
            args.backend != "host")))
        print(Path(paths["md"]).read_text())
        print("wrote " + ", ".join(str(p) for p in paths.values()))
        return 0
    if args.bench == "live":
        from edmm.bench.live import LiveBenchConfig, run_live_bench

        lcfg = LiveBenchConfig(model=args.model, tokenizer=args.tokenizer, device=args.device,
                               url=args.url,
                               contexts=args.contexts, result_tokens=args.result_tokens,
                               insert_fraction=args.insert_fraction, iterations=args.iterations,
                               warmup=args.warmup, tool_duration_s=args.tool_duration,
                               resume_tokens=args.resume_tokens,
                               server_args=tuple(args.server_arg))
        paths = run_live_bench(lcfg, args.out or default_out_dir(
            _device_tag(args.device.startswith("cuda"))))
        print(Path(paths["md"]).read_text())
        print("wrote " + ", ".join(str(p) for p in paths.values()))
        return 0
    out = args.out or default_out_dir(_device_tag(args.device.startswith("cuda")))
    if args.only != "model":
        from edmm.bench.agent import AgentBenchConfig, run_agent_bench

        acfg = AgentBenchConfig(model=args.model, device=args.device, dtype=args.dtype,
                                contexts=args.contexts, result_tokens=args.result_tokens,
                                insert_fraction=args.insert_fraction, iterations=args.repeats,
                                enforce_eager=args.eager, attention=args.attention[0])
        print(Path(run_agent_bench(acfg, out)["md"]).read_text())
        from edmm.bench.agent_peer import plot_groups, run_peer_bench

        if not args.no_peer:
            print(Path(run_peer_bench(acfg, out)["md"]).read_text())
        with contextlib.suppress(RuntimeError):  # no matplotlib: no plot
            print(f"plot: {plot_groups(out)}")
    if args.only != "groups":
        from edmm.bench.ttft import TTFTBenchConfig, run_ttft_bench

        tcfg = TTFTBenchConfig(model=args.model, device=args.device, dtype=args.dtype,
                               contexts=args.contexts, repeats=args.repeats,
                               full_prefill_repeats=args.full_prefill_repeats,
                               new_tokens=args.new_tokens, peer=not args.no_peer,
                               eager=args.eager, prefill_kernel=args.prefill_kernel,
                               full_prefill_chunk=args.full_prefill_chunk,
                               attentions=args.attention, decode_routes=args.decode_routes)
        print(Path(run_ttft_bench(tcfg, out)["md"]).read_text())
    print(f"wrote {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``edmm`` script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:
        return DELEGATED[argv[0]](argv[1:])
    args = build_parser().parse_args(argv)
    return COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
