"""CUDA VMM backend over the driver API (``cuda.bindings.driver`` of cuda-python).

Physical pages come from ``cuMemCreate`` (pinned device memory, one allocation-granularity page
each), virtual ranges from ``cuMemAddressReserve``; ``cuMemMap`` + ``cuMemSetAccess`` place a
page, ``cuMemUnmap`` removes it. The backend works in the same process as PyTorch: it uses the
device's primary context, which is the one PyTorch uses, so tensors over mapped addresses are
ordinary CUDA tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from edmm.memory.errors import BackendUnavailableError, VMMError


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise BackendUnavailableError(
            "cuda-python is not installed (pip install 'edmm[cuda]' / cuda-bindings)") from e
    return driver


class _CudaArray:
    """Exposes a device range through ``__cuda_array_interface__`` (v3) for zero-copy tensors."""

    def __init__(self, ptr: int, size: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (size,), "typestr": "|u1", "data": (ptr, False), "version": 3,
            "strides": None,
        }


class CudaVMM:
    """VMM backend over one CUDA device; see the module docstring."""

    name = "cuda"

    def __init__(self, device_index: int = 0) -> None:
        self._cu = _driver()
        if not torch.cuda.is_available():
            raise BackendUnavailableError("torch sees no CUDA device")
        torch.cuda.init()
        self.device = torch.device("cuda", device_index)
        torch.cuda.set_device(self.device)
        # Make torch create its primary context, then make it current for driver calls.
        torch.empty(1, device=self.device)
        self._check("cuInit", self._cu.cuInit(0))
        self._dev = self._check("cuDeviceGet", self._cu.cuDeviceGet(device_index))
        self._ctx = self._check("cuDevicePrimaryCtxRetain",
                                self._cu.cuDevicePrimaryCtxRetain(self._dev))
        self._check("cuCtxSetCurrent", self._cu.cuCtxSetCurrent(self._ctx))
        attr = self._cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
        if not self._check("cuDeviceGetAttribute", self._cu.cuDeviceGetAttribute(attr, self._dev)):
            raise BackendUnavailableError(
                f"device {device_index} does not support CUDA virtual memory management")
        self._prop = self._make_prop(device_index)
        self._access = self._make_access(device_index)
        gran_flag = self._cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        self.page_size = int(self._check("cuMemGetAllocationGranularity",
                                         self._cu.cuMemGetAllocationGranularity(self._prop,
                                                                                gran_flag)))
        self._handles: dict[int, Any] = {}
        self._next_handle = 0

    def reserve(self, size: int) -> int:
        """Reserve virtual address space, aligned to the page size."""
        ptr = self._check("cuMemAddressReserve",
                          self._cu.cuMemAddressReserve(size, self.page_size, 0, 0))
        return int(ptr)

    def free_range(self, va: int, size: int) -> None:
        """Free a reservation made by `reserve`."""
        self._check("cuMemAddressFree", self._cu.cuMemAddressFree(self._ptr(va), size))

    def create_page(self) -> int:
        """``cuMemCreate`` one page; return a small int handle."""
        raw = self._check("cuMemCreate", self._cu.cuMemCreate(self.page_size, self._prop, 0))
        handle = self._next_handle
        self._next_handle += 1
        self._handles[handle] = raw
        return handle

    def release_page(self, handle: int) -> None:
        """``cuMemRelease`` a page that is no longer mapped."""
        raw = self._handles.pop(handle, None)
        if raw is None:
            raise VMMError("cuMemRelease", "CUDA_ERROR_INVALID_VALUE", f"unknown page {handle}")
        self._check("cuMemRelease", self._cu.cuMemRelease(raw))

    def map(self, va: int, handle: int) -> None:
        """``cuMemMap`` one page at ``va``."""
        raw = self._handles.get(handle)
        if raw is None:
            raise VMMError("cuMemMap", "CUDA_ERROR_INVALID_VALUE", f"unknown page {handle}")
        self._check("cuMemMap", self._cu.cuMemMap(self._ptr(va), self.page_size, 0, raw, 0))

    def set_access(self, va: int, size: int) -> None:
        """``cuMemSetAccess`` read/write for this device over ``[va, va + size)``."""
        self._check("cuMemSetAccess",
                    self._cu.cuMemSetAccess(self._ptr(va), size, [self._access], 1))

    def unmap(self, va: int, size: int) -> None:
        """One ``cuMemUnmap`` over ``[va, va + size)`` (several whole mappings allowed)."""
        self._check("cuMemUnmap", self._cu.cuMemUnmap(self._ptr(va), size))

    def fence(self) -> None:
        """Wait for the compute stream's queued work before an unmap (the driver does not
        order it). Copies on a side stream (`edmm.memory.copies`) are not waited for here:
        the compute stream is made to wait for those touching a slot before it is unmapped."""
        torch.cuda.current_stream(self.device).synchronize()

    def byte_view(self, va: int, size: int) -> torch.Tensor:
        """Zero-copy uint8 CUDA tensor over ``[va, va + size)``."""
        return torch.as_tensor(_CudaArray(va, size), device=self.device)

    def describe(self) -> dict[str, str]:
        """Device name, driver and CUDA versions for reports."""
        ver = self._check("cuDriverGetVersion", self._cu.cuDriverGetVersion())
        return {"backend": self.name, "device": torch.cuda.get_device_name(self.device),
                "page_size": str(self.page_size),
                "driver": f"CUDA driver API {int(ver) // 1000}.{int(ver) % 1000 // 10}"}

    def close(self) -> None:
        """Release the primary-context reference taken at start."""
        if self._ctx is not None:
            self._cu.cuDevicePrimaryCtxRelease(self._dev)
            self._ctx = None

    def _make_prop(self, device_index: int) -> Any:
        cu = self._cu
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device_index
        return prop

    def _make_access(self, device_index: int) -> Any:
        cu = self._cu
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = device_index
        desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        return desc

    def _ptr(self, va: int) -> Any:
        return self._cu.CUdeviceptr(va)

    def _check(self, call: str, result: Any) -> Any:
        """Unpack a cuda-python result tuple, raising `VMMError` on any error code."""
        err, *rest = result if isinstance(result, tuple) else (result,)
        if err != self._cu.CUresult.CUDA_SUCCESS:
            _, name = self._cu.cuGetErrorName(err)
            code = name.decode() if isinstance(name, bytes) else str(err)
            raise VMMError(call, code)
        if not rest:
            return None
        return rest[0] if len(rest) == 1 else tuple(rest)
