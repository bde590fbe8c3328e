"""bf16 model outputs on the H200 against HF transformers (float32 reference)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edmm.kernels.fa4 import fa4_usable
from edmm.memory import KVArena, KVSpec, PagePool
from edmm.memory.backends import open_backend
from edmm.model.attention import AttentionMetadata
from edmm.model.attention_choice import build_backend, kv_read_align
from edmm.model.attention_fa4 import FA4AttentionBackend
from edmm.model.attention_triton import TritonAttentionBackend
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


@pytest.mark.parametrize("kernels", ["sdpa", "triton", "fa4"])
@torch.inference_mode()
def test_bf16_logits_match_transformers(tmp_path: Path, kernels: str) -> None:
    """bf16 logits through the loader's reference SDPA backend, the engine's Triton one or
    the FA4 one (FA4 prefill, Triton decode) (two prefill chunks, then decode steps) against
    transformers in float32, as close as transformers in bf16 is."""
    from transformers import AutoModelForCausalLM

    if kernels == "fa4" and not fa4_usable("cuda"):
        pytest.skip("FA4 (flash_attn.cute) not importable or not a FA4 GPU")

    folder = _hf_folder(tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    hf16 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    model, cfg = load_model(folder, "cuda", torch.bfloat16)
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

