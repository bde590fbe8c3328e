"""ATen's fused attention (cuDNN's flash-attention forward) over the arena's strided KV.

cuDNN's kernel knows top-left causality only, and the arena's new tokens sit at the END of
each slot's context. `end_aligned_by_parts` gets end-aligned causal attention from two calls
of such a kernel: the keys before the new tokens unmasked, the new tokens' own keys causal (a
square, where top-left and end alignment agree), merged by their log-sum-exps. Each call
takes host-side lengths, so this path is for eager passes (a CUDA graph replays one
shape), and the arena's views go in as they are: no gather, no copy of the KV.

A measured candidate, not the engine's: `python -m benchmarks.kernels.attention` times it beside the
Triton kernels (on the H200 it loses on a cached prefix and on chunked prefill; see
`edmm.model.attention_triton`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# attend(q [1, Hq, n, D], k [1, Hkv, c, D], v [1, Hkv, c, D], causal, scale)
#   -> (out [1, Hq, n, D] in q's dtype, natural-log lse [1, Hq, n] float32)
AttendLSE = Callable[[Tensor, Tensor, Tensor, bool, float], tuple[Tensor, Tensor]]


def end_aligned_by_parts(q: Tensor, k: Tensor, v: Tensor, scale: float,
                         attend: AttendLSE) -> Tensor:
    """End-aligned causal attention of n queries over c >= n keys (query i sees keys
    < c - n + i + 1) from two calls of ``attend``.

    Args:
        q: [1, Hq, n, D]; k, v: [1, Hkv, c, D] (Hq a multiple of Hkv; views are fine).
        attend: a kernel with top-left causality that returns its log-sum-exp.

    Returns:
        [1, Hq, n, D] in q's dtype.
    """
    n, c = q.shape[2], k.shape[2]
    out_new, lse_new = attend(q, k[:, :, c - n:], v[:, :, c - n:], True, scale)
    if n == c:
        return out_new
    out_old, lse_old = attend(q, k[:, :, :c - n], v[:, :, :c - n], False, scale)
    lse = torch.logaddexp(lse_old, lse_new)  # [1, Hq, n]
    out = (out_old.float() * torch.exp(lse_old - lse)[..., None]
           + out_new.float() * torch.exp(lse_new - lse)[..., None])
    return out.to(q.dtype)


def cudnn_attend(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
                 ) -> tuple[Tensor, Tensor]:
    """`AttendLSE` through cuDNN (``aten._scaled_dot_product_cudnn_attention``), with grouped
    KV heads as they are."""
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
    return out, lse.reshape(out.shape[:-1])  # lse [1, Hq, n] (some builds keep a last dim)


def cudnn_expanded_attend(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
                          ) -> tuple[Tensor, Tensor]:
    """`cudnn_attend` with the KV heads first copied up to the query heads (for a cuDNN that
    refuses grouped heads; costs a copy of the KV per call)."""
    group = q.shape[1] // k.shape[1]
    return cudnn_attend(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                        causal, scale)
