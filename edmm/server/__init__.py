"""OpenAI-compatible HTTP server with tool calling and execution-aware agent sessions.

    from edmm.server import ServerConfig, serve
    serve(ServerConfig(port=8000))       # the embedded tool model on 127.0.0.1:8000

or ``edmm serve --port 8000``; `main` is that command's entry point.
"""

from edmm.server.app import build_app
from edmm.server.cli import build_parser, main, serve
from edmm.server.state import ServerConfig, ServerState

__all__ = ["ServerConfig", "ServerState", "build_app", "build_parser", "main", "serve"]
