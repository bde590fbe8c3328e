"""bf16 model outputs on the H200 against HF transformers (float32 reference)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.kernels.matmul_sweep import projections
from edmm.kernels._common import SkinnyConfig
from edmm.kernels.fa4 import fa4_usable
from edmm.kernels.matmul_routes import MatmulRoutes, route_row
from edmm.kernels.skinny_matmul import RoutedMatmul
from edmm.memory import KVArena, KVSpec, PagePool
from edmm.memory.backends import open_backend
from edmm.model.attention import AttentionMetadata
from edmm.model.attention_choice import build_backend, kv_read_align
from edmm.model.attention_fa4 import FA4AttentionBackend
from edmm.model.attention_triton import TritonAttentionBackend
from edmm.model.config import ModelConfig
from edmm.model.loader import load_model

pytestmark = pytest.mark.gpu


def _hf_folder(tmp_path: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=4096, hidden_size=512, intermediate_size=1408,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                      max_position_embeddings=8192, rope_theta=1e6, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(tmp_path)
    return tmp_path


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _skinny_everywhere(cfg: ModelConfig) -> RoutedMatmul:
    """Routes every projection and the LM head of ``cfg`` to a split skinny launch at up to
    16 rows (the decode steps' products and the last-token logits)."""
    split = SkinnyConfig(block_n=64, block_k=128, splits=4)
    return RoutedMatmul(MatmulRoutes.from_rows(
        [route_row(16, s.n, s.k, split, 1.0, 2.0) for s in projections(cfg)]))


@pytest.mark.parametrize("kernels", ["sdpa", "triton", "triton-skinny", "fa4"])
@torch.inference_mode()
def test_bf16_logits_match_transformers(tmp_path: Path, kernels: str) -> None:
    """bf16 logits through the loader's reference SDPA backend, the engine's Triton one
    (with cuBLAS, or with every decode-step product on the skinny matmul kernel) or the FA4
    one (FA4 prefill, Triton decode) (two prefill chunks, then decode steps) against
    transformers in float32, as close as transformers in bf16 is."""
    from transformers import AutoModelForCausalLM

    if kernels == "fa4" and not fa4_usable("cuda"):
        pytest.skip("FA4 (flash_attn.cute) not importable or not a FA4 GPU")

    folder = _hf_folder(tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    hf16 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    model, cfg = load_model(folder, "cuda", torch.bfloat16)
    if kernels == "triton-skinny":
        kernels = "triton"
        model.set_matmul(_skinny_everywhere(cfg))
    if kernels != "sdpa":
        model.set_backend(build_backend(kernels, 4096))
        want_type = FA4AttentionBackend if kernels == "fa4" else TritonAttentionBackend
        assert type(model.backend) is want_type
    backend = open_backend("cuda")
    pool = PagePool(backend, 16)
    spec = KVSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    arena = KVArena(pool, spec, num_slots=2, max_tokens=4096,
                    read_align=kv_read_align(kernels))
    slot = arena.allocate()
    ids = torch.randint(0, cfg.vocab_size, (1200,), device="cuda")
    # Prefill 1100 tokens in two chunks, then 100 decode steps; logits of every step.
    logits = []
    pos = 0
    for n in (700, 400) + (1,) * 100:
        arena.grow(slot, pos + n)
        meta = AttentionMetadata.build([slot], [n], [pos + n], "cuda")
        h = model(ids[pos:pos + n], torch.arange(pos, pos + n, device="cuda"), arena.kv, meta)
        logits.append(model.compute_logits(h[-1:]))
        pos += n
    ours = torch.cat(logits)  # [102, vocab]
    ends = [700, 1100, *range(1101, 1201)]
    full_ref = ref(ids[None]).logits[0].float()  # [1200, vocab]
    full_16 = hf16(ids[None]).logits[0].float()
    want = full_ref[[e - 1 for e in ends]]
    hf_err = _rel(full_16[[e - 1 for e in ends]], want)
    our_err = _rel(ours, want)
    assert our_err < 2e-2, (our_err, hf_err)
    assert our_err < 2 * hf_err + 5e-3, (our_err, hf_err)
    agree = (ours.argmax(-1) == want.argmax(-1)).float().mean().item()
    hf_agree = (full_16[[e - 1 for e in ends]].argmax(-1) == want.argmax(-1)).float().mean()
    assert agree >= float(hf_agree) - 0.1, (agree, float(hf_agree))
    arena.check_integrity()
    arena.close()
    pool.close()
    backend.close()



@pytest.mark.skipif(not fa4_usable("cuda"), reason="FA4 not importable or not a FA4 GPU")
@torch.inference_mode()
def test_fa4_mixed_graphs_match_eager_passes(tmp_path: Path) -> None:
    """The engine's graph runner with the FA4 backend (FA4 compiled at capture): mixed and
    prefill batches of several sizes replayed from graphs (padding sequences, a decode row
    riding along) give the hidden states the same backend gives eagerly."""
    from edmm.engine.cuda_graph import CudaGraphRunner
    from edmm.engine.runner import ModelInputs, ModelRunner

    model, cfg = load_model(_hf_folder(tmp_path), "cuda", torch.bfloat16)
    model.set_backend(build_backend("fa4", 4096))
    model.enable_fusion()
    backend = open_backend("cuda")
    pool = PagePool(backend, 32)
    spec = KVSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    arena = KVArena(pool, spec, num_slots=4, max_tokens=4096, read_align=kv_read_align("fa4"))
    graphs = CudaGraphRunner(model, arena, "cuda", sizes=(1, 2), token_sizes=(64, 512),
                             max_seqs=3)
    eager = ModelRunner(model, arena, "cuda")
    slots = [arena.allocate(), arena.allocate()]
    ids = torch.randint(0, cfg.vocab_size, (2, 2000), device="cuda")

    def inputs(news: list[tuple[int, int]]) -> ModelInputs:
        """Append ``n`` tokens to each (slot index, n) and build the pass's inputs."""
        starts = [arena.num_tokens(slots[i]) for i, _ in news]
        for (i, n), s in zip(news, starts, strict=True):
            arena.grow(slots[i], s + n)
        meta = AttentionMetadata.build([slots[i] for i, _ in news], [n for _, n in news],
                                       [s + n for (_, n), s in zip(news, starts, strict=True)],
                                       "cuda")
        tok = torch.cat([ids[i, s:s + n] for (i, n), s in zip(news, starts, strict=True)])
        assert meta.token_index is not None and meta.last_token_index is not None
        return ModelInputs(tok, meta.token_index, meta, meta.last_token_index, [], [], [])

    bad = []
    for step, news in enumerate([[(0, 700)], [(0, 300), (1, 40)], [(0, 1), (1, 50)],
                                 [(1, 1), (0, 200)], [(0, 1), (1, 1)]]):
        batch = inputs(news)
        want = eager.forward(batch).float()  # eager first; the replay rewrites the same KV
        got = graphs.forward(batch).float()
        err = _rel(got, want)
        if not err < 1e-2 or got.isnan().any():  # split counts differ (3 vs 2 sequences)
            bad.append((step, news, err))
    assert not bad, bad
    assert graphs.replays["mixed"] == 3 and graphs.replays["decode"] == 1, graphs.replays
    graphs.close()
    arena.check_integrity()
    arena.close()
    pool.close()
    backend.close()
