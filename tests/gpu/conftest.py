"""Fixtures shared by the CUDA tests."""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def compiled_kernels() -> None:
    """The Triton kernels must be compiled for the GPU, not run by the interpreter that
    tests/kernels selects (``TRITON_INTERPRET=1``) when it runs in the same session."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set (tests/kernels ran first); run tests/gpu alone")
