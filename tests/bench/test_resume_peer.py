"""CPU smoke run of the transformers peer of the A/B/C resume groups."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from edmm.bench.resume import ResumeBenchConfig
from edmm.bench.resume_peer import run_peer_bench


def test_peer_groups_prefill_what_each_group_prescribes(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    cfg = ResumeBenchConfig.cpu_smoke(contexts=(64, 128), result_tokens=16, iterations=2,
                                     warmup=1)
    paths = run_peer_bench(cfg, tmp_path)
    doc = json.loads(paths["json"].read_text())
    rows = doc["rows"]
    assert {(r["context_tokens"], r["group"]) for r in rows} == {
        (n, g) for n in (64, 128) for g in "ABC"}
    for r in rows:
        context = r["context_tokens"] - 16
        want = {"A": 16, "B": 16 + context - int(0.5 * context), "C": 1}[r["group"]]
        assert r["prefilled_tokens"] == want and r["ttft_ms"] > 0
    assert [s["ratio_to_A"] for s in doc["summary"] if s["group"] == "A"] == [1.0, 1.0]
