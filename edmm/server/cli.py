"""``edmm serve``: arguments, and running the app under uvicorn.

The top-level CLI wires it with `add_arguments` + `run` (or calls `main` with the arguments
after ``serve``).
"""

from __future__ import annotations

import argparse
import gc
import logging
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from edmm.agent import AgentConfig
from edmm.agent.gate import SpeculationGate
from edmm.agent.retention import RETENTION_POLICIES
from edmm.agent.speculation import SPECULATION_SOURCES
from edmm.agent.types import ADMISSION_ORDERS
from edmm.argparsing import ArgumentParser, float_at_least, int_at_least, int_list
from edmm.engine.kv_policy import CACHE_POLICIES
from edmm.server.collector import raise_threshold
from edmm.server.http_guard import DEFAULT_MAX_BODY_BYTES
from edmm.server.state import DEFAULT_MAX_TOOL_OUTPUT_BYTES, ServerConfig, ServerState

logger = logging.getLogger("edmm.serve")
# The GIL switch interval of a serving process (Python's default: 5 ms); a thread waiting for
# the GIL waits about this long when another thread runs Python (measured on a busy thread:
# an event-loop wake-up of 8 ms median at 5 ms, 0.25 ms at 0.2 ms).
SWITCH_INTERVAL_S = 0.0002


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``serve`` options to ``parser``."""
    parser.add_argument("--model", default=None,
                        help="local HF folder or preset name (default: the embedded tool model, "
                             "a tiny model trained for the tool-call format)")
    parser.add_argument("--tokenizer", default=None,
                        help="local tokenizer folder (default: the model folder's; a preset with "
                             "random weights has none)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int_at_least(1), default=8000, help="TCP port to bind")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send (default: edmm-tiny / folder name)")
    parser.add_argument("--dtype", default=None,
                        help="weights and KV dtype (default: the model config's)")
    parser.add_argument("--max-model-len", type=int_at_least(1), default=None,
                        help="most tokens of a sequence, prompt and output (default: the "
                             "model's context)")
    parser.add_argument("--num-pages", type=int_at_least(1), default=None,
                        help="physical KV pages (default: sized from the GPU's free memory, "
                             "or every slot at --max-model-len on the CPU)")
    parser.add_argument("--max-num-seqs", type=int_at_least(1), default=None,
                        help="most sequences running at once (default: the engine's)")
    parser.add_argument("--tensor-parallel-size", type=int_at_least(1), default=None,
                        help="GPUs (or CPU processes) to split the model over, one process "
                             "each (default: 1)")
    parser.add_argument("--kv-offload-gib", type=float_at_least(0.0), default=None,
                        help="host memory for paused sessions' KV under pressure, pinned at "
                             "start-up (~0.7 s per GiB on an H200 host; default: off)")
    parser.add_argument("--no-execution-aware", action="store_true",
                        help="plain engine: prefix caching only, no agent sessions")
    _engine_arguments(parser)
    _agent_arguments(parser)
    parser.add_argument("--allow-client-chat-template", action="store_true",
                        help="accept a chat template in chat_template_kwargs (rendered in a "
                             "sandbox with a time and size limit; default: refused, 400)")
    parser.add_argument("--max-body-mib", type=float, default=DEFAULT_MAX_BODY_BYTES / 2**20,
                        help="largest request body in MiB (413 past it; default %(default)g)")
    parser.add_argument("--max-tool-output-mib", type=float,
                        default=DEFAULT_MAX_TOOL_OUTPUT_BYTES / 2**20,
                        help="largest chunk of one tool_output call in MiB (413 past it; "
                             "default %(default)g)")
    parser.add_argument("--cache-salt-per-key", action="store_true",
                        help="share cached prefixes only among requests of one API key "
                             "(usage.cached_tokens then tells nothing across clients)")
    parser.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                        help="Host header names to answer ('*': any; default: the --host "
                             "address, with localhost when it is loopback)")
    parser.add_argument("--api-docs", action="store_true",
                        help="serve /docs, /redoc and /openapi.json (default: off)")
    parser.add_argument("--log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug"),
                        help="server log level")


def _engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine sizes a benchmark sets to match an in-process run (`EngineConfig`)."""
    parser.add_argument("--num-slots", type=int_at_least(1), default=None,
                        help="KV slots (sequences, retained sessions and speculation "
                             "branches; default: the engine's)")
    parser.add_argument("--max-num-batched-tokens", type=int_at_least(1), default=None,
                        help="the engine's token budget per step (default: the engine's)")
    parser.add_argument("--cuda-graph-sizes", type=int_list, default=None,
                        help="token counts of the captured mixed-batch CUDA graphs, "
                             "comma-separated (default: the engine's)")
    parser.add_argument("--host-page-size", type=int_at_least(4096), default=None,
                        help="page size of the host twin in bytes (CPU; default: the "
                             "engine's)")
    parser.add_argument("--busy-spec-tokens", type=int_at_least(0), default=None,
                        help="speculative tokens riding along busy steps (default: the "
                             "engine's)")
    parser.add_argument("--no-spec-in-padding", action="store_true",
                        help="CUDA: speculation never fills the padding of busy steps")
    parser.add_argument("--kv-cache-policy", choices=sorted(CACHE_POLICIES), default=None,
                        help="eviction of cached KV and what goes to the host: sessions, apc "
                             "(tail-first, as vLLM), blocks (apc + every block written "
                             "through, as LMCache) (default: the engine's)")


def _agent_arguments(parser: argparse.ArgumentParser) -> None:
    """The agent layer's policy (`AgentConfig`; default: EDMM's, or EDMM off with
    ``--no-execution-aware``); each option overrides that one field."""
    parser.add_argument("--retention", choices=sorted(RETENTION_POLICIES),
                        default=None, help="retention of paused sessions' KV")
    parser.add_argument("--speculation", type=_sources, default=None,
                        help="speculation sources, comma-separated, or 'none'")
    parser.add_argument("--admission", choices=ADMISSION_ORDERS, default=None,
                        help="order of waiting turns")
    parser.add_argument("--no-prefetch", action="store_true",
                        help="offloaded KV comes back at the resume only, not ahead of it")
    parser.add_argument("--prefetch-lead-s", type=float_at_least(0.0), default=None,
                        help="how long before a tool's expected return offloaded KV comes "
                             "back")
    parser.add_argument("--speculation-gate", action="store_true",
                        help="start a speculation branch only where its expected saving "
                             "exceeds its cost")
    parser.add_argument("--tool-timeout-s", type=float_at_least(0.0), default=None,
                        help="seconds a session may await its tool results (default: "
                             f"{AgentConfig.tool_timeout_s:g})")


def _sources(text: str) -> tuple[str, ...]:
    names = () if text == "none" else tuple(n for n in text.split(",") if n)
    unknown = [n for n in names if n not in SPECULATION_SOURCES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown speculation source(s) {unknown}; known: "
            f"{sorted(SPECULATION_SOURCES)} or 'none'")
    return names


def build_parser() -> argparse.ArgumentParser:
    """A standalone parser of the ``serve`` options."""
    parser = ArgumentParser(prog="edmm serve",
                            description="OpenAI-compatible server with agent sessions "
                                        "(binds 127.0.0.1 unless --host says otherwise)")
    add_arguments(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The `ServerConfig` of parsed ``serve`` options."""
    engine: dict[str, Any] = {}
    for name in ("tokenizer", "dtype", "max_model_len", "num_pages", "max_num_seqs",
                 "tensor_parallel_size"):
        if getattr(args, name) is not None:
            engine[name] = getattr(args, name)
    if args.kv_offload_gib is not None:
        engine["kv_offload_bytes"] = int(args.kv_offload_gib * 2**30)
    for flag, name in (("num_slots", "num_slots"),
                       ("max_num_batched_tokens", "max_num_batched_tokens"),
                       ("cuda_graph_sizes", "cuda_graph_token_sizes"),
                       ("host_page_size", "host_page_size"),
                       ("busy_spec_tokens", "speculative_tokens_when_busy"),
                       ("kv_cache_policy", "kv_cache_policy")):
        if getattr(args, flag) is not None:
            engine[name] = getattr(args, flag)
    if args.no_spec_in_padding:
        engine["speculation_fills_padding"] = False
    timeout = {} if args.tool_timeout_s is None else {"tool_timeout_s": args.tool_timeout_s}
    return ServerConfig(model=args.model, device=args.device, host=args.host, port=args.port,
                        served_model_name=args.served_model_name,
                        execution_aware=not args.no_execution_aware, engine=engine,
                        allow_client_chat_template=args.allow_client_chat_template,
                        max_body_bytes=int(args.max_body_mib * 2**20),
                        max_tool_output_bytes=int(args.max_tool_output_mib * 2**20),
                        cache_salt_per_key=args.cache_salt_per_key,
                        allowed_hosts=args.allowed_hosts, api_docs=args.api_docs,
                        agent=_agent_fields(args), **timeout)


def _agent_fields(args: argparse.Namespace) -> dict[str, Any]:
    agent: dict[str, Any] = {}
    for name in ("retention", "speculation", "admission", "prefetch_lead_s"):
        if getattr(args, name) is not None:
            agent[name] = getattr(args, name)
    if args.no_prefetch:
        agent["prefetch"] = False
    if args.speculation_gate:
        agent["speculation_gate"] = SpeculationGate()
    return agent


class PortInUseError(OSError):
    """The address ``edmm serve`` was asked to bind is taken."""


def check_port_free(host: str, port: int) -> None:
    """Raise :class:`PortInUseError` if ``host:port`` cannot be bound (checked before the model
    loads, with the same ``SO_REUSEADDR`` as uvicorn's socket)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            raise PortInUseError(e.errno, f"cannot bind {host}:{port} ({e.strerror}); "
                                          "is another server running? pick one with --port") from e


def load_state(config: ServerConfig) -> ServerState:
    """Build the server state (loads the model), logging what loads, progress while it takes
    long, and how long it took."""
    what = config.model or "the embedded tool model"
    logger.info("loading model %s on %s ...", what, config.device)
    t0 = time.perf_counter()
    done = threading.Event()

    def progress() -> None:
        while not done.wait(5.0):
            logger.info("... still loading %s (%.0f s)", what, time.perf_counter() - t0)

    ticker = threading.Thread(target=progress, name="edmm-load-progress", daemon=True)
    ticker.start()
    try:
        state = ServerState(config)
    finally:
        done.set()
        ticker.join()
    logger.info("model %s loaded in %.1f s", config.model_name, time.perf_counter() - t0)
    return state


def serve(config: ServerConfig, log_level: str = "info") -> None:
    """Check the port, load the model and serve until interrupted (Ctrl-C), then release the
    engine.

    The process's GIL switch interval is set to `SWITCH_INTERVAL_S`: the event loop, the
    tokenizing thread and the engine thread hand work to each other, and a thread woken while
    another runs Python (the engine launching a step) would otherwise wait for the GIL up to
    the default 5 ms at every hand-off.

    What start-up made (the model, tokenizer, app: a few hundred thousand objects) is frozen
    out of the garbage collector's generations (`freeze_startup_objects`): a full collection
    that falls inside a request then walks only what serving made since. The youngest
    generation's threshold is raised (`edmm.server.collector.raise_threshold`): the engine
    thread collects the young generations whenever it goes idle, so that a request seldom
    pays for walking the id lists earlier turns left young.
    """
    import uvicorn

    from edmm.server.app import build_app

    sys.setswitchinterval(SWITCH_INTERVAL_S)
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check_port_free(config.host, config.port)
    state = load_state(config)
    app = build_app(state)
    freeze_startup_objects()
    raise_threshold()
    logger.info("serving %s at http://%s:%d/v1 (Ctrl-C stops)", config.model_name,
                config.host, config.port)
    try:
        uvicorn.run(app, host=config.host, port=config.port, log_level=log_level,
                    timeout_graceful_shutdown=5)
    finally:
        state.close()


def freeze_startup_objects() -> int:
    """Collect start-up's garbage, then move every object alive to the collector's permanent
    generation (`gc.freeze`); return how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def run(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    """Serve with parsed ``serve`` options; the exit status (2: the port is taken)."""
    try:
        serve(config_from_args(args), args.log_level)
    except PortInUseError as e:
        if parser is None:
            raise
        parser.error(f"--port {args.port}: {e.strerror}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``edmm serve [options]``: ``argv`` are the options after ``serve``."""
    parser = build_parser()
    return run(parser.parse_args(argv), parser)
