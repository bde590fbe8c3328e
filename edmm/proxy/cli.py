"""``edmm proxy``: arguments, and running the proxy under uvicorn."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from edmm.argparsing import ArgumentParser, float_at_least, int_at_least
from edmm.proxy.app import Proxy, ProxyConfig, build_app


def build_parser() -> argparse.ArgumentParser:
    """The parser of the ``proxy`` options."""
    p = ArgumentParser(prog="edmm proxy", description="OpenAI-compatible proxy in "
                                "front of vLLM: agent-session tagging for EDMM's KV connector "
                                "and speculative prefill of the next prompt during tool calls")
    p.add_argument("--upstream", required=True, help="vLLM's base URL, e.g. http://host:8000")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int_at_least(1), default=8001, help="TCP port to bind")
    p.add_argument("--session-header", default="X-Session-Id",
                   help="request header naming the agent session (else derived)")
    p.add_argument("--tool-seconds", type=float_at_least(0.0), default=10.0,
                   help="expected tool duration sent to the connector (sets its retention)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer folder or HF id with the upstream's chat template "
                   "(default: the request's model)")
    p.add_argument("--no-speculate", action="store_true",
                   help="tag sessions only; no speculative prefill")
    p.add_argument("--timeout", type=float_at_least(0.0), default=600.0,
                   help="upstream timeout in seconds")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"), help="log level")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``edmm proxy [options]``: serve until interrupted; the exit status."""
    import uvicorn

    args = build_parser().parse_args(argv)
    config = ProxyConfig(upstream=args.upstream, host=args.host, port=args.port,
                         session_header=args.session_header, tool_seconds=args.tool_seconds,
                         tokenizer=args.tokenizer, speculate=not args.no_speculate,
                         timeout_s=args.timeout)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(build_app(Proxy(config)), host=config.host, port=config.port,
                log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0
