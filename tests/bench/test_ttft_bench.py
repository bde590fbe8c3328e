"""CPU smoke run of ``edmm bench ttft`` on the tiny preset, EDMM beside transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from edmm.cli import main


def test_bench_ttft_smoke(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    rc = main(["bench", "ttft", "--only", "model", "--model", "tiny", "--device", "cpu",
               "--dtype", "float32", "--contexts", "48,96", "--repeats", "2",
               "--full-prefill-repeats", "1", "--new-tokens", "16", "--prefill-kernel",
               "default", "--full-prefill-chunk", "40", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "ttft-model.json").read_text())
    keys = {(r["engine"], r["op"], r["context_tokens"]) for r in data["summary"]}
    for engine in ("edmm", "transformers"):
        for op in ("decode step", "prefill on cached prefix", "full prefill"):
            for ctx in (48, 96):
                assert (engine, op, ctx) in keys
    assert all(r["ms"] > 0 for r in data["rows"])
    assert (tmp_path / "ttft-decode.png").stat().st_size > 1000
    # On the CPU the CUDA-only kernel note is left out and the floor is said to be a GPU's.
    assert not any(n.startswith("prefill kernel") for n in data["notes"])
    assert any("a GPU figure, not this CPU's" in n for n in data["notes"])
    assert "full prefill: chunks of 40 tokens (both engines), each launched without waiting " \
           "for the last" in data["notes"]


@pytest.mark.parametrize("chunk", [40, 48, 200])
def test_chunked_full_prefill_matches_one_pass(chunk: int) -> None:
    """A full prefill in passes of ``chunk`` tokens (uneven, even, more than the prompt) fills
    the same KV and picks the same token as one pass, on both engines."""
    pytest.importorskip("transformers")
    from edmm.bench.ttft import EdmmSide, HFSide, TTFTBenchConfig

    cfg = TTFTBenchConfig(model="tiny", device="cpu", dtype="float32", contexts=(96,),
                          new_tokens=16)
    edmm = EdmmSide(cfg, 96)
    ids = torch.randint(0, edmm.cfg.vocab_size, (96,), generator=torch.Generator().manual_seed(0))
    try:
        one = int(edmm.extend(ids))
        kv_one = edmm.arena.kv[edmm.slot, :96].clone()  # [96, layers, 2, Hkv, D]
        edmm.truncate(0)
        assert int(edmm.extend(ids, chunk)) == one
        assert edmm.arena.num_tokens(edmm.slot) == 96
        torch.testing.assert_close(edmm.arena.kv[edmm.slot, :96], kv_one)
    finally:
        edmm.close()
    hf = HFSide(cfg, edmm.cfg)
    one = int(hf.extend(ids))
    hf.truncate(0)
    assert int(hf.extend(ids, chunk)) == one
    assert hf.cache.get_seq_length() == 96
