"""Triton attention kernels that read the KV arena's strided cache in place.

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
    "triton_available",
    "triton_usable",
]
