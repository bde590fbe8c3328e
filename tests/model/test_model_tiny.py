"""The embedded tiny model: build/cache, loading, tokenizer, chat template, generation."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from edmm.model import AttentionMetadata, load_model, load_tokenizer, resolve_preset
from edmm.model import tiny as tiny_mod
from edmm.model.tiny import TINY_VERSION, build_tiny_model, ensure_tiny_model

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "<think>\nOLD-THOUGHT-1\n</think>\n\n",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "tool", "content": '{"wind": 3}'},
    {"role": "assistant", "content": "<think>\nOLD-THOUGHT-2\n</think>\n\nIt is 21 degrees."},
    {"role": "user", "content": "And London?"},
    {
        "role": "assistant",
        "content": "<think>\nNEW-THOUGHT\n</think>\n\n",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "London"}'},
            }
        ],
    },
    {"role": "tool", "content": '{"temp": 15}'},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path) -> Any:
    return load_tokenizer(tiny_dir)


def test_build_is_cached_and_fast(tiny_dir: Path, tmp_path: Path) -> None:
    assert tiny_dir.name.endswith(TINY_VERSION)
    stamp = (tiny_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(tiny_dir.parent) == tiny_dir
    assert (tiny_dir / "model.safetensors").stat().st_mtime_ns == stamp
    start = time.process_time()  # CPU time: other processes' load does not stretch it
    build_tiny_model(tmp_path)
    assert time.process_time() - start < 10
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / name).read_bytes() == (tiny_dir / name).read_bytes(), name


def test_env_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDMM_CACHE", str(tmp_path))
    assert tiny_mod.cache_root() == tmp_path
    assert tiny_mod.cache_root(tmp_path / "x") == tmp_path / "x"


def test_concurrent_builds(tmp_path: Path) -> None:
    results: list[Path] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            results.append(ensure_tiny_model(tmp_path))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [results[0].name]  # no temp dirs left


def test_losing_the_rename_race(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process finishes first while we build: we keep its folder, drop ours."""
    real_build = tiny_mod.build_tiny_model
    final = tmp_path / f"tiny-qwen2-{TINY_VERSION}"

    def racing_build(folder: Path) -> None:
        real_build(folder)
        final.mkdir()
        real_build(final)  # the "other process" wins the rename

    monkeypatch.setattr(tiny_mod, "build_tiny_model", racing_build)
    assert ensure_tiny_model(tmp_path) == final
    assert [p.name for p in tmp_path.iterdir()] == [final.name]


def test_loads_like_the_preset_and_like_hf(tiny_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model, cfg = load_model(tiny_dir)
    assert cfg == resolve_preset("tiny")
    preset, _ = load_model("tiny")
    sd, ref = model.state_dict(), preset.state_dict()
    assert all(torch.equal(sd[k], ref[k]) for k in ref)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    ids = torch.arange(40, 80)
    kv = torch.zeros(1, 64, cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim)
    logits = model.compute_logits(
        model(ids, ids - 40, kv, AttentionMetadata.build([0], [40], [40]))
    )
    with torch.no_grad():
        torch.testing.assert_close(logits, hf(ids[None]).logits[0], atol=1e-4, rtol=1e-4)


def test_tokenizer_special_tokens(tokenizer: Any, tiny_dir: Path) -> None:
    cfg = resolve_preset("tiny")
    assert len(tokenizer) <= cfg.vocab_size
    names = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
    names += ["<tool_response>", "</tool_response>", "<think>", "</think>"]
    assert tokenizer.convert_tokens_to_ids(names) == list(range(9))
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id == 0
    assert set(cfg.eos_token_ids) == {tokenizer.eos_token_id, 0}
    text = 'Hi<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>'
    ids = tokenizer.encode(text)
    assert ids.count(3) == 1 and ids.count(4) == 1 and ids[-1] == 2
    assert tokenizer.decode(ids) == text
    # tool/think markers survive skip_special_tokens (they are added, not special)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text.removesuffix("<|im_end|>")
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    sample = 'The café\'s 12345 items: {"a": [1, 2]}  \n\n def f(x):\n    return x'
    assert raw.encode(sample).ids == tokenizer.encode(sample)
    assert tokenizer.decode(tokenizer.encode(sample)) == sample


def test_chat_template_tools_and_think_stripping(tokenizer: Any) -> None:
    text = tokenizer.apply_chat_template(
        CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\nYou are helpful.\n\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>\n' in text
    )
    assert (
        '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n'
        '<tool_response>\n{"wind": 3}\n</tool_response><|im_end|>\n' in text
    )
    assert "<|im_start|>assistant\nIt is 21 degrees.<|im_end|>" in text
    # reasoning before the last user query is stripped, the current loop's is kept
    assert "OLD-THOUGHT" not in text
    assert (
        '<|im_start|>assistant\n<think>\nNEW-THOUGHT\n</think>\n\n<tool_call>\n{"name": '
        '"get_weather", "arguments": {"city": "London"}}\n</tool_call><|im_end|>' in text
    )
    assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_without_tools(tokenizer: Any) -> None:
    msgs = [{"role": "user", "content": "Hello"}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    no_think = tokenizer.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_greedy_generation_is_not_degenerate(tokenizer: Any, tiny_dir: Path) -> None:
    model, cfg = load_model(tiny_dir)
    text = tokenizer.apply_chat_template(
        CONVERSATION[:2], tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    prompt = tokenizer.encode(text)
    kv = torch.zeros(1, len(prompt) + 64, cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim)
    ids, ctx, out = prompt, 0, []
    for _ in range(48):
        meta = AttentionMetadata.build([0], [len(ids)], [ctx + len(ids)])
        h = model(torch.tensor(ids), torch.arange(ctx, ctx + len(ids)), kv, meta)
        ctx += len(ids)
        ids = [int(model.compute_logits(h[-1:]).argmax())]
        out.append(ids[0])
    assert len(set(out)) >= 24, out
    assert isinstance(tokenizer.decode(out), str)
