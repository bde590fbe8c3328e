"""``edmm serve [MODEL]``: arguments (vLLM's ``serve`` names where they mean something here),
the checks made before the model loads, and running the app under uvicorn.

A vLLM command line carries over: ``edmm serve /models/Qwen2.5-7B-Instruct --api-key K
--max-model-len 32768 --gpu-memory-utilization 0.9 --enable-auto-tool-choice
--tool-call-parser hermes``. Each vLLM option accepted here keeps vLLM's meaning (its help
says so); every other ``vllm serve`` option is refused with one line naming it
(`edmm.server.vllm_flags`). Every error of the command line, the model reference, the device
or the engine's configuration is one line and exit status 2, never a traceback.

The defaults are the policy the benchmarks measure as ``edmm`` (`edmm.bench.agents.policies`):
cost-based retention, host offload of paused sessions' KV (sized from the machine's available
memory, capped by ``--kv-offload-max-gib``), prefetch, template, streamed and predicted
speculation with the gate, program-level admission.

The top-level CLI calls `main` with the arguments after ``serve``.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from edmm.agent import AgentConfig
from edmm.agent.gate import SpeculationGate
from edmm.agent.retention import RETENTION_POLICIES
from edmm.agent.speculation import SPECULATION_SOURCES
from edmm.agent.types import ADMISSION_ORDERS
from edmm.argparsing import ArgumentParser, float_at_least, int_at_least, int_list, resolve_device
from edmm.engine.kv_policy import CACHE_POLICIES
from edmm.model.kv_quant import KV_CACHE_DTYPES
from edmm.model.loader import LOAD_FORMATS
from edmm.server.collector import raise_threshold
from edmm.server.http_guard import DEFAULT_MAX_BODY_BYTES
from edmm.server.read_timeouts import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, read_timeout_protocol
from edmm.server.shutdown import DEFAULT_SHUTDOWN_TIMEOUT_S
from edmm.server.state import (
    DEFAULT_MAX_AWAITING_PER_KEY,
    DEFAULT_MAX_SESSIONS_PER_KEY,
    DEFAULT_MAX_TOOL_OUTPUT_BYTES,
    OFFLOAD_SHARE,
    TINY_MODEL_NAME,
    ServerConfig,
    ServerState,
)
from edmm.server.vllm_flags import vllm_option

logger = logging.getLogger("edmm.serve")
# The GIL switch interval of a serving process (Python's default: 5 ms); a thread waiting for
# the GIL waits about this long when another thread runs Python (measured on a busy thread:
# an event-loop wake-up of 8 ms median at 5 ms, 0.25 ms at 0.2 ms).
SWITCH_INTERVAL_S = 0.0002
# Host memory for paused sessions' KV by default: `OFFLOAD_SHARE` of the memory available at
# start-up, at most --kv-offload-max-gib (the agents bench caps its offload at 32 GiB too).
DEFAULT_OFFLOAD_CAP_GIB = 32.0
API_KEY_ENV = ("EDMM_API_KEY", "VLLM_API_KEY")
# vLLM's --dtype names -> torch's (None: the model config's).
DTYPES = {"auto": None, "half": "float16", "float16": "float16", "bfloat16": "bfloat16",
          "float": "float32", "float32": "float32"}
TOOL_CALL_PARSERS = ("hermes",)  # the `<tool_call>` JSON blocks of edmm.server.tool_parser
# vLLM's --kv-cache-dtype names -> EDMM's (`edmm.model.kv_quant.KV_CACHE_DTYPES`)
KV_CACHE_ALIASES = {"bfloat16": "bf16", "fp8_e4m3": "fp8"}
# Engine field names in configuration errors -> the options that set them.
_FLAGS = {"max_model_len": "--max-model-len", "num_pages": "--num-pages",
          "max_num_seqs": "--max-num-seqs", "num_slots": "--num-slots",
          "max_num_batched_tokens": "--max-num-batched-tokens",
          "gpu_memory_utilization": "--gpu-memory-utilization",
          "tensor_parallel_size": "--tensor-parallel-size", "dtype": "--dtype",
          "kv_offload_bytes": "--kv-offload-gib"}


def human_int(text: str) -> int:
    """An argparse type, vLLM's human-readable integers: ``2048``, ``32k`` (32,000), ``32K``
    (32,768), ``1m``/``1M``, ``1g``/``1G``."""
    units = {"k": 10**3, "K": 2**10, "m": 10**6, "M": 2**20, "g": 10**9, "G": 2**30}
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an integer (e.g. 2048, 32k, 32K), got {text!r}") from None


def _positive_human_int(text: str) -> int:
    value = human_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _max_model_len(text: str) -> int | None:
    """``auto`` or -1: the model's context; else a human-readable integer >= 1."""
    if text in ("auto", "-1"):
        return None
    return _positive_human_int(text)


def _utilization(text: str) -> float:
    value = float_at_least(0.0)(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {value:g}")
    return value


def _only_one(text: str) -> int:
    value = int_at_least(1)(text)
    if value != 1:
        raise argparse.ArgumentTypeError(f"only 1 is supported here, got {value}")
    return value


def _offload_gib(text: str) -> float | None:
    """``auto`` (None): sized from the machine's available memory; else GiB (0: off)."""
    return None if text == "auto" else float_at_least(0.0)(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``serve`` options to ``parser``."""
    _model_arguments(parser)
    _server_arguments(parser)
    _engine_arguments(parser)
    _agent_arguments(parser)
    _limit_arguments(parser)


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="a local HF model folder, or a preset name (random weights, "
                             "with --load-format dummy); nothing is downloaded (default: "
                             f"{TINY_MODEL_NAME}, the embedded tool model)")
    parser.add_argument("--model", default=None, help="the model, as MODEL (vLLM's option)")
    parser.add_argument("--tokenizer", default=None,
                        help="local tokenizer folder (default: the model folder's; a preset "
                             "has none)")
    parser.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                        help="auto/safetensors: the folder's weights; dummy: random weights "
                             "(a folder's config.json suffices; needed to serve a preset)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="auto",
                        help="weights and KV dtype (auto: the model config's)")
    parser.add_argument("--kv-cache-dtype", choices=(*KV_CACHE_DTYPES, *KV_CACHE_ALIASES),
                        default="auto",
                        help="KV cache storage: auto (the weights' dtype), bf16 (bfloat16), or "
                             "fp8 (fp8_e4m3: e4m3 with per-head scales calibrated at start-up, "
                             "twice the tokens of bf16)")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the names clients may send, the first one in responses "
                             f"(default: {TINY_MODEL_NAME}, or the folder's or preset's name)")
    parser.add_argument("--chat-template", default=None,
                        help="a chat template file, or the template itself, instead of the "
                             "tokenizer's")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="accepted (vLLM's option): no model code ever runs here, only "
                             "EDMM's own architectures")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the sampler for requests without a seed of their own")


def _server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int_at_least(1), default=8000, help="TCP port to bind")
    parser.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                        help="require one of these keys as 'Authorization: Bearer KEY' on "
                             "/v1 (401 otherwise); default: $EDMM_API_KEY, else "
                             "$VLLM_API_KEY, else none")
    parser.add_argument("--shutdown-timeout", type=float_at_least(0.0),
                        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                        help="on SIGTERM or Ctrl-C, seconds running requests get to finish "
                             "(new ones are refused); the rest then end with an error event "
                             "(0: at once)")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug", "trace"),
                        help="uvicorn's log level")
    parser.add_argument("--disable-uvicorn-access-log", action="store_true",
                        help="no access log line per request")
    parser.add_argument("--log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug"),
                        help="EDMM's log level")
    parser.add_argument("--ssl-keyfile", default=None, help="TLS key file (with --ssl-certfile)")
    parser.add_argument("--ssl-certfile", default=None, help="TLS certificate file")
    parser.add_argument("--ssl-ca-certs", default=None, help="CA certificates file")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="accepted (vLLM's option): tool calls are always parsed here")
    parser.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default="hermes",
                        help="the tool-call format parsed from replies (<tool_call> JSON "
                             "blocks)")
    parser.add_argument("--no-grammar-fast-forward", action="store_true",
                        help="decode every token a grammar forces (a forced tool call's "
                             "wrapper and name) one step each, instead of computing the "
                             "forced start with the prompt (an ablation)")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="as --allow-client-chat-template (vLLM's name)")
    parser.add_argument("--enable-force-include-usage", action="store_true",
                        help="every stream ends with a usage chunk, asked for or not")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="accepted: usage always has prompt_tokens_details here")
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="accepted: no periodic stats are logged here (see /metrics)")
    parser.add_argument("--disable-fastapi-docs", action="store_true",
                        help="accepted: the API docs are off unless --api-docs")
    parser.add_argument("--vllm-metrics", action="store_true",
                        help="/metrics also has vLLM's names (vllm:time_to_first_token_seconds "
                             "...), so dashboards made for vLLM work")


def _engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine sizes (`EngineConfig`; a benchmark sets them to match an in-process run)."""
    parser.add_argument("--device", default="auto",
                        help="auto (cuda if torch sees a GPU, else cpu), cpu or cuda[:N]")
    parser.add_argument("--max-model-len", type=_max_model_len, default=None,
                        help="most tokens of a sequence, prompt and output (e.g. 32768, 32k; "
                             "default, auto: the model's context)")
    parser.add_argument("--gpu-memory-utilization", type=_utilization, default=0.9,
                        help="share of the GPU's memory the server may fill (weights, KV)")
    parser.add_argument("--max-num-seqs", type=int_at_least(1), default=None,
                        help="most sequences running at once (default: 256 on GPUs of 70 GiB "
                             "and more, 128 below, 16 on the CPU)")
    parser.add_argument("--max-num-batched-tokens", type=_positive_human_int, default=None,
                        help="the engine's token budget per step (default: 2048)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="reuse cached prefixes' KV (agent sessions need it: "
                             "--no-enable-prefix-caching needs --no-execution-aware)")
    parser.add_argument("--enable-chunked-prefill", action="store_true",
                        help="accepted: prefills are always chunked here")
    parser.add_argument("--block-size", type=int_at_least(1), default=None,
                        help="tokens per block of the prefix index (KV pages are the VMM's "
                             "2 MiB pages here; default: 16)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="CUDA: no CUDA graphs, reference attention")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=None,
                        help="launch each step while the device computes the previous one "
                             "(default: on where steps replay CUDA graphs)")
    parser.add_argument("--prefix-spares", action=argparse.BooleanOptionalAction, default=None,
                        help="map a spare branch of a prefix that requests keep branching from "
                             "(a shared system prompt) during a step, so the next one maps no "
                             "page at admission (default: on)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int_at_least(1), default=1,
                        help="GPUs (or CPU processes) to split the model over, one process "
                             "each")
    parser.add_argument("--pipeline-parallel-size", "-pp", type=_only_one, default=1,
                        help="accepted: 1 only")
    parser.add_argument("--data-parallel-size", "-dp", type=_only_one, default=1,
                        help="accepted: 1 only")
    parser.add_argument("--num-pages", type=int_at_least(1), default=None,
                        help="physical KV pages (default: sized from the GPU's free memory "
                             "and --gpu-memory-utilization, or every slot at --max-model-len "
                             "on the CPU)")
    parser.add_argument("--num-slots", type=int_at_least(1), default=None,
                        help="KV slots: sequences, retained sessions and speculation branches "
                             "(default: twice --max-num-seqs)")
    parser.add_argument("--kv-offload-gib", "--kv-offloading-size", type=_offload_gib,
                        default=None, metavar="GIB",
                        help="host memory for paused sessions' KV under pressure, pinned at "
                             "start-up (~0.7 s per GiB on an H200 host); 0: off; default, "
                             f"auto: {OFFLOAD_SHARE:g} of the available memory, at most "
                             "--kv-offload-max-gib (off with --no-execution-aware or "
                             "several ranks)")
    parser.add_argument("--kv-offload-max-gib", type=float_at_least(0.0),
                        default=DEFAULT_OFFLOAD_CAP_GIB,
                        help="the most host memory the automatic offload size takes")
    parser.add_argument("--kv-offloading-backend", choices=("native",), default="native",
                        help="accepted: the host tier is EDMM's own")
    parser.add_argument("--cuda-graph-sizes", type=int_list, default=None,
                        help="token counts of the captured mixed-batch CUDA graphs, "
                             "comma-separated (default: the engine's)")
    parser.add_argument("--host-page-size", type=int_at_least(4096), default=None,
                        help="page size of the host twin in bytes (CPU; default: the "
                             "engine's)")
    parser.add_argument("--busy-spec-tokens", type=int_at_least(0), default=None,
                        help="speculative tokens riding along busy steps (default: 0 with "
                             "CUDA graphs, 64 without)")
    parser.add_argument("--no-spec-in-padding", action="store_true",
                        help="CUDA: speculation never fills the padding of busy steps")
    parser.add_argument("--kv-cache-policy", choices=sorted(CACHE_POLICIES), default=None,
                        help="eviction of cached KV and what goes to the host: sessions, apc "
                             "(tail-first, as vLLM), blocks (apc + every block written "
                             "through, as LMCache), tiered (paused sessions by session, the "
                             "rest as apc with evicted blocks to the host) (default: the "
                             "engine's)")


def _agent_arguments(parser: argparse.ArgumentParser) -> None:
    """The agent layer's policy (`AgentConfig`; default: the benchmarks' ``edmm``, or EDMM off
    with ``--no-execution-aware``); each option overrides that one field."""
    default, off = AgentConfig(), AgentConfig.off()
    parser.add_argument("--no-execution-aware", action="store_true",
                        help="EDMM off: the same sessions with plain prefix caching (LRU "
                             "retention, no speculation, arrival order, no offload)")
    parser.add_argument("--retention", choices=sorted(RETENTION_POLICIES), default=None,
                        help=f"retention of paused sessions' KV (default: {default.retention}; "
                             f"{off.retention} with --no-execution-aware)")
    parser.add_argument("--speculation", type=_sources, default=None,
                        help="speculation sources, comma-separated, or 'none' (default: "
                             f"{','.join(default.speculation)}; none with "
                             "--no-execution-aware)")
    parser.add_argument("--speculation-gate", action=argparse.BooleanOptionalAction,
                        default=None,
                        help="start a speculation branch only where its expected saving "
                             "exceeds its cost (default: on; off with --no-execution-aware)")
    parser.add_argument("--admission", choices=ADMISSION_ORDERS, default=None,
                        help=f"order of waiting turns (default: {default.admission}; "
                             f"{off.admission} with --no-execution-aware)")
    parser.add_argument("--no-prefetch", action="store_true",
                        help="offloaded KV comes back at the resume only, not ahead of it")
    parser.add_argument("--no-speculate-in-place", action="store_true",
                        help="every speculation in a branch of its own, none extending the "
                             "session's own slot")
    parser.add_argument("--no-learned-durations", action="store_true",
                        help="expect a tool window to last only its tool's declared duration "
                             "or the client's, never one learned from earlier windows")
    parser.add_argument("--no-pooled-gate", action="store_true",
                        help="the speculation gate judges a branch on its session's own "
                             "history alone, not pooled across sessions per source and tool")
    parser.add_argument("--prefetch-lead-s", type=float_at_least(0.0), default=None,
                        help="how long before a tool's expected return offloaded KV comes "
                             f"back (default: {default.prefetch_lead_s:g})")
    parser.add_argument("--tool-timeout-s", type=float_at_least(0.0), default=None,
                        help="seconds a session may await its tool results (default: "
                             f"{default.tool_timeout_s:g})")
    for flag, bound, what in (
            ("--max-sessions-per-key", DEFAULT_MAX_SESSIONS_PER_KEY, "sessions"),
            ("--max-awaiting-per-key", DEFAULT_MAX_AWAITING_PER_KEY, "sessions awaiting tools"),
            ("--max-kv-pages-per-key", 0, "KV pages")):
        parser.add_argument(flag, type=int_at_least(0), default=bound,
                            help=f"{what} one API key may hold (429 past it; 0: no bound; "
                                 "default %(default)s)")


def _limit_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allow-client-chat-template", action="store_true",
                        help="accept a chat template in chat_template_kwargs (rendered in a "
                             "sandbox with a time and size limit; default: refused, 400)")
    parser.add_argument("--max-body-mib", type=float, default=DEFAULT_MAX_BODY_BYTES / 2**20,
                        help="largest request body in MiB (413 past it)")
    parser.add_argument("--max-tool-output-mib", type=float,
                        default=DEFAULT_MAX_TOOL_OUTPUT_BYTES / 2**20,
                        help="largest chunk of one tool_output call in MiB (413 past it)")
    parser.add_argument("--header-timeout-s", type=float_at_least(0.001),
                        default=HEADER_TIMEOUT_S,
                        help="seconds a request's headers may take to arrive (the "
                             "connection is closed past it)")
    parser.add_argument("--body-timeout-s", type=float_at_least(0.001),
                        default=BODY_TIMEOUT_S,
                        help="seconds a request's body may pause (the connection is closed "
                             "past it)")
    parser.add_argument("--cache-salt-per-key", action="store_true",
                        help="share cached prefixes only among requests of one API key "
                             "(usage.cached_tokens then tells nothing across clients)")
    parser.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                        help="Host header names to answer ('*': any; default: the --host "
                             "address, with localhost when it is loopback)")
    parser.add_argument("--api-docs", action="store_true",
                        help="serve /docs, /redoc and /openapi.json (default: off)")


def _sources(text: str) -> tuple[str, ...]:
    names = () if text == "none" else tuple(n for n in text.split(",") if n)
    unknown = [n for n in names if n not in SPECULATION_SOURCES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown speculation source(s) {unknown}; known: "
            f"{sorted(SPECULATION_SOURCES)} or 'none'")
    return names


class ServeParser(ArgumentParser):
    """The ``serve`` parser: a ``vllm serve`` option this server does not take is one line
    naming it (before argparse reads the rest)."""

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        argv = list(sys.argv[1:] if args is None else args)
        for token in argv:
            if token == "--":
                break
            name = vllm_option(token) if token.startswith("-") else None
            if name is not None and name not in self._option_string_actions:
                self.error(f"{name}: a vllm serve option that has no meaning in edmm serve")
        return super().parse_args(argv, namespace)


def build_parser() -> argparse.ArgumentParser:
    """A standalone parser of the ``serve`` options."""
    parser = ServeParser(prog="edmm serve", allow_abbrev=False,
                         description="OpenAI-compatible server with agent sessions, started "
                                     "as vllm serve is (binds 127.0.0.1 unless --host says "
                                     "otherwise)")
    add_arguments(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The `ServerConfig` of parsed ``serve`` options (``auto`` device resolved; nothing is
    checked against the machine: see `check_config`)."""
    execution_aware = not args.no_execution_aware
    names = args.served_model_name or []
    model = model_ref(args)
    # vLLM serves a model under MODEL as given; here its folder's name is the reply's name,
    # and MODEL as given is accepted too
    aliases = tuple(names[1:]) if names else (
        (model,) if model is not None and Path(model).name != model else ())
    return ServerConfig(
        model=model, device=_device(args.device), host=args.host, port=args.port,
        served_model_name=names[0] if names else None, model_aliases=aliases,
        execution_aware=execution_aware, engine=_engine_fields(args),
        agent=_agent_fields(args, execution_aware),
        kv_offload_cap_bytes=(int(args.kv_offload_max_gib * 2**30)
                              if args.kv_offload_gib is None and execution_aware
                              and args.tensor_parallel_size == 1 else None),
        allow_client_chat_template=(args.allow_client_chat_template
                                    or args.trust_request_chat_template),
        chat_template=args.chat_template,
        grammar_fast_forward=not args.no_grammar_fast_forward,
        max_body_bytes=int(args.max_body_mib * 2**20),
        max_tool_output_bytes=int(args.max_tool_output_mib * 2**20),
        max_sessions_per_key=args.max_sessions_per_key or None,
        max_awaiting_per_key=args.max_awaiting_per_key or None,
        max_kv_pages_per_key=args.max_kv_pages_per_key or None,
        header_timeout_s=args.header_timeout_s, body_timeout_s=args.body_timeout_s,
        cache_salt_per_key=args.cache_salt_per_key, allowed_hosts=args.allowed_hosts,
        api_docs=args.api_docs and not args.disable_fastapi_docs,
        api_keys=_api_keys(args.api_key), force_include_usage=args.enable_force_include_usage,
        vllm_metrics=args.vllm_metrics, shutdown_timeout_s=args.shutdown_timeout,
        **({} if args.tool_timeout_s is None else {"tool_timeout_s": args.tool_timeout_s}))


def model_ref(args: argparse.Namespace) -> str | None:
    """The model named by MODEL or ``--model`` (None, or ``edmm-tiny``: the embedded one)."""
    ref = args.model if args.model is not None else args.model_tag
    return None if ref in (None, TINY_MODEL_NAME) else ref


def _device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _engine_fields(args: argparse.Namespace) -> dict[str, Any]:
    engine: dict[str, Any] = {}
    for flag, name in (("tokenizer", "tokenizer"), ("max_model_len", "max_model_len"),
                       ("num_pages", "num_pages"), ("max_num_seqs", "max_num_seqs"),
                       ("num_slots", "num_slots"),
                       ("max_num_batched_tokens", "max_num_batched_tokens"),
                       ("cuda_graph_sizes", "cuda_graph_token_sizes"),
                       ("host_page_size", "host_page_size"),
                       ("busy_spec_tokens", "speculative_tokens_when_busy"),
                       ("block_size", "prefix_block_size"),
                       ("async_scheduling", "async_scheduling"),
                       ("prefix_spares", "prefix_spares"),
                       ("kv_cache_policy", "kv_cache_policy")):
        if getattr(args, flag) is not None:
            engine[name] = getattr(args, flag)
    if DTYPES[args.dtype] is not None:
        engine["dtype"] = DTYPES[args.dtype]
    if args.kv_cache_dtype != "auto":
        engine["kv_cache_dtype"] = KV_CACHE_ALIASES.get(args.kv_cache_dtype, args.kv_cache_dtype)
    for flag, name, default in (("tensor_parallel_size", "tensor_parallel_size", 1),
                                ("gpu_memory_utilization", "gpu_memory_utilization", 0.9),
                                ("seed", "seed", 0), ("load_format", "load_format", "auto"),
                                ("enable_prefix_caching", "enable_prefix_caching", True),
                                ("enforce_eager", "enforce_eager", False)):
        if getattr(args, flag) != default:
            engine[name] = getattr(args, flag)
    if args.kv_offload_gib is not None:
        engine["kv_offload_bytes"] = int(args.kv_offload_gib * 2**30)
    if args.no_spec_in_padding:
        engine["speculation_fills_padding"] = False
    return engine


def _agent_fields(args: argparse.Namespace, execution_aware: bool) -> dict[str, Any]:
    agent: dict[str, Any] = {}
    for name in ("retention", "speculation", "admission", "prefetch_lead_s"):
        if getattr(args, name) is not None:
            agent[name] = getattr(args, name)
    if args.no_prefetch:
        agent["prefetch"] = False
    if args.no_speculate_in_place:
        agent["speculate_in_place"] = False
    if args.no_learned_durations:
        agent["learn_tool_durations"] = False
    gate = args.speculation_gate if args.speculation_gate is not None else execution_aware
    if gate:
        agent["speculation_gate"] = SpeculationGate(pool_sessions=not args.no_pooled_gate)
    return agent


def _api_keys(keys: list[str] | None) -> tuple[str, ...]:
    if keys:
        return tuple(keys)
    for name in API_KEY_ENV:
        if os.environ.get(name):
            return (os.environ[name],)
    return ()


# ---------------------------------------------------------------------------- checks


class ConfigurationError(ValueError):
    """The command line names something this machine or EDMM cannot serve (one line)."""


def check_config(args: argparse.Namespace, config: ServerConfig) -> None:
    """What can be checked before the model loads: the model reference, the device, the
    options that go together (`ConfigurationError` naming the option)."""
    check_model_ref(config.model, args.load_format)
    if args.max_model_len is not None:
        check_context(config.model, args.max_model_len)
    if args.model is not None and args.model_tag is not None and args.model != args.model_tag:
        raise ConfigurationError(f"MODEL {args.model_tag!r} and --model {args.model!r} differ; "
                                 "give one")
    if not args.enable_prefix_caching and config.execution_aware:
        raise ConfigurationError("--no-enable-prefix-caching needs --no-execution-aware: agent "
                                 "sessions keep their KV as prefix-cache entries")
    if args.chat_template is not None:
        config.chat_template = chat_template_text(args.chat_template)
    for flag in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(args, flag)
        if path is not None and not Path(path).is_file():
            raise ConfigurationError(f"--{flag.replace('_', '-')} {path}: no such file")


def check_model_ref(model: str | None, load_format: str) -> None:
    """`ConfigurationError` unless ``model`` is the embedded model, a model folder, or a
    preset with ``load_format`` dummy: a hub id, a missing folder or a preset without it is
    one line saying what to do."""
    from edmm.model import PRESETS

    if model is None or Path(model).is_dir():
        if model is not None and not (Path(model) / "config.json").is_file():
            raise ConfigurationError(f"MODEL {model}: the folder has no config.json (a "
                                     "Hugging Face model folder has)")
        return
    if model.lower() in PRESETS:
        if load_format == "dummy":
            return
        hint = (f"; the embedded tool model, with weights and a chat template, is "
                f"{TINY_MODEL_NAME} (the default)") if model.lower() == "tiny" else ""
        raise ConfigurationError(
            f"MODEL {model}: a preset has random weights and no tokenizer (nothing is "
            f"downloaded); pass --load-format dummy to serve it anyway, or a model folder"
            f"{hint}")
    if _looks_like_hub_id(model):
        raise ConfigurationError(
            f"MODEL {model}: a Hugging Face hub id; edmm serve downloads nothing: download the "
            f"model (e.g. huggingface-cli download {model} --local-dir DIR) and pass DIR")
    raise ConfigurationError(f"MODEL {model}: no such folder, and not a preset (presets: "
                             f"{', '.join(sorted(PRESETS))}; or {TINY_MODEL_NAME})")


def check_context(model: str | None, max_model_len: int) -> None:
    """`ConfigurationError` when ``--max-model-len`` exceeds the model's positions (read from
    its config, before it loads)."""
    from edmm.model import PRESETS, ModelConfig
    from edmm.model.rope import default_max_positions
    from edmm.model.tiny import default_model

    if model is not None and model.lower() in PRESETS and not Path(model).is_dir():
        cfg = PRESETS[model.lower()]
    else:
        cfg = ModelConfig.from_folder(default_model() if model is None else Path(model))
    limit = default_max_positions(cfg)
    if max_model_len > limit:
        raise ConfigurationError(f"--max-model-len {max_model_len}: the model has {limit} "
                                 "positions")


def _looks_like_hub_id(model: str) -> bool:
    """``org/name``: one slash, no path start (``/``, ``.``, ``~``)."""
    return model.count("/") == 1 and not model.startswith(("/", ".", "~")) and all(
        model.split("/"))


def chat_template_text(value: str) -> str:
    """``--chat-template``: the file's text if it names a file, else the template itself
    (vLLM's rule: a value with no Jinja in it must be a file)."""
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{" not in value:
        raise ConfigurationError(f"--chat-template {value}: no such file (and not a template)")
    return value


def check_device(parser: argparse.ArgumentParser, device: str) -> None:
    """``--device``: cpu, or a CUDA device torch sees (an error line otherwise)."""
    resolve_device(parser, device)


# ---------------------------------------------------------------------------- serving


@dataclass(frozen=True)
class UvicornOptions:
    """How uvicorn runs the app (not the server's behaviour: `ServerConfig`)."""

    log_level: str = "info"
    access_log: bool = True
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None

    @classmethod
    def of(cls, args: argparse.Namespace) -> UvicornOptions:
        """The options of parsed ``serve`` arguments."""
        return cls(args.uvicorn_log_level, not args.disable_uvicorn_access_log,
                   args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs)


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
    long, how long it took, and what start-up made (`describe`)."""
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
    for line in state.describe():
        logger.info("%s", line)
    return state


def serve(config: ServerConfig, log_level: str = "info",
          options: UvicornOptions | None = None) -> None:
    """Check the port, load the model and serve until SIGTERM or Ctrl-C, then drain
    (`edmm.server.shutdown`) and release the engine and every process it started.

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
    from edmm.server.app import build_app
    from edmm.server.children import clean_stale_semaphores
    from edmm.server.shutdown import DrainingServer

    options = options or UvicornOptions(log_level)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cleaned = clean_stale_semaphores()
    if cleaned:
        logger.info("removed %d semaphore(s) left in /dev/shm by EDMM processes that died",
                    cleaned)
    check_port_free(config.host, config.port)
    state = load_state(config)
    app = build_app(state)
    freeze_startup_objects()
    raise_threshold()
    scheme = "https" if options.ssl_certfile else "http"
    ready = (f"serving {config.model_name} at {scheme}://{config.host}:{config.port}/v1 "
             "(Ctrl-C or SIGTERM stops)")
    try:
        DrainingServer.run_app(app, state, ready_message=ready, host=config.host, port=config.port,
                               log_level=options.log_level, access_log=options.access_log,
                               ssl_keyfile=options.ssl_keyfile,
                               ssl_certfile=options.ssl_certfile,
                               ssl_ca_certs=options.ssl_ca_certs,
                               http=read_timeout_protocol(config.header_timeout_s,
                                                          config.body_timeout_s))
    finally:
        state.close()


def freeze_startup_objects() -> int:
    """Collect start-up's garbage, then move every object alive to the collector's permanent
    generation (`gc.freeze`); return how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def run(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    """Serve with parsed ``serve`` options; the exit status. A configuration error (the
    model, the device, the port, the engine's sizes) is one line and status 2 with a
    ``parser``, raised without one."""
    try:
        config = config_from_args(args)
        if parser is not None:
            check_device(parser, args.device)
        check_config(args, config)
        serve(config, args.log_level, UvicornOptions.of(args))
    except PortInUseError as e:
        _fail(parser, e, f"--port {args.port}: {e.strerror}")
    except ConfigurationError as e:
        _fail(parser, e, str(e))
    except Exception as e:
        if not _is_config_error(e):
            raise
        _fail(parser, e, _with_flags(str(e)))
    return 0


def _is_config_error(e: Exception) -> bool:
    """An error of what the command line asked for (the model's files, the engine's sizes),
    not a bug."""
    from edmm.engine.errors import EngineConfigError
    from edmm.model.errors import ModelError

    return isinstance(e, EngineConfigError | ModelError)


def _with_flags(message: str) -> str:
    """``message`` with the engine's field names replaced by the options that set them."""
    for name, flag in _FLAGS.items():
        message = message.replace(f"{name}=", f"{flag} ").replace(f"{name} ", f"{flag} ")
    return message


def _fail(parser: argparse.ArgumentParser | None, error: Exception, line: str) -> NoReturn:
    if parser is None:
        raise error
    parser.error(line.replace("\n", " "))


def main(argv: Sequence[str] | None = None) -> int:
    """``edmm serve [MODEL] [options]``: ``argv`` are the arguments after ``serve``."""
    parser = build_parser()
    return run(parser.parse_args(argv), parser)
