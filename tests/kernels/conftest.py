"""Run the Triton kernels on CPU tensors through the Triton interpreter.

``TRITON_INTERPRET`` is read when a jit function is decorated: for triton's own helpers when
triton is first imported, for the kernels when ``edmm.kernels._triton_*`` is. It is set in
`pytest_configure`, while tests are collected, before any test runs (some import triton,
e.g. through transformers), except in a ``-m gpu`` session, which deselects these tests and
must compile the kernels for the GPU. Tests that run kernels use the ``interpreted`` fixture;
it skips them (with the reason) if triton is missing or was imported without the variable.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _patch_numpy_24_index() -> None:
    """Backport triton PR 9172 (triton 3.6.0 interpreter + numpy >= 2.4, issue 9171).

    The interpreter turns a scalar into a Python int with ``int(ndarray of shape (1,))``,
    which numpy 2.4 rejects; that breaks ``range()`` over loaded bounds.
    """
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_edmm_patched", False):
        return

    def patched(tensor, scope):  # type: ignore[no-untyped-def]
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched._edmm_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


def _patch_bf16_dot() -> None:
    """Let the interpreter's ``tl.dot`` take bf16: it matmuls the raw uint16 bits otherwise.

    Operands are widened to fp32 exactly (bf16 -> fp32 is lossless), as the GPU's bf16 MMA
    multiplies exactly and accumulates in fp32.
    """
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot
    if getattr(original, "_edmm_patched", False):
        return

    def widen(x):  # type: ignore[no-untyped-def]
        if x.dtype.scalar != tl.bfloat16:
            return x
        bits = x.data.astype("uint32") << 16  # bf16 bits are the high half of an fp32
        return interpreter.TensorHandle(bits.view("float32"), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore[no-untyped-def]
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    create_dot._edmm_patched = True  # type: ignore[attr-defined]
    builder.create_dot = create_dot


def _patch_fp8_casts() -> None:
    """Let the interpreter convert to and from e4m3 (``tl.float8e4nv``) as the GPU does.

    Its bit-level conversion drops the carry of a rounding into the exponent (0.4875 becomes
    0.25, not 0.5) and reads e4m3's NaN as 480; the GPU's ``cvt.rn.satfinite`` does neither.
    Conversions that touch e4m3 go through torch's ``float8_e4m3fn`` instead (round to
    nearest even); the kernels clamp to +-448 before they convert, so saturation never
    matters.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_fp_to_fp
    if getattr(original, "_edmm_patched", False):
        return
    torch_of = {tl.float8e4nv: torch.float8_e4m3fn, tl.float32: torch.float32,
                tl.float16: torch.float16, tl.bfloat16: torch.bfloat16}

    def create_fp_to_fp(self, src, dst_type, rounding_mode):  # type: ignore[no-untyped-def]
        src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
        if (tl.float8e4nv not in (src_ty, dst_ty) or src_ty not in torch_of
                or dst_ty not in torch_of):
            return original(self, src, dst_type, rounding_mode)
        ints = {1: (np.uint8, torch.uint8), 2: (np.int16, torch.int16),
                4: (np.int32, torch.int32)}
        data = np.ascontiguousarray(src.data)
        np_int, torch_int = ints[data.itemsize]
        x = torch.from_numpy(data.view(np_int)).view(torch_int).view(torch_of[src_ty])
        y = x.to(torch_of[dst_ty])
        np_int, torch_int = ints[y.element_size()]
        out = y.view(torch_int).numpy().view(interpreter._get_np_dtype(dst_ty))
        return interpreter.TensorHandle(out, dst_ty)

    create_fp_to_fp._edmm_patched = True  # type: ignore[attr-defined]
    builder.create_fp_to_fp = create_fp_to_fp


def pytest_configure(config: pytest.Config) -> None:
    """Select the interpreter for the session, unless it runs only GPU tests."""
    if config.option.markexpr.replace(" ", "") != "gpu" and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_problem() -> str | None:
    """Set up the interpreter; return why the kernel tests cannot run, or None."""
    if not HAS_TRITON:
        return "triton is not installed"
    if "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    from edmm.kernels import _triton_decode, _triton_prefill

    _patch_numpy_24_index()
    _patch_bf16_dot()
    _patch_fp8_casts()
    kernels = (_triton_decode.decode_split_kernel, _triton_prefill.prefill_kernel, standard.cdiv)
    if not all(isinstance(k, InterpretedFunction) for k in kernels):
        return ("triton was imported before TRITON_INTERPRET=1 could be set (by another test "
                "module); run tests/kernels on its own")
    return None


@pytest.fixture
def interpreted() -> None:
    """Skip unless the kernels (and triton's helpers) run in the Triton interpreter."""
    problem = _interpreter_problem()
    if problem:
        pytest.skip(problem)


# ---------------------------------------------------------------------------- shared helpers
TOLERANCES = {  # (atol, rtol, error norm / reference norm per output row) vs float64
    torch.float32: (2e-5, 2e-5, 1e-5),
    torch.float16: (2e-3, 2e-3, 2e-3),
    torch.bfloat16: (1e-2, 1e-2, 2e-2),
}


@dataclass
class PoisonedCache:
    """A strided ``kv`` [S, M, L, 2, Hkv, D] sliced from a padded ``backing`` tensor.

    Tokens ``< lens[slot]`` hold random values; everything else in ``backing`` (other slots,
    tokens past each context, the padding) is NaN, so any read out of range shows as NaN.
    """

    backing: torch.Tensor
    kv: torch.Tensor
    lens: dict[int, int]


def _make_cache(lens: dict[int, int], *, dtype: torch.dtype, num_slots: int, max_tokens: int,
                layers: int = 2, kv_heads: int = 2, head_dim: int = 32,
                seed: int = 0) -> PoisonedCache:
    gen = torch.Generator().manual_seed(seed)
    backing = torch.full((num_slots + 1, max_tokens + 3, layers + 1, 2, kv_heads, head_dim),
                         float("nan"), dtype=dtype)
    kv = backing[1:, :max_tokens, 1:]  # storage offset, padded slot/token strides
    for slot, n in lens.items():
        kv[slot, :n] = torch.randn(n, layers, 2, kv_heads, head_dim, generator=gen).to(dtype)
    return PoisonedCache(backing, kv, dict(lens))


@pytest.fixture
def make_cache() -> Callable[..., PoisonedCache]:
    """Factory of NaN-poisoned strided caches: ``make_cache({slot: n}, dtype=..., ...)``."""
    return _make_cache


def _check_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not got.isnan().any(), "NaN in the output: a read past a context length"
    atol, rtol, rel_norm = TOLERANCES[dtype]
    got = got.to(torch.float64)
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)
    err = (got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)  # [..] per head row
    assert err.max().item() <= rel_norm, f"relative row error {err.max().item():.2e}"


@pytest.fixture
def check_close() -> Callable[[torch.Tensor, torch.Tensor, torch.dtype], None]:
    """Assert a kernel output matches a float64 reference within the tolerance of ``dtype``."""
    return _check_close

