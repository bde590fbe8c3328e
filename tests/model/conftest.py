"""Fixtures for the model tests: the tiny model folder and tiny random HF checkpoints."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from model_testutils import MakeHFFolder, make_hf_folder

from edmm.model.tiny import ensure_tiny_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded tiny model, built once per session in a temp cache dir."""
    return ensure_tiny_model(tmp_path_factory.mktemp("edmm-cache"))


@pytest.fixture(scope="session", name="make_hf_folder")
def make_hf_folder_fixture(tiny_dir: Path) -> MakeHFFolder:
    """``make_hf_folder(tmp_path, arch, **overrides)`` with the tiny tokenizer saved alongside."""
    return functools.partial(make_hf_folder, tokenizer_dir=tiny_dir)


@pytest.fixture(autouse=True, scope="module")
def _single_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread; OpenMP spinning on a busy 2-core box is ~7x
    slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
