"""`edmm bench ttft` agent groups (CPU smoke) and `edmm demo`."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from edmm.bench.resume import ResumeBenchConfig, run_resume_bench
from edmm.demo import main as demo_main


def test_agent_groups_write_rows_and_ratios(tmp_path: Path, tiny_dir: Path) -> None:
    cfg = ResumeBenchConfig.cpu_smoke(model=str(tiny_dir), contexts=(64, 128), iterations=2,
                                     warmup=0)
    paths = run_resume_bench(cfg, tmp_path)
    rows = list(csv.DictReader(paths["csv"].open()))
    assert len(rows) == 2 * 3 * 2
    by = {(int(r["context_tokens"]), r["group"]): r for r in rows}
    r = cfg.result_tokens
    for n in (64, 128):
        p = (n - r) // 2  # half of the session's context
        assert all(int(by[n, g]["prompt_tokens"]) == n for g in "ABC")
        assert int(by[n, "A"]["prefilled_tokens"]) == r + 1  # the result + the last turn's token
        assert int(by[n, "B"]["cached_tokens"]) == p  # recomputed from the insertion point
        assert int(by[n, "B"]["prefilled_tokens"]) == n - p
        assert (by[n, "C"]["speculation"], by[n, "C"]["prefilled_tokens"]) == ("hit", "1")
    doc = json.loads(paths["json"].read_text())
    summary = {(s["context_tokens"], s["group"]): s for s in doc["summary"]}
    for n in (64, 128):  # each group's TTFT over A's of the same context (no timing claim:
        a = summary[n, "A"]["ttft_trimmed_mean_ms"]  # two tiny CPU runs are too noisy)
        for g in "ABC":
            want = summary[n, g]["ttft_trimmed_mean_ms"] / a
            assert summary[n, g]["ratio_to_A"] == pytest.approx(want, rel=1e-3)
    assert any("8.21x / 4.18x" in note for note in doc["notes"])
    assert "ttft_trimmed_mean_ms" in paths["md"].read_text()


def test_agent_groups_run_on_a_preset_without_tokenizer(tmp_path: Path) -> None:
    """The GPU path: a preset (random weights, no tokenizer), prompts from token ids."""
    cfg = ResumeBenchConfig.cpu_smoke(model="tiny", contexts=(48,), iterations=1, warmup=0,
                                     result_tokens=8)
    rows = list(csv.DictReader(run_resume_bench(cfg, tmp_path)["csv"].open()))
    assert [r["group"] for r in rows] == ["A", "B", "C"] and rows[2]["speculation"] == "hit"


def test_agent_bench_config_is_checked() -> None:
    with pytest.raises(ValueError):
        ResumeBenchConfig(contexts=())
    with pytest.raises(ValueError):
        ResumeBenchConfig(contexts=(500,), result_tokens=512)
    with pytest.raises(ValueError):
        ResumeBenchConfig(insert_fraction=1.0)
    engine = ResumeBenchConfig().engine_config()  # the H200 run: qwen2.5-7b's 32K context fits
    assert engine.max_model_len == 32768 and engine.max_num_batched_tokens == 32768


def test_demo_outputs_are_identical_with_edmm_on_and_off(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = demo_main(["--turns", "2", "--contexts", "64", "--iterations", "1",
                      "--out", str(tmp_path)])
    text = capsys.readouterr().out
    assert code == 0
    assert "Greedy outputs identical with EDMM on and off: yes" in text
    assert "| weather |" in text and "ratio to A" in text
    assert 'model calls get_weather({"city": ' in text  # the model's own call
    assert "tool: sunny, 24 C" in text
    assert "seed" not in text and "[groups]" not in text
    assert (tmp_path / "agent-ttft.csv").is_file()
