"""Fixtures of the proxy tests: a fake vLLM and the proxy in front of it, both live on
loopback ports."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from loopback import serve_app
from proxy_helpers import FakeVLLM, Setup

from edmm.proxy import Proxy, ProxyConfig, build_app


@pytest.fixture
def fake() -> Iterator[tuple[FakeVLLM, str]]:
    """A fake vLLM on a free port (and its URL)."""
    upstream = FakeVLLM()
    with serve_app(upstream.app) as url:
        yield upstream, url
    upstream.release.set()


@pytest.fixture
def setup(fake: tuple[FakeVLLM, str], tiny_dir: Path) -> Iterator[Setup]:
    """The proxy (the tiny model's tokenizer, tool_seconds 7) in front of the fake vLLM."""
    upstream, upstream_url = fake
    proxy = Proxy(ProxyConfig(upstream=upstream_url, tokenizer=str(tiny_dir), tool_seconds=7))
    with serve_app(build_app(proxy)) as url:
        yield Setup(upstream, proxy, url)
