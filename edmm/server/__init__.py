"""OpenAI-compatible HTTP server with tool calling and execution-aware agent sessions.

    from edmm.server import ServerConfig, serve
    serve(ServerConfig(port=8000))       # the embedded tool model on 127.0.0.1:8000

or ``edmm serve --port 8000``; `main` is that command's entry point.

The names are imported on first use, so a worker process that imports one module of this
package (the grammar probe, the client-template renderer) does not load the whole server.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edmm.server.app import build_app
    from edmm.server.cli import build_parser, main, serve
    from edmm.server.state import ServerConfig, ServerState

__all__ = ["ServerConfig", "ServerState", "build_app", "build_parser", "main", "serve"]
_MODULES = {"build_app": "edmm.server.app", "build_parser": "edmm.server.cli",
            "main": "edmm.server.cli", "serve": "edmm.server.cli",
            "ServerConfig": "edmm.server.state", "ServerState": "edmm.server.state"}


def __getattr__(name: str) -> Any:
    """Import a public name of the server on first use."""
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'edmm.server' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
