"""``edmm serve``: arguments, and running the app under uvicorn.

The top-level CLI wires it with `add_arguments` + `run` (or calls `main` with the arguments
after ``serve``).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from typing import Any

from edmm.server.http_guard import DEFAULT_MAX_BODY_BYTES
from edmm.server.state import DEFAULT_MAX_TOOL_OUTPUT_BYTES, ServerConfig, ServerState


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``serve`` options to ``parser``."""
    parser.add_argument("--model", default=None,
                        help="local HF folder or preset name (default: the embedded tiny model)")
    parser.add_argument("--tokenizer", default=None,
                        help="local tokenizer folder (default: the model folder's; a preset with "
                             "random weights has none)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send (default: edmm-tiny / folder name)")
    parser.add_argument("--dtype", default=None, help="weights and KV dtype (default: model's)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--num-pages", type=int, default=None, help="physical KV pages")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--kv-offload-gib", type=float, default=None,
                        help="host memory for paused sessions' KV under pressure (default: off)")
    parser.add_argument("--no-execution-aware", action="store_true",
                        help="plain engine: prefix caching only, no agent sessions")
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
                        choices=("critical", "error", "warning", "info", "debug"))


def build_parser() -> argparse.ArgumentParser:
    """A standalone parser of the ``serve`` options."""
    parser = argparse.ArgumentParser(prog="edmm serve",
                                     description="OpenAI-compatible server with agent sessions")
    add_arguments(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The `ServerConfig` of parsed ``serve`` options."""
    engine: dict[str, Any] = {}
    for name in ("tokenizer", "dtype", "max_model_len", "num_pages", "max_num_seqs"):
        if getattr(args, name) is not None:
            engine[name] = getattr(args, name)
    if args.kv_offload_gib is not None:
        engine["kv_offload_bytes"] = int(args.kv_offload_gib * 2**30)
    return ServerConfig(model=args.model, device=args.device, host=args.host, port=args.port,
                        served_model_name=args.served_model_name,
                        execution_aware=not args.no_execution_aware, engine=engine,
                        allow_client_chat_template=args.allow_client_chat_template,
                        max_body_bytes=int(args.max_body_mib * 2**20),
                        max_tool_output_bytes=int(args.max_tool_output_mib * 2**20),
                        cache_salt_per_key=args.cache_salt_per_key,
                        allowed_hosts=args.allowed_hosts, api_docs=args.api_docs)


def serve(config: ServerConfig, log_level: str = "info") -> None:
    """Load the model and serve until interrupted (Ctrl-C), then release the engine."""
    import uvicorn

    from edmm.server.app import build_app

    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    state = ServerState(config)
    try:
        uvicorn.run(build_app(state), host=config.host, port=config.port, log_level=log_level,
                    timeout_graceful_shutdown=5)
    finally:
        state.close()


def run(args: argparse.Namespace) -> int:
    """Serve with parsed ``serve`` options; the exit status."""
    serve(config_from_args(args), args.log_level)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``edmm serve [options]``: ``argv`` are the options after ``serve``."""
    return run(build_parser().parse_args(argv))
