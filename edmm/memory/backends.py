"""Choosing a VMM backend, and saying why one is or is not usable (for ``edmm doctor``)."""

from __future__ import annotations

from dataclasses import dataclass

from edmm.memory.errors import BackendUnavailableError, KVMemoryError
from edmm.memory.host import DEFAULT_HOST_PAGE_SIZE, HostVMM
from edmm.memory.vmm import VMMBackend

BACKEND_NAMES = ("auto", "cuda", "host")


@dataclass(frozen=True)
class BackendProbe:
    """Whether one backend can be opened here, with its page size or the reason it cannot."""

    name: str
    usable: bool
    page_size: int | None
    detail: str


def open_backend(kind: str = "auto", *, device_index: int = 0,
                 host_page_size: int = DEFAULT_HOST_PAGE_SIZE) -> VMMBackend:
    """Open a VMM backend: ``cuda``, ``host`` or ``auto`` (CUDA when usable, else the host twin)."""
    if kind not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {kind!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if kind in ("cuda", "auto"):
        try:
            from edmm.memory.cuda import CudaVMM

            return CudaVMM(device_index)
        except (BackendUnavailableError, KVMemoryError, RuntimeError, OSError):
            if kind == "cuda":
                raise
    return HostVMM(host_page_size)


def probe_backends(device_index: int = 0) -> list[BackendProbe]:
    """Try each backend and report what happened, never raising."""
    probes = []
    for name in ("cuda", "host"):
        try:
            backend = open_backend(name, device_index=device_index)
        except Exception as e:  # report any failure: that is the point of a probe
            probes.append(BackendProbe(name, False, None, f"{type(e).__name__}: {e}"))
            continue
        try:
            facts = backend.describe()
            detail = ", ".join(f"{k}={v}" for k, v in facts.items() if k != "page_size")
            probes.append(BackendProbe(name, True, backend.page_size, detail))
        finally:
            backend.close()
    return probes
