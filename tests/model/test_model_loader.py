"""load_model: HF folders (single / sharded / tied), typed errors, presets, export."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from model_testutils import MakeHFFolder
from safetensors.torch import load_file, save_file

from edmm.model import (
    MissingTensorError,
    ModelError,
    ModelNotFoundError,
    ShapeMismatchError,
    UnexpectedTensorError,
    UnsupportedArchitectureError,
    load_model,
)
from edmm.model.loader import export_hf_state_dict, hf_tensor_targets


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def rewrite_weights(folder: Path, edit: dict[str, torch.Tensor | None]) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    for name, value in edit.items():
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    save_file(tensors, str(path), {"format": "pt"})


def test_roundtrip_through_hf_names(make_hf_folder: MakeHFFolder, tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path, "qwen3", attention_bias=True)
    model, cfg = load_model(folder)
    hf = load_file(str(folder / "model.safetensors"))
    ours = export_hf_state_dict(model)
    assert ours.keys() == hf.keys() == hf_tensor_targets(cfg).keys()
    assert all(torch.equal(ours[k], hf[k]) for k in hf)


def test_sharded_equals_single(make_hf_folder: MakeHFFolder, tmp_path: Path) -> None:
    single = make_hf_folder(tmp_path / "a", "llama")
    sharded = make_hf_folder(tmp_path / "b", "llama", max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert not (sharded / "model.safetensors").exists()
    assert same_weights(load_model(single)[0], load_model(sharded)[0])


def test_tied_checkpoint_has_no_lm_head(make_hf_folder: MakeHFFolder, tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path, "qwen2", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(str(folder / "model.safetensors"))
    model, cfg = load_model(folder)
    assert cfg.tie_word_embeddings and model.lm_head is None
    h = torch.randn(3, cfg.hidden_size)
    torch.testing.assert_close(
        model.compute_logits(h), h @ model.model.embed_tokens.weight.T, atol=1e-5, rtol=1e-5
    )


def test_dtype_and_device(make_hf_folder: MakeHFFolder, tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path, "mistral")
    model, _ = load_model(folder, torch.device("cpu"), "bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rotary.cos_cache.dtype == torch.bfloat16
    assert not any(p.requires_grad for p in model.parameters()) and not model.training
    ref, _ = load_model(folder)
    assert torch.equal(model.rotary.cos_cache, ref.rotary.cos_cache.bfloat16())


def test_missing_tensor_is_named(make_hf_folder: MakeHFFolder, tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path, "qwen2")
    rewrite_weights(folder, {"model.layers.1.self_attn.k_proj.bias": None})
    with pytest.raises(MissingTensorError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_model(folder)


def test_untied_without_lm_head_is_missing(make_hf_folder: MakeHFFolder, tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path, "llama")
    rewrite_weights(folder, {"lm_head.weight": None})
    with pytest.raises(MissingTensorError, match=r"lm_head\.weight") as e:
        load_model(folder)
    assert e.value.tensor_name == "lm_head.weight" and isinstance(e.value, ModelError)


def test_shape_mismatch_names_tensor_and_shapes(
    make_hf_folder: MakeHFFolder, tmp_path: Path
) -> None:
    folder = make_hf_folder(tmp_path, "llama")
    cfg_path = folder / "config.json"
    d = json.loads(cfg_path.read_text())
    d["intermediate_size"] = 100
    cfg_path.write_text(json.dumps(d))
    with pytest.raises(ShapeMismatchError) as e:
        load_model(folder)
    msg = str(e.value)
    assert "model.layers.0.mlp.gate_proj.weight" in msg or "down_proj" in msg
    assert "[96, 64]" in msg or "[64, 96]" in msg
    assert "[100, 64]" in msg or "[64, 100]" in msg
    assert e.value.got != e.value.expected


def test_unsupported_architecture_in_folder(make_hf_folder: MakeHFFolder, tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path, "llama")
    d = json.loads((folder / "config.json").read_text())
    d["architectures"] = ["PhiForCausalLM"]
    (folder / "config.json").write_text(json.dumps(d))
    with pytest.raises(UnsupportedArchitectureError, match=r"PhiForCausalLM.*LlamaForCausalLM"):
        load_model(folder)


def test_extra_tensors(
    make_hf_folder: MakeHFFolder, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = make_hf_folder(tmp_path, "llama")
    rewrite_weights(
        folder,
        {
            "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8),
            "model.vision_tower.weight": torch.ones(2),
        },
    )
    with caplog.at_level(logging.WARNING):
        load_model(folder)
    assert "model.vision_tower.weight" in caplog.text and "inv_freq" not in caplog.text
    with pytest.raises(UnexpectedTensorError) as e:
        load_model(folder, strict=True)
    assert e.value.tensor_names == ("model.vision_tower.weight",)


def test_missing_folder_config_or_weights(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="tiny"):  # lists the presets
        load_model(tmp_path / "nope")
    with pytest.raises(ModelNotFoundError, match=r"config\.json"):
        load_model(tmp_path)
    from edmm.model.config import PRESETS

    (tmp_path / "config.json").write_text(json.dumps(PRESETS["tiny"].to_hf_dict()))
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        load_model(tmp_path)


def test_preset_random_init_is_deterministic() -> None:
    a, cfg = load_model("tiny")
    b, _ = load_model("TINY")
    c, _ = load_model("tiny", seed=1)
    assert same_weights(a, b) and not same_weights(a, c)
    sd = a.state_dict()
    w = sd["model.layers.0.self_attn.qkv_proj.weight"]
    assert abs(float(w.std()) - cfg.hidden_size**-0.5) < 0.01
    assert float(sd["model.norm.weight"].min()) == 1.0
    assert sd["model.layers.0.self_attn.qkv_proj.bias"].abs().sum() == 0
