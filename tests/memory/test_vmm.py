"""The VMM backends themselves: real remaps, typed errors."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from edmm.memory.errors import VMMError
from edmm.memory.host import HostVMM
from edmm.memory.vmm import VMMBackend


def _fill(backend: VMMBackend, va: int, value: int) -> None:
    backend.byte_view(va, backend.page_size).fill_(value)


def _read(backend: VMMBackend, va: int) -> torch.Tensor:
    return backend.byte_view(va, backend.page_size).cpu()


def test_two_pages_behind_one_address(backend: VMMBackend) -> None:
    """The seed's proof: the content read at one address follows whichever page is mapped."""
    p = backend.page_size
    va = backend.reserve(2 * p)
    a, b = backend.create_page(), backend.create_page()
    try:
        backend.map(va, a)
        backend.set_access(va, p)
        _fill(backend, va, 0xAA)
        backend.fence()
        backend.unmap(va, p)
        backend.map(va, b)
        backend.set_access(va, p)
        _fill(backend, va, 0x55)
        assert int(_read(backend, va)[0]) == 0x55
        backend.fence()
        backend.unmap(va, p)
        backend.map(va, a)  # back to the first page: its bytes are still there
        backend.set_access(va, p)
        got = _read(backend, va)
        assert bool((got == 0xAA).all())
        backend.fence()
        backend.unmap(va, p)
    finally:
        backend.release_page(a)
        backend.release_page(b)
        backend.free_range(va, 2 * p)


def test_one_page_at_two_addresses(backend: VMMBackend) -> None:
    """A page mapped twice shows the same bytes at both addresses (a shared prefix)."""
    p = backend.page_size
    va = backend.reserve(2 * p)
    page = backend.create_page()
    try:
        backend.map(va, page)
        backend.map(va + p, page)
        backend.set_access(va, 2 * p)
        view0 = backend.byte_view(va, p)
        view1 = backend.byte_view(va + p, p)
        assert view0.data_ptr() == va and view1.data_ptr() == va + p
        view0[:16] = torch.arange(16, dtype=torch.uint8, device=view0.device)
        assert view1[:16].cpu().tolist() == list(range(16))
        backend.fence()
        backend.unmap(va, p)
        backend.unmap(va + p, p)
    finally:
        backend.release_page(page)
        backend.free_range(va, 2 * p)


def test_one_unmap_over_pages_mapped_one_by_one(backend: VMMBackend) -> None:
    """One `unmap` over a range of three separately mapped pages releases all three: each page
    maps again elsewhere with its bytes, and the pages and the range can be given back (the
    arena frees a slot this way)."""
    p = backend.page_size
    va = backend.reserve(4 * p)
    pages = [backend.create_page() for _ in range(3)]
    try:
        for i, page in enumerate(pages):
            backend.map(va + i * p, page)
            backend.set_access(va + i * p, p)
            _fill(backend, va + i * p, 0x10 + i)
        backend.fence()
        backend.unmap(va, 3 * p)
        for i, page in enumerate(reversed(pages)):  # each address gets another page now
            backend.map(va + (i + 1) * p, page)
        backend.set_access(va + p, 3 * p)
        assert [int(_read(backend, va + (i + 1) * p)[0]) for i in range(3)] == [0x12, 0x11, 0x10]
        backend.fence()
        backend.unmap(va + p, 3 * p)
    finally:
        for page in pages:
            backend.release_page(page)
        backend.free_range(va, 4 * p)


def test_errors_name_the_call(backend: VMMBackend) -> None:
    """Bad calls raise VMMError naming the failing call, never a silent mapping."""
    p = backend.page_size
    va = backend.reserve(2 * p)
    try:
        with pytest.raises(VMMError) as e:
            backend.map(va, 10_000_000)  # unknown page
        assert "Map" in e.value.call or "map" in e.value.call
        with pytest.raises(VMMError):
            backend.release_page(10_000_000)
    finally:
        backend.free_range(va, 2 * p)


def test_host_unaligned_map_is_rejected() -> None:
    b = HostVMM(4096)
    va = b.reserve(2 * 4096)
    page = b.create_page()
    with pytest.raises(VMMError) as e:
        b.map(va + 100, page)
    assert e.value.code == "EINVAL"
    b.release_page(page)
    b.free_range(va, 2 * 4096)
    b.close()


def test_host_page_size_validation() -> None:
    with pytest.raises(ValueError):
        HostVMM(1000)


def test_host_mapping_without_access_faults() -> None:
    """Like cuMemMap, a host mapping grants no access until set_access."""
    code = textwrap.dedent("""
        from edmm.memory.host import HostVMM
        b = HostVMM(4096)
        va = b.reserve(4096)
        b.map(va, b.create_page())
        b.byte_view(va, 4096)[0] = 1
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert proc.returncode == -11  # SIGSEGV: the page is mapped PROT_NONE


def test_host_released_page_is_reused_and_zeroed() -> None:
    b = HostVMM(4096)
    va = b.reserve(4096)
    page = b.create_page()
    b.map(va, page)
    b.set_access(va, 4096)
    b.byte_view(va, 4096).fill_(7)
    b.unmap(va, 4096)
    b.release_page(page)
    again = b.create_page()
    assert again == page  # the extent is recycled
    b.map(va, again)
    b.set_access(va, 4096)
    assert int(b.byte_view(va, 4096).sum()) == 0  # punched hole reads as zeros
    b.unmap(va, 4096)
    b.release_page(again)
    b.free_range(va, 4096)
    b.close()
