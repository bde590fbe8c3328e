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
    # On the CPU the CUDA-only kernel notes are left out and the floor is said to be a GPU's.
    gpu_notes = ("Triton prefill kernel", "attention (CUDA")
    assert not any(n.startswith(gpu_notes) for n in data["notes"])
    assert any("a GPU figure, not this CPU's" in n for n in data["notes"])
    assert "full prefill: chunks of 40 tokens (both engines), each launched without waiting " \
           "for the last" in data["notes"]


@pytest.mark.parametrize("chunk", [40, 48, 200])
def test_chunked_full_prefill_matches_one_pass(chunk: int) -> None:
    """A full prefill in passes of ``chunk`` tokens (uneven, even, more than the prompt) fills
    the same KV and picks the same token as one pass, on both engines."""
    pytest.importorskip("transformers")
    from edmm.bench.model_ops import EdmmSide, HFSide, ModelOpsConfig

    cfg = ModelOpsConfig(model="tiny", device="cpu", dtype="float32", contexts=(96,),
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


def test_attention_flag_names_the_sides() -> None:
    """``--attention`` takes a comma list of backend names; on the CPU the one EDMM side is
    the reference SDPA whatever was asked (the GPU backends are for CUDA-graph runs)."""
    from edmm.bench.model_ops import ModelOpsConfig, edmm_sides
    from edmm.cli import build_parser

    args = build_parser().parse_args(["bench", "ttft", "--attention", "fa4,triton"])
    assert args.attention == ("fa4", "triton")
    assert build_parser().parse_args(["bench", "ttft"]).attention == ("auto",)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "ttft", "--attention", "fa4,flash"])
    cpu = ModelOpsConfig(device="cpu", attentions=("fa4", "triton"))
    assert edmm_sides(cpu) == {"edmm": "sdpa"}
    assert edmm_sides(ModelOpsConfig(device="cpu", eager=True)) == {"edmm-eager": "sdpa"}


def test_engine_config_names_its_attention() -> None:
    from edmm.engine import EngineConfig, EngineConfigError

    assert EngineConfig().attention == "auto"
    with pytest.raises(EngineConfigError, match="attention must be one of"):
        EngineConfig(attention="flash")


@pytest.mark.slow  # a TP=2 process group (fast tier: tests/engine/test_tensor_parallel.py)
def test_bench_ttft_through_the_engine(tmp_path: Path) -> None:
    """``--tensor-parallel-size 2``: the three ops as engine requests, with a spawned rank over
    gloo; the cached-prefix op really hits the cache (the bench checks it)."""
    tp = 2
    rc = main(["bench", "ttft", "--only", "model", "--model", "tiny", "--device", "cpu",
               "--dtype", "float32", "--contexts", "48,96", "--repeats", "2",
               "--full-prefill-repeats", "1", "--new-tokens", "16",
               "--tensor-parallel-size", str(tp), "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "ttft-model.json").read_text())
    keys = {(r["engine"], r["op"], r["context_tokens"]) for r in data["summary"]}
    assert keys == {(f"edmm-engine-tp{tp}", op, ctx) for ctx in (48, 96)
                    for op in ("decode step", "prefill on cached prefix", "full prefill")}
    assert all(r["ms"] > 0 for r in data["rows"])
    assert any(f"tensor parallel over {tp} GPU(s)" in n for n in data["notes"])


@pytest.mark.parametrize(("engines", "title"), [
    (("edmm", "transformers"), "full prefill: EDMM beside transformers (cpu, model tiny)"),
    (("edmm",), "full prefill: EDMM (cpu, model tiny)"),  # --no-peer: no transformers rows
])
def test_plot_title_names_transformers_only_when_it_ran(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, engines: tuple[str, ...],
        title: str) -> None:
    from edmm.bench import model_ops
    titles: list[str] = []
    monkeypatch.setattr(model_ops, "plot_bars", lambda *args, **kw: titles.append(args[5]))
    summary = [{"engine": e, "op": "full prefill", "context_tokens": 48,
                "trimmed_mean_ms": 1.0} for e in engines]
    assert model_ops._plot(summary, tmp_path, "cpu", "tiny") == ["plot: ttft-full.png"]
    assert titles == [title]
