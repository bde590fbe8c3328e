"""`benchmarks.scripts.fp8_kv_accuracy` on cut prompts: a row per (prompt, cache), BF16 KV
closer to FP32 KV than FP8 KV, and the Markdown table of them."""

from __future__ import annotations

from benchmarks.scripts.fp8_kv_accuracy import PROMPTS, markdown, measure


def test_rows_per_prompt_and_cache() -> None:
    rows = measure(headrooms=(16.0, 64.0), unit_scales=True, max_prompt_tokens=24)
    caches = ["bf16", "fp8, headroom 16", "fp8, headroom 64", "fp8, scales 1.0"]
    assert [(r["prompt"], r["cache"]) for r in rows] == [(p, c) for p in PROMPTS for c in caches]
    assert all(r["tokens"] == 24 for r in rows)
    for prompt in PROMPTS:
        got = {r["cache"]: r for r in rows if r["prompt"] == prompt}
        assert 0 < got["bf16"]["rel_mean"] < got["fp8, headroom 16"]["rel_mean"]
        assert all(0 <= r["argmax"] <= 1 and r["kl_mean"] >= 0 for r in got.values())
    table = markdown(rows).splitlines()
    assert len(table) == 2 + len(rows) and table[2].startswith("| weather | 24 | bf16 |")
