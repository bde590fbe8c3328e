"""Logits / greedy tokens of ``CausalLM`` (through ``load_model`` and the kv_cache) vs HF."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from model_testutils import MakeHFFolder
from torch import Tensor

from edmm.model import AttentionMetadata, CausalLM, ModelConfig, load_model

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa2": ("llama", {}),
    "llama-gqa4-headdim12-llama3": (
        "llama",
        dict(num_attention_heads=8, num_key_value_heads=2, head_dim=12, rope_scaling=LLAMA3),
    ),
    "llama-mha-tied-linear-bias": (
        "llama",
        dict(
            hidden_size=48,
            num_attention_heads=6,
            num_key_value_heads=6,
            tie_word_embeddings=True,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
            attention_bias=True,
            mlp_bias=True,
        ),
    ),
    "llama-5heads-mqa-dynamic": (
        "llama",
        dict(
            hidden_size=80,
            num_attention_heads=5,
            num_key_value_heads=1,
            rope_scaling={"rope_type": "dynamic", "factor": 2.0},
        ),
    ),
    "qwen2-gqa2": ("qwen2", {}),
    "qwen2-3heads-tied-yarn": (
        "qwen2",
        dict(
            hidden_size=48,
            num_attention_heads=3,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            rope_scaling=YARN,
        ),
    ),
    "qwen2-sliding-layer1": (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=10, max_window_layers=1),
    ),
    "qwen3-mha-headdim32-tied": (
        "qwen3",
        dict(num_key_value_heads=4, head_dim=32, tie_word_embeddings=True, rope_theta=1e6),
    ),
    "qwen3-gqa4-bias-yarn": (
        "qwen3",
        dict(
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            attention_bias=True,
            rope_scaling={**YARN, "beta_fast": 16.0, "truncate": False},
        ),
    ),
    "mistral-mqa-window12": ("mistral", dict(num_key_value_heads=1, sliding_window=12)),
    "mistral-headdim24": ("mistral", dict(head_dim=24, sliding_window=None)),
}
# (prompt length, number of prefill chunks)
PROMPTS = [(1, 1), (9, 1), (23, 1), (23, 3), (10, 2)]
NEW_TOKENS = 32
ATOL = 1e-4


def new_cache(cfg: ModelConfig, slots: int = 4, max_tokens: int = 96) -> Tensor:
    """A plain kv_cache [S, M, L, 2, Hkv, D]."""
    shape = (slots, max_tokens, cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim)
    return torch.zeros(shape)


def run(
    model: CausalLM, kv: Tensor, parts: Sequence[tuple[int, Sequence[int], int]]
) -> list[Tensor]:
    """One forward over several (slot, new tokens, tokens already cached); per-part logits."""
    ids = torch.tensor([t for _, toks, _ in parts for t in toks])
    pos = torch.cat([torch.arange(c, c + len(toks)) for _, toks, c in parts])
    meta = AttentionMetadata.build(
        [s for s, _, _ in parts], [len(t) for _, t, _ in parts], [c + len(t) for _, t, c in parts]
    )
    logits = model.compute_logits(model(ids, pos, kv, meta))  # [T, V]
    return list(logits.split([len(t) for _, t, _ in parts]))


def greedy(
    model: CausalLM, kv: Tensor, slot: int, prompt: list[int], chunks: int, n_new: int
) -> tuple[list[int], Tensor, Tensor]:
    """Chunked prefill then one-token decode steps: (tokens, prompt logits, step logits)."""
    bounds = [round(i * len(prompt) / chunks) for i in range(chunks + 1)]
    prompt_logits = [
        run(model, kv, [(slot, prompt[a:b], a)])[0] for a, b in itertools.pairwise(bounds)
    ]
    last = prompt_logits[-1][-1]
    out: list[int] = []
    steps: list[Tensor] = []
    for i in range(n_new):
        out.append(int(last.argmax()))
        steps.append(last)
        last = run(model, kv, [(slot, [out[-1]], len(prompt) + i)])[0][-1]
    return out, torch.cat(prompt_logits), torch.stack(steps)


def hf_logits(hf: Any, ids: list[int]) -> Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()  # [L, V]


def load_hf(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager"
    ).eval()


def prompt_ids(n: int, seed: int, vocab: int = 1024) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request: pytest.FixtureRequest, make_hf_folder: MakeHFFolder, tmp_path_factory: Any):
    arch, overrides = CASES[request.param]
    folder = make_hf_folder(tmp_path_factory.mktemp("hf"), arch, **overrides)
    model, cfg = load_model(folder, "cpu", torch.float32)
    return model, cfg, load_hf(folder)


@pytest.mark.parametrize(("prompt_len", "chunks"), PROMPTS)
def test_greedy_matches_hf(case: Any, prompt_len: int, chunks: int) -> None:
    model, cfg, hf = case
    prompt = prompt_ids(prompt_len, seed=prompt_len)
    tokens, prompt_logits, step_logits = greedy(
        model, new_cache(cfg), 2, prompt, chunks, NEW_TOKENS
    )
    ref = hf_logits(hf, prompt + tokens[:-1])  # [L + n - 1, V]
    torch.testing.assert_close(prompt_logits, ref[:prompt_len], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(step_logits, ref[prompt_len - 1 :], atol=ATOL, rtol=ATOL)
    assert ref[prompt_len - 1 :].argmax(-1).tolist() == tokens
    assert len(set(tokens)) >= 8, "degenerate test model"


def test_batched_mixed_matches_alone(case: Any) -> None:
    """Prefill, chunked prefill and decodes of different lengths in one forward."""
    model, cfg, hf = case
    seqs = [prompt_ids(n, seed=100 + n) for n in (11, 8, 14, 21)]
    cached = [0, 7, 9, 20]  # tokens of each sequence already in the cache
    slots = [3, 0, 2, 1]

    def prefill_history(kv: Tensor) -> None:
        for s, toks, c in zip(slots, seqs, cached, strict=True):
            if c:
                run(model, kv, [(s, toks[:c], 0)])

    kv_batch, kv_alone = new_cache(cfg), new_cache(cfg)
    prefill_history(kv_batch)
    prefill_history(kv_alone)
    parts = [(s, toks[c:], c) for s, toks, c in zip(slots, seqs, cached, strict=True)]
    batched = run(model, kv_batch, parts)
    for part, got in zip(parts, batched, strict=True):
        alone = run(model, kv_alone, [part])[0]
        torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)
        assert torch.equal(got.argmax(-1), alone.argmax(-1))
    for toks, got in zip(seqs, batched, strict=True):
        torch.testing.assert_close(got, hf_logits(hf, toks)[-len(got) :], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(kv_batch, kv_alone, atol=1e-5, rtol=1e-5)


def test_kv_cache_holds_hf_keys_and_values(case: Any) -> None:
    """kv_cache[s, t, l, 0/1] is exactly HF's (rotated) K / V of token t at layer l."""
    model, cfg, hf = case
    ids = prompt_ids(13, seed=7)
    kv = new_cache(cfg)
    run(model, kv, [(1, ids[:6], 0)])
    run(model, kv, [(1, ids[6:], 6)])
    with torch.no_grad():
        cache = hf(torch.tensor([ids]), use_cache=True).past_key_values
    for layer in range(cfg.num_layers):
        k_ref, v_ref = hf_layer_kv(cache, layer)  # [Hkv, T', D]; T' < T: HF's sliding window
        start = 13 - k_ref.shape[1]
        assert start == 0 or cfg.window_for_layer(layer) is not None
        torch.testing.assert_close(
            kv[1, start:13, layer, 0], k_ref.transpose(0, 1), atol=1e-5, rtol=1e-5
        )
        torch.testing.assert_close(
            kv[1, start:13, layer, 1], v_ref.transpose(0, 1), atol=1e-5, rtol=1e-5
        )
    assert kv[0].abs().sum() == 0 and kv[1, 13:].abs().sum() == 0


def hf_layer_kv(cache: Any, layer: int) -> tuple[Tensor, Tensor]:
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return cache.layers[layer].keys[0], cache.layers[layer].values[0]
    return cache.key_cache[layer][0], cache.value_cache[layer][0]


def test_matches_hf_generate(make_hf_folder: MakeHFFolder, tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path, "qwen3", num_attention_heads=8, num_key_value_heads=2)
    model, cfg = load_model(folder, "cpu", torch.float32)
    prompt = prompt_ids(17, seed=3)
    with torch.no_grad():
        ref = load_hf(folder).generate(
            torch.tensor([prompt]), max_new_tokens=40, do_sample=False, pad_token_id=0
        )[0, 17:]
    tokens, _, _ = greedy(model, new_cache(cfg), 0, prompt, 2, 40)
    assert tokens == ref.tolist()


def test_dynamic_ntk_past_max_positions_matches_hf_generate(
    make_hf_folder: MakeHFFolder, tmp_path: Path
) -> None:
    """Decoding one token at a time past max_position_embeddings (HF rescales per step)."""
    folder = make_hf_folder(
        tmp_path,
        "llama",
        max_position_embeddings=16,
        rope_scaling={"rope_type": "dynamic", "factor": 4.0},
    )
    model, cfg = load_model(folder, "cpu", torch.float32)
    prompt = prompt_ids(10, seed=4)
    with torch.no_grad():
        ref = load_hf(folder).generate(
            torch.tensor([prompt]), max_new_tokens=40, do_sample=False, pad_token_id=0
        )[0, 10:]
    tokens, _, _ = greedy(model, new_cache(cfg), 0, prompt, 1, 40)
    assert tokens == ref.tolist()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_bfloat16_error_is_like_hf_bfloat16(
    make_hf_folder: MakeHFFolder, tmp_path: Path, arch: str
) -> None:
    """In bf16 we are as close to the float32 reference as HF's own bf16 model is."""
    from transformers import AutoModelForCausalLM

    folder = make_hf_folder(tmp_path, arch)
    model, cfg = load_model(folder, "cpu", torch.bfloat16)
    ids = prompt_ids(30, seed=0)
    kv = new_cache(cfg).bfloat16()
    ours = run(model, kv, [(0, ids, 0)])[0]
    ref32 = hf_logits(load_hf(folder), ids)
    hf16 = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    hf_err = (hf_logits(hf16, ids) - ref32).abs().max()
    assert (ours - ref32).abs().max() <= 2 * hf_err + 1e-3
