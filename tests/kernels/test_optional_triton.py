"""``edmm.kernels`` imports and reports itself unusable without triton; callers can fall back."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from edmm.kernels import triton_usable


def test_package_imports_without_triton() -> None:
    script = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # any `import triton` now fails
        import torch
        import edmm.kernels as k
        assert not k.triton_available() and not k.triton_usable("cuda")
        q = torch.zeros(1, 1, 16)
        idx = torch.zeros(1, dtype=torch.int32)
        try:
            k.decode_attention(q, torch.zeros(1, 4, 1, 2, 1, 16), 0, idx, idx, 1.0)
        except k.KernelUnavailableError:
            print("fallback")
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "fallback"


def test_cpu_callers_fall_back_to_sdpa() -> None:
    assert not triton_usable("cpu")
    assert not triton_usable(torch.device("meta"))
