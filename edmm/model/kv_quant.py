"""The KV cache's storage format: its dtype (``auto``, ``bf16``, ``fp8``) and, for FP8, the
scales that map stored values back to the model's.

FP8 is e4m3 (``torch.float8_e4m3fn``: 3 mantissa bits, largest finite 448) with one static
scale per (layer, K or V, KV head): a stored value ``x8`` means ``x8 * scale[layer, kv,
head]``. Writers store ``clamp(x / scale, -448, 448)`` rounded to nearest even; readers fold
the scales into the attention (the K scale into the softmax scale of the head's scores, the V
scale into its output), so no dequantised copy of the KV exists on the GPU paths.

Why static per-head scales, not per-token ones. e4m3 is a float: a value's relative rounding
error (at most 2^-4) does not depend on the scale as long as the value lies in its normal range
(``2^-6 .. 448`` times the scale), so a scale only has to place each head's values inside that
range, which a per-head constant does. Per-token-per-head scales stored beside the KV in the
arena's token-major layout would need no calibration but break what the kernels rely on: one
4-byte scale per 128-byte head row either sits in another 32-byte sector of every token (a
decode tile of 64 tokens then reads 64 extra sectors per head, +25% of its FP8 bytes) or pads
each row to a 16-byte boundary (144 bytes: 1.78x the tokens of BF16 instead of 2x, and rows the
copy engine cannot take as one box). Static scales cost no byte per token, keep every row
16-byte aligned and the capacity exactly 2x BF16's, and leave the kernels one load of two
floats per program.

Where the scales come from: `calibrate_kv_scales` runs the model once, at engine start, on a
fixed calibration text (or seeded random ids without a tokenizer) with a KV cache in the
model's dtype, and sets ``scale = amax * FP8_HEADROOM / 448`` from each (layer, K|V, head)'s
largest magnitude: values up to `FP8_HEADROOM` times the calibration's largest are stored
unclipped, and values down to ~1/1800 of it stay in the normal range (smaller ones keep an
absolute error below 2^-10 of the scale, negligible next to the large values' 2^-4 relative
error in a dot product). vLLM's ``--kv-cache-dtype fp8`` uses scales of 1.0 unless a
checkpoint carries them; a scale of 1.0 would clip a head whose values pass 448 and push a head
of small values into e4m3's subnormals, which calibration avoids at no cost per step.

What FP8 costs in accuracy, and how it was measured, is in ``docs/benchmarks.md`` (FP8 KV
cache); the bounds the tests hold are in ``tests/engine/test_fp8_kv_engine.py`` (logits of the
embedded model, greedy outputs) and ``tests/kernels/test_fp8_kv.py`` (each attention path).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from edmm.kernels._common import FP8_KV_DTYPE, FP8_MAX
from edmm.model.errors import KVCacheError

if TYPE_CHECKING:
    from edmm.model.transformer import CausalLM

KV_CACHE_DTYPES = ("auto", "bf16", "fp8")
FP8_HEADROOM = 16.0  # the calibration's largest magnitude is stored at 448 / FP8_HEADROOM
CALIBRATION_TOKENS = 512  # most tokens of the calibration pass
CALIBRATION_SEED = 0  # of the random ids used when there is no tokenizer

# Prose, code, JSON and numbers: what an agent's context holds.
CALIBRATION_TEXT = """\
You are a coding agent. Read the repository, run the tests and fix what fails; report what you \
changed and why. Tools: read_file(path), run(command), edit(path, old, new).
user: The build fails on the CI since yesterday; the log says "undefined symbol: hash_combine".
assistant: <tool_call>{"name": "run", "arguments": {"command": "git log --oneline -5 && make \
2>&1 | tail -20"}}</tool_call>
tool: a3c8725 hash: move hash_combine into util/hash.h
6f0e1d2 server: stream tool calls as they parse
src/cache.cc:41: error: 'hash_combine' was not declared in this scope
make: *** [Makefile:23: build/cache.o] Error 1
assistant: The commit a3c8725 moved the function; src/cache.cc still includes the old header.
def hash_combine(seed: int, value: int) -> int:
    return seed ^ (value + 0x9E3779B9 + (seed << 6) + (seed >> 2))
for i in range(1, 17):
    print(f"{i:4d} {2 ** i:8d} {1.0 / i:.6f}")
{"id": "call-7", "type": "function", "function": {"name": "edit", "arguments": \
"{\\"path\\": \\"src/cache.cc\\", \\"old\\": \\"#include <hash.h>\\", \\"new\\": \
\\"#include \\\\\\"util/hash.h\\\\\\"\\"}"}}
Temperatures in Paris this week: 21.5, 19.0, 23.25, 18.75 and 20 degrees; in Oslo -3, 1.5, 0.
The capital of France is Paris; the largest planet is Jupiter; water boils at 100 C at sea level.
"""


def kv_storage_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of a KV cache named ``name`` (one of `KV_CACHE_DTYPES`): ``auto`` the
    model's, ``bf16`` bfloat16, ``fp8`` float8_e4m3fn."""
    if name == "auto":
        return model_dtype
    if name == "bf16":
        return torch.bfloat16
    if name == "fp8":
        return FP8_KV_DTYPE
    raise KVCacheError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether KV of ``dtype`` is stored as scaled FP8."""
    return dtype == FP8_KV_DTYPE


def quantize_fp8(x: Tensor, scale: Tensor) -> Tensor:
    """``x`` [..., Hkv, D] divided by ``scale`` [Hkv] (float32), clamped to +-448 and rounded to
    e4m3 (nearest even); the arithmetic the kernels' writes do."""
    x32 = x.to(torch.float32) / scale[:, None]
    return x32.clamp_(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def dequantize_fp8(x8: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``x8`` [..., Hkv, D] (e4m3) times ``scale`` [Hkv], in float32, rounded to ``dtype``."""
    return (x8.to(torch.float32) * scale[:, None]).to(dtype)


def check_kv_scales(scales: Tensor, num_layers: int, num_kv_heads: int) -> None:
    """``scales`` must be float32 [num_layers, 2, num_kv_heads], finite and positive (shapes
    and dtype only are free to check; values are checked too, once, where they are set)."""
    want = (num_layers, 2, num_kv_heads)
    if scales.dtype != torch.float32 or tuple(scales.shape) != want:
        raise KVCacheError(f"KV scales must be float32 {list(want)}, got {scales.dtype} "
                           f"{list(scales.shape)}")
    if not bool(torch.isfinite(scales).all()) or not bool((scales > 0).all()):
        raise KVCacheError("KV scales must be finite and positive")


def calibration_ids(tokenizer: Any, vocab_size: int,
                    max_tokens: int = CALIBRATION_TOKENS) -> list[int]:
    """Token ids of the calibration pass: `CALIBRATION_TEXT` encoded by ``tokenizer`` (an HF
    tokenizer), repeated up to ``max_tokens``; without one, seeded random ids."""
    if tokenizer is not None:
        ids = [int(t) for t in tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False)]
        ids = [t for t in ids if 0 <= t < vocab_size]
        if ids:
            return (ids * (-(-max_tokens // len(ids))))[:max_tokens]
    gen = torch.Generator().manual_seed(CALIBRATION_SEED)
    return torch.randint(0, vocab_size, (max_tokens,), generator=gen).tolist()


@torch.inference_mode()
def calibrate_kv_scales(model: CausalLM, token_ids: list[int],
                        headroom: float = FP8_HEADROOM) -> Tensor:
    """FP8 KV scales [L, 2, Hkv] (float32, on the model's device) of a `CausalLM` (or a
    tensor-parallel shard: its own KV heads; every rank must call this together).

    Runs ``token_ids`` (as many as the model's rotary cache has positions) through the model
    once with a cache in the model's dtype and the reference SDPA attention (the model's
    backend is restored after), and sets each (layer,
    K|V, head)'s scale to its largest magnitude times ``headroom`` / 448 (a head that stayed
    0 or non-finite gets 1.0).
    """
    from edmm.model.attention import AttentionMetadata, TorchSDPABackend

    cfg = model.cfg
    embed = model.model.embed_tokens.weight
    token_ids = token_ids[:int(model.rotary.max_positions)]
    n = len(token_ids)
    if n < 1:
        raise KVCacheError("the calibration pass needs at least one token")
    cache = torch.zeros(1, n, cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim,
                        dtype=embed.dtype, device=embed.device)  # [1, n, L, 2, Hkv, D]
    backend = model.backend
    model.set_backend(TorchSDPABackend())
    try:
        ids = torch.tensor(token_ids, dtype=torch.int64, device=embed.device)  # [n]
        meta = AttentionMetadata.build([0], [n], [n], embed.device)
        model(ids, meta.token_index, cache, meta)
    finally:
        model.set_backend(backend)
    amax = cache[0].float().abs().amax(dim=(0, 4))  # [L, 2, Hkv]
    usable = torch.isfinite(amax) & (amax > 0)
    return torch.where(usable, amax * (headroom / FP8_MAX), torch.ones_like(amax))
