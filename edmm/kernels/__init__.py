"""Triton kernels: attention that reads the KV arena's strided cache in place, RoPE fused
with the KV write, SiLU-and-multiply.

`edmm.kernels.fused_sdpa` (imported on its own) runs cuDNN's fused attention over the same
arena views, end-aligned by parts: a candidate the attention bench measures, not the engine's.

Triton is optional: importing this package never imports it. Callers check
:func:`triton_usable` for their device and fall back to SDPA when it is False (no triton, or
not a CUDA device). Tests run the kernels on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from edmm.kernels._common import (
    DecodeConfig,
    KernelInputError,
    KernelUnavailableError,
    PrefillConfig,
    triton_available,
    triton_usable,
)
from edmm.kernels.decode_attention import (
    decode_attention,
    decode_attention_varlen,
    default_num_splits,
)
from edmm.kernels.prefill_attention import prefill_attention, prefill_attention_varlen
from edmm.kernels.rope_store import rope_store_kv
from edmm.kernels.silu_mul import silu_mul

__all__ = [
    "DecodeConfig",
    "KernelInputError",
    "KernelUnavailableError",
    "PrefillConfig",
    "decode_attention",
    "decode_attention_varlen",
    "default_num_splits",
    "prefill_attention",
    "prefill_attention_varlen",
    "rope_store_kv",
    "silu_mul",
    "triton_available",
    "triton_usable",
]
