"""CPU smoke run of ``edmm bench ttft`` on the tiny preset, EDMM beside transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edmm.cli import main


def test_bench_ttft_smoke(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    rc = main(["bench", "ttft", "--only", "model", "--model", "tiny", "--device", "cpu",
               "--dtype", "float32", "--contexts", "48,96", "--repeats", "2",
               "--full-prefill-repeats", "1", "--new-tokens", "16", "--prefill-kernel",
               "default", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "ttft-model.json").read_text())
    keys = {(r["engine"], r["op"], r["context_tokens"]) for r in data["summary"]}
    for engine in ("edmm", "transformers"):
        for op in ("decode step", "prefill on cached prefix", "full prefill"):
            for ctx in (48, 96):
                assert (engine, op, ctx) in keys
    assert all(r["ms"] > 0 for r in data["rows"])
    assert (tmp_path / "ttft-decode.png").stat().st_size > 1000
    assert any(n.startswith("prefill kernel (CUDA, not eager): default (") for n in data["notes"])
