"""Shared fixtures: VMM backends (the host twin everywhere, CUDA under the ``gpu`` marker),
one torch thread, the embedded tiny model; the hypothesis profiles of the test tiers
(tests/tiers.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tiers import register_profiles

from edmm.memory.backends import open_backend
from edmm.memory.vmm import VMMBackend
from edmm.model.tiny import ensure_tiny_model

register_profiles()

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


@pytest.fixture(autouse=True, scope="session")
def _single_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread: OpenMP spinning on a busy 2-core box is ~7x
    slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded tiny model (tokenizer and chat template included), built once."""
    return ensure_tiny_model(tmp_path_factory.mktemp("edmm-cache"))


_STRING_BRANCH = """{%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}"""


@pytest.fixture(scope="session")
def tojson_template(tiny_dir: Path) -> str:
    """The tiny model's chat template printing a call's arguments as Qwen2.5's does
    (``arguments | tojson`` only: a string comes out escaped)."""
    template = (tiny_dir / "chat_template.jinja").read_text()
    assert _STRING_BRANCH in template
    return template.replace(_STRING_BRANCH, "{{- tool_call.arguments | tojson }}")
