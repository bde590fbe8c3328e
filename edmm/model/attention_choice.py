"""Which attention backend runs: chosen by name (``auto``, ``fa4``, ``triton``, ``sdpa``) and by
what the device can run.

- ``fa4``: FlashAttention-4 for prefill, Triton split-K for decode (`FA4AttentionBackend`);
  needs a GPU FA4 targets (compute capability 9.x-11.x), FA4 importable and triton.
- ``triton``: EDMM's Triton kernels (`TritonAttentionBackend`); needs a CUDA device and triton.
- ``sdpa``: the reference, one SDPA call per sequence (`TorchSDPABackend`); runs anywhere.
- ``auto``: the first of fa4, triton, sdpa that can run. FA4 leads where it runs: 611-614 vs
  420 TFLOP/s for 512 queries on a 16K prefix, 700-720 vs 490 on a 16K prefill (H200, issue
  20); decode rows are the same Triton kernel in both.

`resolve_attention` is plain logic over an `AttentionCapabilities` (tests give it any);
`AttentionCapabilities.probe` asks the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edmm.kernels import PrefillConfig
from edmm.kernels.decode_routes import DecodeRoutes
from edmm.model.attention import AttentionBackend, TorchSDPABackend
from edmm.model.attention_triton import PREFILL
from edmm.model.errors import ModelError

ATTENTION_CHOICES = ("auto", "fa4", "triton", "sdpa")


class AttentionChoiceError(ModelError):
    """An attention backend was asked for by a name it does not have, or cannot run here."""


@dataclass(frozen=True)
class AttentionCapabilities:
    """What a device can run: CUDA, EDMM's Triton kernels, FA4 (importable, a target GPU)."""

    cuda: bool
    triton: bool
    fa4: bool
    fa4_reason: str = ""  # why not, when fa4 is False

    @classmethod
    def probe(cls, device: torch.device | str) -> AttentionCapabilities:
        """The capabilities of ``device`` (imports nothing it does not need)."""
        from edmm.kernels import triton_usable
        from edmm.kernels.fa4 import FA4_MODULE, fa4_available, fa4_capable

        device = torch.device(device)
        cuda = device.type == "cuda"
        if not cuda:
            return cls(False, False, False, "not a CUDA device")
        triton = triton_usable(device)
        if not fa4_capable(device):
            capability = torch.cuda.get_device_capability(device)
            return cls(True, triton, False, f"compute capability {capability} is not a FA4 "
                                            "target (9.x-11.x)")
        if not fa4_available():
            return cls(True, triton, False, f"{FA4_MODULE} is not importable "
                                            "(pip install 'edmm[cuda]')")
        return cls(True, triton, True)


def resolve_attention(requested: str, caps: AttentionCapabilities) -> str:
    """The backend name that runs for ``requested`` (one of `ATTENTION_CHOICES`) on a device
    with ``caps``; raises `AttentionChoiceError` for an unknown name or one that cannot run."""
    if requested not in ATTENTION_CHOICES:
        raise AttentionChoiceError(
            f"attention must be one of {ATTENTION_CHOICES}, got {requested!r}")
    kernels = caps.cuda and caps.triton
    if requested == "auto":
        return "fa4" if kernels and caps.fa4 else "triton" if kernels else "sdpa"
    if requested in ("fa4", "triton") and not kernels:
        raise AttentionChoiceError(
            f"attention={requested!r} needs a CUDA device with triton "
            f"(cuda: {caps.cuda}, triton: {caps.triton})")
    if requested == "fa4" and not caps.fa4:
        raise AttentionChoiceError(f"attention='fa4' cannot run here: {caps.fa4_reason}")
    return requested


def kv_read_align(name: str) -> int:
    """The ``read_align`` an arena read by backend ``name`` needs (tokens)."""
    if name == "fa4":
        from edmm.model.attention_fa4 import FA4AttentionBackend

        return FA4AttentionBackend.kv_read_align
    return 1


def build_backend(name: str, max_context: int, prefill: PrefillConfig = PREFILL,
                  decode_routes: DecodeRoutes | None = None) -> AttentionBackend:
    """The backend ``name`` (a resolved name: fa4, triton or sdpa). ``max_context`` is the
    longest context a decode call serves; ``prefill`` the Triton prefill kernel's launch
    parameters (the triton backend's); ``decode_routes`` the decode kernel's measured
    routing table (fa4 and triton; None: its heuristic)."""
    if name == "fa4":
        from edmm.model.attention_fa4 import FA4AttentionBackend

        return FA4AttentionBackend(max_context, decode_routes)
    if name == "triton":
        from edmm.model.attention_triton import TritonAttentionBackend

        return TritonAttentionBackend(max_context, prefill, decode_routes)
    if name == "sdpa":
        return TorchSDPABackend()
    raise AttentionChoiceError(f"no backend {name!r} (resolve it with resolve_attention)")

