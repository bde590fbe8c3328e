"""The split kernel of decode attention in CUDA C++ (`_cuda_decode.cu`), compiled at run time.

Chosen with ``DecodeConfig(cuda=True)``: the same grid, split rule and partial outputs as the
Triton split kernel (so the Triton reduce launch merges either), but each warp streams its own
16 tokens of every round through its own ``num_stages``-deep ring of shared memory (cp.async)
and keeps its own online-softmax state on tensor cores (mma m16n8k16), the warps merging once
at the end. ``block_n`` is the tokens of one round: 16 x ``num_warps``. With
``DecodeConfig(cluster=True)`` (2-16 splits) the splits of a (KV head, sequence) are one
thread-block cluster and merge their outputs through distributed shared memory: no partials
in global memory, no reduce launch.

NVRTC (``cuda.bindings.nvrtc``, with the ``nvidia-cuda-nvrtc`` library PyTorch's CUDA wheels
bring) compiles the source once per (device, shape, config); the driver API
(``cuda.bindings.driver``) loads it into the device's primary context, the one PyTorch uses,
and launches it on PyTorch's current stream with ``cuLaunchKernelEx`` (programmatic dependent
launch and the cluster shape as attributes), so the launch is captured into CUDA graphs like
any other.

Needs: compute capability 9.0 or later (``griddepcontrol``), fp16/bf16, head dim 64 or 128,
at most 16 query heads per KV head (`cuda_decode_usable` says whether a call can run here).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from edmm.kernels._common import KernelInputError, KernelUnavailableError

SOURCE = Path(__file__).with_name("_cuda_decode.cu")
KERNEL_NAME = b"edmm_decode_split"
TOKENS_PER_WARP = 16
HEAD_DIMS = (64, 128)
MAX_GROUP = 16  # query heads per KV head: the rows of one mma tile
PORTABLE_CLUSTER = 8  # CTAs a cluster may have on every GPU; up to MAX_CLUSTER on Hopper
MAX_CLUSTER = 16
DTYPES = {torch.bfloat16: 1, torch.float16: 0}  # -> IS_BF16


@dataclass(frozen=True)
class CudaDecodeShape:
    """What one compiled kernel is specialised for."""

    arch: str  # "sm_90", from the device's capability
    group: int
    head_dim: int
    num_warps: int
    num_stages: int
    bf16: bool
    cluster: int = 0  # splits merged in one thread-block cluster (0: partials to the reduce)

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: the warps' rings, or the end-of-CTA merge if larger."""
        ring = self.num_warps * self.num_stages * 2 * TOKENS_PER_WARP * self.head_dim * 2
        merge = self.num_warps * 16 * (self.head_dim + 2) * 4
        if self.cluster:  # the split's own output and log-sum-exps, read by the cluster
            merge += (self.group * self.head_dim + 16) * 4
        return max(ring, merge)


def cuda_decode_usable(q: torch.Tensor, kv: torch.Tensor) -> str | None:
    """None if the CUDA split kernel can run for ``q`` [.., Hq, D] over the layer view ``kv``
    [S, M, 2, Hkv, D] on this machine, else why not (one line)."""
    if q.device.type != "cuda":
        return f"the CUDA decode kernel needs a CUDA tensor, got {q.device}"
    if torch.cuda.get_device_capability(q.device)[0] < 9:
        return "the CUDA decode kernel needs compute capability 9.0 or later"
    if q.dtype not in DTYPES or kv.dtype != q.dtype:
        return f"the CUDA decode kernel takes fp16/bf16 q and KV, got {q.dtype} / {kv.dtype}"
    head_dim, heads, kv_heads = q.shape[-1], q.shape[-2], kv.shape[3]
    if head_dim not in HEAD_DIMS or heads % kv_heads or heads // kv_heads > MAX_GROUP:
        return (f"the CUDA decode kernel takes head dims {HEAD_DIMS} and <= {MAX_GROUP} query "
                f"heads per KV head, got D={head_dim}, {heads} / {kv_heads} heads")
    if any(s % 8 for s in kv.stride()[:-1]) or kv.data_ptr() % 16 or q.stride(-2) % 2:
        return "the CUDA decode kernel needs 16-byte aligned K/V rows and even q head strides"
    try:
        _modules()
    except KernelUnavailableError as e:
        return str(e)
    return None


@functools.cache
def _modules() -> tuple[Any, Any]:
    """cuda.bindings' driver and nvrtc modules, or `KernelUnavailableError` (also when the
    NVRTC library itself cannot be loaded)."""
    try:
        from cuda.bindings import driver, nvrtc
    except ImportError as e:
        raise KernelUnavailableError(
            "the CUDA decode kernel needs cuda-bindings (pip install 'edmm[cuda]')") from e
    try:
        _check("nvrtcVersion", nvrtc.nvrtcVersion())
    except (RuntimeError, OSError) as e:  # cuda-bindings without an NVRTC library
        raise KernelUnavailableError(f"the CUDA decode kernel needs NVRTC: {e}") from e
    return driver, nvrtc


def _check(call: str, result: Any) -> Any:
    """The value(s) of a cuda.bindings call, or `KernelUnavailableError` naming it."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise KernelUnavailableError(f"{call} failed: {err!r}")
    return rest[0] if len(rest) == 1 else tuple(rest)


def compile_cubin(shape: CudaDecodeShape) -> bytes:
    """Compile the kernel for ``shape`` with NVRTC; raises `KernelUnavailableError` with the
    compiler's log on failure. Needs no GPU."""
    _, nvrtc = _modules()
    prog = _check("nvrtcCreateProgram", nvrtc.nvrtcCreateProgram(
        SOURCE.read_bytes(), b"_cuda_decode.cu", 0, [], []))
    opts = [f"--gpu-architecture={shape.arch}".encode(), b"-std=c++17", b"-default-device",
            f"-DGROUP={shape.group}".encode(), f"-DHEAD_DIM={shape.head_dim}".encode(),
            f"-DWARPS={shape.num_warps}".encode(), f"-DSTAGES={shape.num_stages}".encode(),
            f"-DIS_BF16={int(shape.bf16)}".encode(), f"-DCLUSTER={shape.cluster}".encode()]
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if int(err) != 0:
            size = _check("nvrtcGetProgramLogSize", nvrtc.nvrtcGetProgramLogSize(prog))
            log = b" " * size
            _check("nvrtcGetProgramLog", nvrtc.nvrtcGetProgramLog(prog, log))
            raise KernelUnavailableError(f"NVRTC could not compile the decode kernel for "
                                         f"{shape}:\n{log.decode(errors='replace')}")
        size = _check("nvrtcGetCUBINSize", nvrtc.nvrtcGetCUBINSize(prog))
        cubin = b" " * size
        _check("nvrtcGetCUBIN", nvrtc.nvrtcGetCUBIN(prog, cubin))
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


class _Kernel:
    """One compiled kernel loaded into a device's primary context."""

    def __init__(self, shape: CudaDecodeShape, device_index: int) -> None:
        driver, _ = _modules()
        self._driver = driver
        self.shape = shape
        torch.empty(1, device=torch.device("cuda", device_index))  # torch's primary context
        _check("cuInit", driver.cuInit(0))
        dev = _check("cuDeviceGet", driver.cuDeviceGet(device_index))
        ctx = _check("cuDevicePrimaryCtxRetain", driver.cuDevicePrimaryCtxRetain(dev))
        _check("cuCtxSetCurrent", driver.cuCtxSetCurrent(ctx))
        self._module = _check("cuModuleLoadData", driver.cuModuleLoadData(compile_cubin(shape)))
        self._fn = _check("cuModuleGetFunction",
                          driver.cuModuleGetFunction(self._module, KERNEL_NAME))
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _check("cuFuncSetAttribute", driver.cuFuncSetAttribute(self._fn, attr,
                                                               shape.smem_bytes))
        if shape.cluster > PORTABLE_CLUSTER:
            attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
            _check("cuFuncSetAttribute", driver.cuFuncSetAttribute(self._fn, attr, 1))

    def launch(self, grid: tuple[int, int, int], stream: int, pdl: bool,
               args: tuple[tuple[Any, ...], tuple[Any, ...]]) -> None:
        """Launch over ``grid`` on ``stream`` (a CUstream handle); ``args`` as cuda.bindings
        takes kernel parameters: (values, ctypes types)."""
        d = self._driver
        config = d.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid
        config.blockDimX, config.blockDimY, config.blockDimZ = 32 * self.shape.num_warps, 1, 1
        config.sharedMemBytes = self.shape.smem_bytes
        config.hStream = d.CUstream(stream)
        attrs = []
        if pdl:
            attr = d.CUlaunchAttribute()
            attr.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            attrs.append(attr)
        if self.shape.cluster:
            attr = d.CUlaunchAttribute()
            attr.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = (
                self.shape.cluster, 1, 1)
            attrs.append(attr)
        if attrs:
            config.attrs = attrs
            config.numAttrs = len(attrs)
        _check("cuLaunchKernelEx", d.cuLaunchKernelEx(config, self._fn, args, 0))


@functools.cache
def _kernel(shape: CudaDecodeShape, device_index: int) -> _Kernel:
    return _Kernel(shape, device_index)


@functools.cache
def _max_smem(device_index: int) -> int:
    """Shared memory one CTA may opt in to on the device (bytes)."""
    driver, _ = _modules()
    _check("cuInit", driver.cuInit(0))
    dev = _check("cuDeviceGet", driver.cuDeviceGet(device_index))
    attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
    return int(_check("cuDeviceGetAttribute", driver.cuDeviceGetAttribute(attr, dev)))


def launch_split(q: torch.Tensor, kv: torch.Tensor, slot_ids: torch.Tensor,
                 context_lens: torch.Tensor, out: torch.Tensor, part_o: torch.Tensor,
                 part_lse: torch.Tensor, cu_q: torch.Tensor | None, qk_scale: float,
                 num_splits: int, num_warps: int, num_stages: int, pdl: bool,
                 cluster: bool = False) -> None:
    """Launch the split kernel over (num_splits, Hkv, B) on the current stream; with
    ``cluster`` (and more than one split) the splits of each (KV head, sequence) form a
    thread-block cluster that merges them into ``out`` itself: no reduce launch follows.

    q: [B or T, Hq, D]; kv: the layer view [S, M, 2, Hkv, D]; out: like q; part_o
    [B, Hq, num_splits, D] and part_lse [B, Hq, num_splits] fp32 (unused with one split);
    cu_q: [B + 1] for a packed batch, else None; qk_scale: softmax scale x log2(e).
    The caller has checked `cuda_decode_usable`, and ``num_warps``/``num_stages`` come from a
    valid `DecodeConfig` (``decode_attention`` does both).
    """
    if cluster and num_splits > 1 and not 2 <= num_splits <= MAX_CLUSTER:
        raise KernelInputError(f"a cluster merge takes 2-{MAX_CLUSTER} splits (the CTAs of one "
                               f"cluster), got {num_splits}")
    batch = slot_ids.shape[0]
    cap = torch.cuda.get_device_capability(q.device)
    shape = CudaDecodeShape(f"sm_{cap[0]}{cap[1]}", q.shape[1] // kv.shape[3], q.shape[2],
                            num_warps, num_stages, q.dtype == torch.bfloat16,
                            num_splits if cluster and num_splits > 1 else 0)
    limit = _max_smem(q.device.index or 0)
    if shape.smem_bytes > limit:
        raise KernelInputError(
            f"the CUDA decode kernel's {num_warps} warps x {num_stages} stages need "
            f"{shape.smem_bytes} bytes of shared memory, the device gives a CTA {limit}")
    kernel = _kernel(shape, q.device.index or 0)
    wide = (int(slot_ids.dtype == torch.int64) | int(context_lens.dtype == torch.int64) << 1
            | int(cu_q is not None and cu_q.dtype == torch.int64) << 2)
    p, i, f, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_longlong
    values = (q.data_ptr(), kv.data_ptr(), slot_ids.data_ptr(), context_lens.data_ptr(),
              0 if cu_q is None else cu_q.data_ptr(), wide, out.data_ptr(), part_o.data_ptr(),
              part_lse.data_ptr(),
              num_splits, qk_scale, q.stride(0), q.stride(1), kv.stride(0), kv.stride(1),
              kv.stride(2), kv.stride(3), out.stride(0), out.stride(1), part_o.stride(0),
              part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1))
    types = (p, p, p, p, p, i, p, p, p, i, f) + (ll,) * 13
    stream = torch.cuda.current_stream(q.device).cuda_stream
    kernel.launch((num_splits, kv.shape[3], batch), stream, pdl, (values, types))
