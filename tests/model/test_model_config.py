"""ModelConfig parsing (transformers 4.x / 5.x layouts), presets, and RoPE tables vs HF."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from model_testutils import BASE_SHAPE, HF_CONFIG_CLASSES

from edmm.model import (
    PRESETS,
    SUPPORTED_ARCHITECTURES,
    CausalLM,
    ModelConfig,
    ModelError,
    ModelNotFoundError,
    UnknownPresetError,
    UnsupportedArchitectureError,
    resolve_preset,
)
from edmm.model.errors import ConfigError
from edmm.model.rope import RotaryEmbedding, default_max_positions

LLAMA_4X = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}


def hf_config(arch: str, **overrides: Any) -> Any:
    import transformers

    return getattr(transformers, HF_CONFIG_CLASSES[arch])(**{**BASE_SHAPE, **overrides})


def saved_dict(cfg: Any, tmp_path: Path) -> dict[str, Any]:
    cfg.save_pretrained(str(tmp_path))
    d: dict[str, Any] = json.loads((tmp_path / "config.json").read_text())
    return d


def test_llama31_transformers4_layout_matches_preset() -> None:
    cfg = ModelConfig.from_hf_dict(LLAMA_4X)
    assert cfg == PRESETS["llama3.1-8b"]
    assert cfg.head_dim == 128 and cfg.rope_type == "llama3"
    assert cfg.eos_token_ids == (128001, 128008, 128009)


def test_transformers5_rope_parameters_layout() -> None:
    d = {k: v for k, v in LLAMA_4X.items() if k not in ("rope_theta", "rope_scaling")}
    d["rope_parameters"] = {**LLAMA_4X["rope_scaling"], "rope_theta": 500000.0}  # type: ignore[dict-item]
    d["dtype"] = d.pop("torch_dtype")
    assert ModelConfig.from_hf_dict(d) == PRESETS["llama3.1-8b"]


@pytest.mark.parametrize("arch", list(HF_CONFIG_CLASSES))
def test_parses_what_transformers_saves(arch: str, tmp_path: Path) -> None:
    scaling = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256}
    hf = hf_config(arch, rope_theta=12345.0, rope_scaling=dict(scaling), num_key_value_heads=1)
    cfg = ModelConfig.from_hf_dict(saved_dict(hf, tmp_path))
    assert cfg.architecture == SUPPORTED_ARCHITECTURES[list(HF_CONFIG_CLASSES).index(arch)]
    assert cfg.num_kv_heads == 1 and cfg.num_heads == 4 and cfg.num_layers == 2
    assert cfg.rope_theta == 12345.0
    assert cfg.rope_scaling == scaling
    assert cfg.head_dim == (128 if arch == "qwen3" else 16)  # Qwen3Config default head_dim
    assert cfg.attention_bias == (arch == "qwen2")
    assert cfg.qk_norm == (arch == "qwen3")
    assert cfg.sliding_window == (4096 if arch == "mistral" else None)


def test_head_dim_and_defaults() -> None:
    d = {
        "model_type": "qwen3",
        "vocab_size": 10,
        "hidden_size": 64,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
    }
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.architecture == "Qwen3ForCausalLM" and cfg.head_dim == 128
    assert cfg.num_kv_heads == 4 and cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    llama = ModelConfig.from_hf_dict({**d, "model_type": "llama", "head_dim": None})
    assert llama.head_dim == 16
    old = ModelConfig.from_hf_dict(
        {**d, "model_type": "llama", "rope_scaling": {"type": "linear", "factor": 2}}
    )
    assert old.rope_scaling == {"rope_type": "linear", "factor": 2}
    default = ModelConfig.from_hf_dict({**d, "rope_scaling": {"rope_type": "default"}})
    assert default.rope_scaling is None


def test_qwen_sliding_layers() -> None:
    d = {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 64,
        "intermediate_size": 8,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "use_sliding_window": True,
        "sliding_window": 32,
        "max_window_layers": 2,
    }
    cfg = ModelConfig.from_hf_dict(d)
    assert [cfg.window_for_layer(i) for i in range(4)] == [None, None, 32, 32]
    assert ModelConfig.from_hf_dict({**d, "use_sliding_window": False}).sliding_window is None


def test_unsupported_architecture_names_supported_ones() -> None:
    with pytest.raises(UnsupportedArchitectureError) as e:
        ModelConfig.from_hf_dict({**LLAMA_4X, "architectures": ["GPT2LMHeadModel"]})
    assert isinstance(e.value, ModelError)
    for name in ["GPT2LMHeadModel", *SUPPORTED_ARCHITECTURES]:
        assert name in str(e.value)
    with pytest.raises(UnsupportedArchitectureError, match="gelu"):
        ModelConfig.from_hf_dict({**LLAMA_4X, "hidden_act": "gelu"})
    with pytest.raises(UnsupportedArchitectureError, match="longrope"):
        ModelConfig.from_hf_dict({**LLAMA_4X, "rope_scaling": {"rope_type": "longrope"}})
    with pytest.raises(ConfigError, match="intermediate_size"):
        ModelConfig.from_hf_dict({k: v for k, v in LLAMA_4X.items() if k != "intermediate_size"})
    with pytest.raises(ConfigError):
        ModelConfig.from_hf_dict({**LLAMA_4X, "num_key_value_heads": 5})


def test_from_folder_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError):
        ModelConfig.from_folder(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError):
        ModelConfig.from_folder(tmp_path)


def test_presets() -> None:
    q = resolve_preset("Qwen2.5-7B")
    assert (q.num_layers, q.hidden_size, q.num_heads, q.num_kv_heads, q.head_dim) == (
        28,
        3584,
        28,
        4,
        128,
    )
    assert (q.intermediate_size, q.vocab_size, q.rope_theta) == (18944, 152064, 1e6)
    assert q.attention_bias and not q.o_proj_bias and not q.tie_word_embeddings
    assert q.rms_norm_eps == 1e-6 and q.max_position_embeddings == 32768
    assert resolve_preset("qwen3-8b").qk_norm
    with pytest.raises(UnknownPresetError, match=r"qwen2\.5-7b"):
        resolve_preset("gpt-5")


# Parameter counts of the real checkpoints, counted on the meta device.
EXPECTED_PARAMS = {
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-32b": 32_763_876_352,
    "llama3-8b": 8_030_261_248,
    "llama3.1-8b": 8_030_261_248,
    "qwen3-8b": 8_190_735_360,
}


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_shapes_and_hf_roundtrip(name: str) -> None:
    cfg = PRESETS[name]
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    if name in EXPECTED_PARAMS:
        with torch.device("meta"):
            model = CausalLM(cfg, max_positions=16)
        assert sum(p.numel() for p in model.parameters()) == EXPECTED_PARAMS[name]


def test_to_hf_dict_is_readable_by_transformers() -> None:
    from transformers import AutoConfig

    for cfg in PRESETS.values():
        d = cfg.to_hf_dict()
        hf = AutoConfig.for_model(d.pop("model_type"), **d)
        assert hf.num_key_value_heads == cfg.num_kv_heads
        assert getattr(hf, "head_dim", cfg.head_dim) == cfg.head_dim


ROPE_CASES: dict[str, dict[str, Any]] = {
    "default": {},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 64,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "beta_fast": 16,
        "beta_slow": 2,
    },
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_tables_match_hf(case: str) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    extra = {"rope_scaling": ROPE_CASES[case]} if ROPE_CASES[case] else {}
    hf_cfg = hf_config("llama", head_dim=32, rope_theta=50000.0, **extra)
    cfg = ModelConfig.from_hf_dict(hf_cfg.to_dict())
    ours = RotaryEmbedding(cfg, 600)
    pos = torch.arange(600)
    cos_ref, sin_ref = LlamaRotaryEmbedding(hf_cfg)(torch.zeros(1), pos[None])
    torch.testing.assert_close(ours(pos)[0], cos_ref[0], atol=2e-6, rtol=0)
    torch.testing.assert_close(ours(pos)[1], sin_ref[0], atol=2e-6, rtol=0)


def test_dynamic_rope_matches_hf_per_decode_length() -> None:
    """Position p past max_position_embeddings uses HF's base for length p + 1."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_cfg = hf_config(
        "llama",
        head_dim=32,
        max_position_embeddings=32,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
    )
    cfg = ModelConfig.from_hf_dict(hf_cfg.to_dict())
    assert default_max_positions(cfg) == 64
    ours = RotaryEmbedding(cfg, 64)
    hf = LlamaRotaryEmbedding(hf_cfg)
    for p in [0, 5, 31, 32, 33, 50, 63]:
        cos_ref, sin_ref = hf(torch.zeros(1), torch.arange(p + 1)[None])
        cos, sin = ours(torch.tensor([p]))
        torch.testing.assert_close(cos[0], cos_ref[0, -1], atol=2e-6, rtol=0)
        torch.testing.assert_close(sin[0], sin_ref[0, -1], atol=2e-6, rtol=0)
