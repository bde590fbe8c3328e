"""Which attention backend runs for a name on a device (plain logic over capabilities), the
arena read alignment each needs, and FA4's per-slot arguments against a plain-Python model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from edmm.kernels import KernelUnavailableError
from edmm.kernels.fa4 import FA4_KV_TILE, fa4_available, fa4_varlen_args, fa4_varlen_attention
from edmm.model.attention import AttentionMetadata, TorchSDPABackend
from edmm.model.attention_choice import (
    ATTENTION_CHOICES,
    AttentionCapabilities,
    AttentionChoiceError,
    build_backend,
    kv_read_align,
    resolve_attention,
)
from edmm.model.attention_fa4 import FA4AttentionBackend
from edmm.model.attention_triton import TritonAttentionBackend

HOPPER_FA4 = AttentionCapabilities(cuda=True, triton=True, fa4=True)
GPU_NO_FA4 = AttentionCapabilities(cuda=True, triton=True, fa4=False, fa4_reason="not here")
GPU_NO_TRITON = AttentionCapabilities(cuda=True, triton=False, fa4=True)
CPU = AttentionCapabilities(cuda=False, triton=False, fa4=False, fa4_reason="cpu")


@pytest.mark.parametrize(("caps", "want"), [
    (HOPPER_FA4, "fa4"), (GPU_NO_FA4, "triton"), (GPU_NO_TRITON, "sdpa"), (CPU, "sdpa")])
def test_auto_takes_the_first_backend_that_runs(caps: AttentionCapabilities, want: str) -> None:
    assert resolve_attention("auto", caps) == want


@pytest.mark.parametrize("name", ["fa4", "triton", "sdpa"])
def test_explicit_names_stay_where_they_run(name: str) -> None:
    assert resolve_attention(name, HOPPER_FA4) == name
    assert resolve_attention("sdpa", CPU) == "sdpa"


@pytest.mark.parametrize(("name", "caps", "says"), [
    ("fa4", GPU_NO_FA4, "not here"), ("fa4", CPU, "CUDA"), ("triton", CPU, "CUDA"),
    ("fa4", GPU_NO_TRITON, "triton"), ("flash", HOPPER_FA4, "one of")])
def test_a_name_that_cannot_run_is_a_typed_error(name: str, caps: AttentionCapabilities,
                                                 says: str) -> None:
    with pytest.raises(AttentionChoiceError, match=says):
        resolve_attention(name, caps)


def test_probe_on_cpu_offers_sdpa_only() -> None:
    caps = AttentionCapabilities.probe("cpu")
    assert (caps.cuda, caps.triton, caps.fa4) == (False, False, False)
    assert resolve_attention("auto", caps) == "sdpa"


def test_backends_by_name_and_their_read_alignment() -> None:
    assert type(build_backend("fa4", 4096)) is FA4AttentionBackend
    assert type(build_backend("triton", 4096)) is TritonAttentionBackend
    assert type(build_backend("sdpa", 4096)) is TorchSDPABackend
    assert kv_read_align("fa4") == FA4_KV_TILE == FA4AttentionBackend.kv_read_align
    assert kv_read_align("triton") == kv_read_align("sdpa") == 1
    assert set(ATTENTION_CHOICES) == {"auto", "fa4", "triton", "sdpa"}
    with pytest.raises(AttentionChoiceError):
        build_backend("auto", 4096)


def test_importing_edmm_never_imports_fa4() -> None:
    code = ("import sys, edmm.engine.engine, edmm.model.attention_fa4, edmm.bench.model_ops, "
            "benchmarks.kernels.attention; assert 'flash_attn' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True,
                   cwd=Path(__file__).resolve().parents[2])  # benchmarks/ is the repo root's


def _plain_args(seqs: list[tuple[int, int, int]], num_slots: int, skip_single: bool
                ) -> tuple[list[int], list[int], list[int]]:
    """cu_seqlens_q, seqused_q, seqused_k of (slot, queries, context) sequences, by hand."""
    cu, used_q, used_k = [0] * (num_slots + 1), [0] * num_slots, [0] * num_slots
    row = 0
    for slot, n, ctx in seqs:
        cu[slot] = row
        used_q[slot] = 0 if skip_single and n == 1 else n
        used_k[slot] = ctx
        row += n
    cu[num_slots] = row
    return cu, used_q, used_k


@pytest.mark.parametrize("skip_single", [False, True])
@pytest.mark.parametrize("seqs", [
    [(3, 5, 9), (0, 1, 40), (6, 17, 17), (2, 1, 1)],  # slots out of order, single queries
    [(1, 64, 300)],
    [(4, 2, 2), (5, 0, 1), (5, 0, 1)],  # a CUDA graph's padding: no queries, one pad slot
])
def test_fa4_args_match_a_plain_model(seqs: list[tuple[int, int, int]],
                                      skip_single: bool) -> None:
    starts = [0]
    for _, n, _ in seqs:
        starts.append(starts[-1] + n)
    as_t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    args = fa4_varlen_args(as_t(starts), as_t([s for s, _, _ in seqs]),
                           as_t([c for _, _, c in seqs]), num_slots=8, skip_single=skip_single)
    cu, used_q, used_k = _plain_args(seqs, 8, skip_single)
    assert args.cu_seqlens_q.tolist() == cu
    assert args.seqused_q.tolist() == used_q
    assert args.seqused_k.tolist() == used_k
    assert {t.dtype for t in (args.cu_seqlens_q, args.seqused_q, args.seqused_k)} == {
        torch.int32}


def test_fa4_args_from_engine_metadata() -> None:
    meta = AttentionMetadata.build([2, 0], [7, 1], [30, 12])
    assert meta.query_start_loc is not None and meta.slot_ids_t is not None
    assert meta.context_lens_t is not None
    args = fa4_varlen_args(meta.query_start_loc, meta.slot_ids_t, meta.context_lens_t, 3,
                           skip_single=True)
    assert args.cu_seqlens_q.tolist() == [7, 0, 0, 8]
    assert args.seqused_q.tolist() == [0, 0, 7]
    assert args.seqused_k.tolist() == [12, 0, 30]


@pytest.mark.skipif(fa4_available(), reason="FA4 is installed here")
def test_fa4_call_without_fa4_is_a_typed_error() -> None:
    kv = torch.zeros(2, 16, 1, 2, 1, 16, dtype=torch.bfloat16)
    q = torch.zeros(3, 2, 16, dtype=torch.bfloat16)
    args = fa4_varlen_args(torch.tensor([0, 3]), torch.tensor([1]), torch.tensor([5]), 2, True)
    with pytest.raises(KernelUnavailableError, match="pip install"):
        fa4_varlen_attention(q, kv, 0, args, 0.25)


def test_fa4_backend_rebuilds_its_arguments_once_per_pass() -> None:
    """Built at a pass's first layer, reused by its later layers, rebuilt for another pass or
    when a layer repeats (a CUDA graph's capture after its warm-up runs of the same inputs)."""
    backend = FA4AttentionBackend(64)
    kv = torch.zeros(4, 64, 3, 2, 1, 16)
    meta = AttentionMetadata.build([1], [5], [9])
    first = backend._varlen_args(meta, kv, 0)
    assert backend._varlen_args(meta, kv, 1) is first
    assert backend._varlen_args(meta, kv, 2) is first
    again = backend._varlen_args(meta, kv, 0)  # the same inputs, a new pass
    assert again is not first
    other = backend._varlen_args(AttentionMetadata.build([1], [5], [9]), kv, 1)
    assert other is not again
    assert other.seqused_k.tolist() == [0, 9, 0, 0]


def test_fa4_backend_routes_windowed_layers_to_the_reference() -> None:
    """Sliding-window layers take the reference path (FA4 is not called: no FA4 here)."""
    torch.manual_seed(0)
    meta = AttentionMetadata.build([0, 1], [4, 3], [6, 3])
    q, k, v = torch.randn(7, 2, 16), torch.randn(7, 1, 16), torch.randn(7, 1, 16)
    kv = torch.randn(2, 8, 1, 2, 1, 16)
    ref_kv = kv.clone()
    got = FA4AttentionBackend(8).forward(q, k, v, kv, 0, meta, 0.25, window=2)
    want = TorchSDPABackend().forward(q, k, v, ref_kv, 0, meta, 0.25, window=2)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(kv, ref_kv, rtol=0, atol=0)
