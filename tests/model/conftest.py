"""Fixtures for the model tests: the tiny model folder and tiny random HF checkpoints."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from model_testutils import MakeHFFolder, make_hf_folder


@pytest.fixture(scope="session", name="make_hf_folder")
def make_hf_folder_fixture(tiny_dir: Path) -> MakeHFFolder:
    """``make_hf_folder(tmp_path, arch, **overrides)`` with the tiny tokenizer saved alongside."""
    return functools.partial(make_hf_folder, tokenizer_dir=tiny_dir)
