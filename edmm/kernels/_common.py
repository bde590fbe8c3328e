"""Input checks, launch configurations and triton availability shared by the kernels.

Every check here looks at shapes, dtypes, strides and devices only, never at tensor values,
so the kernels stay free of host syncs and CUDA-graph capturable.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_KV_DTYPE = torch.float8_e4m3fn  # a scaled KV cache's storage (edmm.model.kv_quant)
FP8_MAX = 448.0  # the largest finite e4m3 value: writes clamp to it
INDEX_DTYPES = (torch.int32, torch.int64)
MIN_HEAD_DIM = 16  # tl.dot needs K >= 16
MAX_HEAD_DIM = 128


class KernelInputError(ValueError):
    """Arguments a kernel cannot take (shape, dtype, device or stride mismatch)."""


class KernelUnavailableError(RuntimeError):
    """Triton is not installed, or cannot run on the tensors' device."""


class CounterWorkspace:
    """int32 counters of the kernels whose last program merges (fused decode attention, split
    skinny matmuls): per device, zero when allocated.

    Every such launch leaves its counters zero again (the program that counts last resets
    its counter), so one workspace serves every later launch, eager or in a CUDA graph, on one
    stream. Launches that run concurrently on several streams need one workspace each. Grows
    (a new zeroed tensor) when a launch needs more; the outgrown tensors stay allocated, since
    graphs captured with them still use them.
    """

    def __init__(self) -> None:
        self._counters: dict[torch.device, list[torch.Tensor]] = {}  # newest last

    def counters(self, n: int, device: torch.device) -> torch.Tensor:
        """At least ``n`` zeroed int32 counters on ``device`` ([>= n])."""
        held = self._counters.setdefault(device, [])
        if not held or held[-1].numel() < n:
            held.append(torch.zeros(max(n, 1024), dtype=torch.int32, device=device))
        return held[-1]


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the split-K decode kernel.

    block_n, num_warps, num_stages: tokens per tile, Triton's warps and stages. fused: the
    split kernel merges its splits itself (the last split of a sequence and KV head to finish,
    through a counter workspace) instead of a second, reduce, launch. pdl: launch with
    programmatic dependent launch (Hopper and later; ignored elsewhere and in the
    interpreter), so each launch starts while the kernel before it drains. prefetch: each
    program first asks L2 for every line of its chunk's K and V (same conditions), all its
    bytes in flight at once (with pdl, while the kernel before it still runs); prefetch_tiles:
    only the chunk's first that many tiles (0: the whole chunk). early_launch: with pdl, each
    launch lets the next one start as soon as its programs start, not after their wait (the
    next one's programs then take SM slots as this one frees them, and read their metadata
    and prefetch early). balanced: each split gets an equal share of its sequence's tokens, not
    a multiple of block_n (split counts that are no power of two, e.g. a multiple of the SM
    count, then keep every split busy). tma: the full tiles are loaded by the copy engine
    through a tensor descriptor (Hopper and later, or the interpreter, where the arena's
    strides allow it: see `decode_tma_usable`; elsewhere ignored).

    sliced_reduce: the reduce launch gets a program per (sequence, query head, head-dim
    slice), as many slices as keep each program's partials near 8 KB (one at 8 splits, four
    at 64), so its loads spread over more SMs. Measured on an H200 (batch 1, 64 splits): it
    gains 0.1-0.25 us per layer.

    cuda: the split kernel is the CUDA C++ one (`edmm.kernels._cuda_decode`, compiled at run
    time; fp16/bf16 on compute capability 9.0+, else the Triton kernel of the same tile runs):
    each of its ``num_warps`` warps streams 16 tokens of every tile through its own
    ``num_stages``-deep shared-memory ring, so ``block_n`` must be 16 x ``num_warps``; it takes
    pdl and sliced_reduce, not fused, balanced, tma, prefetch or early_launch. cluster (with
    cuda, 2-16 splits): the splits of a (sequence, KV head) form one thread-block cluster and
    merge through distributed shared memory, so no reduce launch follows.
    """

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    fused: bool = False
    pdl: bool = False
    prefetch: bool = False
    prefetch_tiles: int = 0
    early_launch: bool = False
    balanced: bool = False
    tma: bool = False
    sliced_reduce: bool = False
    cuda: bool = False
    cluster: bool = False

    def __post_init__(self) -> None:
        if self.prefetch_tiles < 0:
            raise KernelInputError(f"prefetch_tiles must be >= 0, got {self.prefetch_tiles}")
        if self.cluster and not self.cuda:
            raise KernelInputError("cluster is a merge of the CUDA decode kernel (cuda=True)")
        if self.cuda:
            if self.block_n != 16 * self.num_warps or self.num_stages < 2:
                raise KernelInputError(
                    "the CUDA decode kernel takes block_n = 16 x num_warps and >= 2 stages, "
                    f"got {self.block_n}x{self.num_warps}x{self.num_stages}")
            if self.fused or self.balanced or self.tma or self.prefetch or self.early_launch:
                raise KernelInputError("the CUDA decode kernel takes pdl and sliced_reduce "
                                       "only, not fused, balanced, tma, prefetch, early_launch")


@dataclass(frozen=True)
class PrefillConfig:
    """Launch parameters of the prefill kernels.

    block_m, block_n: queries and keys per tile; num_warps, num_stages: Triton's. reverse:
    start each sequence's tiles from its last (the most keys), so the longest programs do not
    trail at the end of the grid. warp_specialize: the varlen entry point takes
    `prefill_ws_kernel` where it can (Hopper, 16-bit, aligned; see `warp_specialize_usable`):
    one TMA producer warpgroup and two consumer warpgroups of num_warps each, FA3's structure by
    Triton's pass; where it cannot, `prefill_kernel` runs with `PrefillConfig()`'s launch
    parameters.
    """

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3
    reverse: bool = False
    warp_specialize: bool = False

    def __post_init__(self) -> None:
        if self.warp_specialize and (self.num_warps, self.num_stages) != (4, 2):
            # Triton 3.6 gives NaN with 3 stages on an H200 (a GPU test of that config); 4
            # warps per warpgroup is what its Hopper pass partitions.
            raise KernelInputError("warp_specialize needs num_warps=4, num_stages=2, got "
                                   f"{self.num_warps}, {self.num_stages}")


@dataclass(frozen=True)
class SkinnyConfig:
    """Launch parameters of the skinny matmul: output columns per program (block_n), K per
    loop step (block_k), K splits (splits; 1: no merge), Triton's warps and pipeline stages;
    pdl: programmatic dependent launch, each program asking L2 for its first weight tiles
    while the kernel before it still runs (Hopper and later; ignored elsewhere and in the
    interpreter)."""

    block_n: int = 64
    block_k: int = 128
    splits: int = 1
    num_warps: int = 4
    num_stages: int = 4
    pdl: bool = False

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise KernelInputError(f"{name} must be a power of two >= 16, got {v}")
        if self.splits < 1:
            raise KernelInputError(f"splits must be >= 1, got {self.splits}")


@functools.cache
def triton_available() -> bool:
    """Whether triton can be imported (checked once, without importing it)."""
    return importlib.util.find_spec("triton") is not None


def triton_usable(device: torch.device | str) -> bool:
    """Whether callers should use the kernels on ``device``: CUDA with triton installed.

    False on CPU even under ``TRITON_INTERPRET=1`` (the interpreter is for tests, far slower
    than SDPA), so a caller's CPU path stays on SDPA.
    """
    return torch.device(device).type == "cuda" and triton_available()


def require_triton(device: torch.device) -> None:
    """Raise `KernelUnavailableError` unless triton can run on ``device``.

    CUDA needs triton installed; CPU tensors also need ``TRITON_INTERPRET=1`` (tests).
    """
    interpreted = device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    if not (triton_usable(device) or (interpreted and triton_available())):
        raise KernelUnavailableError(
            f"triton kernels cannot run on {device} (triton installed: {triton_available()}); "
            "fall back to SDPA")


def hopper_or_interpreted(device: torch.device) -> bool:
    """Whether the Hopper-only kernel forms (copy-engine loads, warp specialization) run on
    ``device``: a Hopper GPU (H100, H200: compute capability 9.x), or the CPU under the
    interpreter (tests)."""
    if device.type == "cpu":
        return os.environ.get("TRITON_INTERPRET") == "1"
    return device.type == "cuda" and _capability_major(device) == 9


def pdl_usable(device: torch.device) -> bool:
    """Whether kernels on ``device`` can be launched with programmatic dependent launch (and
    take the inline PTX of `DecodeConfig.prefetch`): a CUDA GPU of compute capability 9.0 or
    later (not the interpreter: no inline asm)."""
    return device.type == "cuda" and _capability_major(device) >= 9


def decode_tma_usable(kv: torch.Tensor) -> bool:
    """Whether the decode kernel can read the layer view ``kv`` [S, M, 2, Hkv, D] through one
    tensor descriptor of its token rows [S, M, 2 * Hkv * D]: a Hopper-or-later GPU (or the
    interpreter), each token's K and V heads contiguous, and TMA's 16-byte rules (base and
    the slot and token strides multiples of 16 bytes)."""
    dev = kv.device
    if dev.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            return False
    elif not (dev.type == "cuda" and _capability_major(dev) >= 9):
        return False
    _, _, two, heads, dim = kv.shape
    size = kv.element_size()
    return (kv.stride(4) == 1 and kv.stride(3) == dim and kv.stride(2) == heads * dim
            and two == 2 and kv.data_ptr() % 16 == 0
            and all(st * size % 16 == 0 for st in kv.stride()[:2]))


@functools.cache
def _capability_major(device: torch.device) -> int:
    """The CUDA device's compute capability major (asked once per device)."""
    return torch.cuda.get_device_capability(device)[0]


def check_head_dim(head_dim: int) -> None:
    """Head dims the kernels support: a power of two in [16, 128]."""
    if not (MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM and head_dim & (head_dim - 1) == 0):
        raise KernelInputError(
            f"head_dim must be a power of two in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {head_dim}")


def kv_layer_view(kv_cache: torch.Tensor, layer: int, q: torch.Tensor) -> torch.Tensor:
    """Check ``kv_cache`` against ``q`` [.., Hq, D]; return the layer's view, no copy.

    ``kv_cache`` is [slots, max_tokens, layers, 2, Hkv, D] with unit stride on D, in q's dtype
    or scaled FP8 (`FP8_KV_DTYPE`); the result is [slots, max_tokens, 2, Hkv, D] with the
    cache's strides.
    """
    if kv_cache.dim() != 6 or kv_cache.shape[3] != 2:
        raise KernelInputError(
            f"kv_cache must be [slots, max_tokens, layers, 2, kv_heads, head_dim], "
            f"got {tuple(kv_cache.shape)}")
    if kv_cache.stride(-1) != 1:
        raise KernelInputError(f"kv_cache needs unit stride on head_dim, got {kv_cache.stride()}")
    if not 0 <= layer < kv_cache.shape[2]:
        raise KernelInputError(f"layer {layer} out of range [0, {kv_cache.shape[2]})")
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    num_kv_heads = kv_cache.shape[4]
    check_head_dim(head_dim)
    if kv_cache.shape[5] != head_dim:
        raise KernelInputError(f"head_dim of q ({head_dim}) != kv_cache ({kv_cache.shape[5]})")
    if num_heads % num_kv_heads:
        raise KernelInputError(f"{num_heads} query heads not a multiple of {num_kv_heads}")
    if q.dtype not in SUPPORTED_DTYPES or kv_cache.dtype not in (q.dtype, FP8_KV_DTYPE):
        raise KernelInputError(f"q ({q.dtype}) and kv_cache ({kv_cache.dtype}) must share one "
                               f"of {SUPPORTED_DTYPES}, or the cache be {FP8_KV_DTYPE}")
    if kv_cache.device != q.device:
        raise KernelInputError(f"q on {q.device}, kv_cache on {kv_cache.device}")
    return kv_cache[:, :, layer]


def kv_scale_arg(kv: torch.Tensor, kv_scale: torch.Tensor | None) -> torch.Tensor:
    """The kernels' scale argument for the layer view ``kv`` [S, M, 2, Hkv, D].

    An FP8 cache needs ``kv_scale``: float32 [2, Hkv], contiguous, on kv's device (the layer's
    K scales, then its V scales: stored values times these are the model's). Other caches
    ignore it and get ``kv`` back, a placeholder the kernels do not read.
    """
    if kv.dtype != FP8_KV_DTYPE:
        return kv
    heads = kv.shape[3]
    if kv_scale is None:
        raise KernelInputError("an FP8 kv_cache needs kv_scale, float32 [2, Hkv]")
    if (kv_scale.dtype != torch.float32 or tuple(kv_scale.shape) != (2, heads)
            or kv_scale.stride() != (heads, 1)):
        raise KernelInputError(f"kv_scale must be contiguous float32 [2, {heads}], got "
                               f"{kv_scale.dtype} {tuple(kv_scale.shape)} {kv_scale.stride()}")
    if kv_scale.device != kv.device:
        raise KernelInputError(f"kv_scale on {kv_scale.device}, kv_cache on {kv.device}")
    return kv_scale


def check_index(t: torch.Tensor, name: str, length: int, device: torch.device) -> None:
    """``t`` must be a 1-D int32/int64 tensor of ``length`` on ``device``."""
    if t.dim() != 1 or t.shape[0] != length:
        raise KernelInputError(f"{name} must have shape [{length}], got {tuple(t.shape)}")
    if t.dtype not in INDEX_DTYPES:
        raise KernelInputError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.device != device:
        raise KernelInputError(f"{name} on {t.device}, expected {device}")


def unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself if its last dim is contiguous, else a contiguous copy (queries only)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: exact IEEE for fp32 inputs, the default (tensor cores) else."""
    return "ieee" if dtype == torch.float32 else "tf32"


def next_pow2(x: int) -> int:
    """Smallest power of two >= ``x`` (x >= 1)."""
    return 1 << (x - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)
