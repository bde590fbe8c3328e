"""``edmm bench ttft --only model`` with ``--kv-cache-dtype`` and ``--decode-batch``: the
model-level ops timed per KV cache dtype, and decode steps of several sequences (CPU smoke)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from edmm.cli import build_parser, main


def test_bench_ttft_times_each_kv_dtype_and_batched_decodes(tmp_path: Path) -> None:
    rc = main(["bench", "ttft", "--only", "model", "--model", "tiny", "--device", "cpu",
               "--dtype", "float32", "--contexts", "48", "--repeats", "1",
               "--full-prefill-repeats", "1", "--new-tokens", "16", "--no-peer",
               "--kv-cache-dtype", "bf16,fp8", "--decode-batch", "1,3", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "ttft-model.json").read_text())
    keys = {(r["engine"], r["op"], r["context_tokens"]) for r in data["summary"]}
    ops = ("decode step", "prefill on cached prefix", "full prefill", "decode step x3")
    assert keys == {(e, op, 48) for e in ("edmm", "edmm-kv-fp8") for op in ops}
    assert all(r["ms"] > 0 for r in data["rows"])
    batched = [r for r in data["summary"] if r["op"] == "decode step x3"]
    assert all(r["compute_floor_ms"] > 0 for r in batched)
    assert any(n.startswith("KV cache: bf16, fp8") for n in data["notes"])
    assert any("decode step xB" in n for n in data["notes"])
    assert (tmp_path / "ttft-decode-x3.png").stat().st_size > 1000


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_a_batched_decode_step_decodes_every_copy_alike(kv_cache_dtype: str) -> None:
    """The copies `fill_batch` makes hold the slot's KV on their own pages, and a decode step
    of the batch picks, for each, the token the slot alone picks."""
    from edmm.bench.model_ops import EdmmSide, ModelOpsConfig

    cfg = ModelOpsConfig(model="tiny", device="cpu", dtype="float32", contexts=(48,),
                          new_tokens=16, decode_batches=(1, 3))
    side = EdmmSide(cfg, 48, kv_cache_dtype=kv_cache_dtype)
    try:
        ids = torch.randint(0, side.cfg.vocab_size, (48,),
                            generator=torch.Generator().manual_seed(0))
        side.extend(ids[:47])
        alone = int(side.extend(ids[47:]))
        side.truncate(47)
        side.fill_batch(3, 47)
        pages = [set(side.arena.slot_pages(s)) for s in (side.slot, *side.copies)]
        assert all(not a & b for i, a in enumerate(pages) for b in pages[i + 1:])
        assert side.decode_batch(ids[47:48], 3).tolist() == [alone] * 3
        assert [side.arena.num_tokens(s) for s in (side.slot, *side.copies)] == [48] * 3
        assert side.arena.spec.dtype == (torch.float8_e4m3fn if kv_cache_dtype == "fp8"
                                         else torch.float32)
        side.arena.check_integrity()
    finally:
        side.close()


def test_kv_flags_parse_and_refuse_the_engine_path(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["bench", "ttft", "--kv-cache-dtype", "bf16,fp8",
                                      "--decode-batch", "1,32"])
    assert args.kv_cache_dtype == ("bf16", "fp8") and args.decode_batch == (1, 32)
    assert build_parser().parse_args(["bench", "ttft"]).kv_cache_dtype == ("auto",)
    for argv, words in ((["--kv-cache-dtype", "fp16"], "--kv-cache-dtype"),
                        (["--decode-batch", "0"], "--decode-batch"),
                        (["--kv-cache-dtype", "fp8", "--tensor-parallel-size", "2"],
                         "not with --tensor-parallel-size")):
        with pytest.raises(SystemExit) as exc:
            main(["bench", "ttft", "--only", "model", "--device", "cpu", *argv])
        assert exc.value.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and words in lines[0], lines
