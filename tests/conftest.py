"""Shared fixtures: VMM backends (the host twin everywhere, CUDA under the ``gpu`` marker)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from edmm.memory.backends import open_backend
from edmm.memory.vmm import VMMBackend

HOST_TEST_PAGE = 4096  # small pages: many page boundaries with tiny KV specs

BACKEND_PARAMS = [
    pytest.param("host", id="host"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


@pytest.fixture(params=BACKEND_PARAMS)
def backend(request: pytest.FixtureRequest) -> Iterator[VMMBackend]:
    """A VMM backend: the host twin with 4 KiB pages, or CUDA (2 MiB pages on an H200)."""
    b = open_backend(request.param, host_page_size=HOST_TEST_PAGE)
    yield b
    b.close()
