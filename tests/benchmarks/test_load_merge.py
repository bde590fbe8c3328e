"""benchmarks/scripts/load_merge.py: runs written separately joined into one table with ratios."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.scripts import load_merge


def _row(server: str, c: int, tok_s: float) -> dict:
    return {"server": server, "prompt_tokens": 2048, "prefix": "fresh", "concurrency": c,
            "errors": 0, "output_tok_s": tok_s, "ttft_p50_ms": 50.0, "ttft_p90_ms": 60.0,
            "itl_p50_ms": 5.0, "itl_p90_ms": 6.0, "cached_frac": 0.0}


def test_json_and_rows_log_runs_merge_with_ratios_over_the_first(tmp_path: Path) -> None:
    a, b = tmp_path / "edmm", tmp_path / "vllm"
    a.mkdir()
    b.mkdir()
    env = {"gpu_name": "NVIDIA H100", "git_commit": "abcdef123", "command": "edmm bench load"}
    (a / "load.json").write_text(json.dumps(
        {"environment": env, "summary": [_row("EDMM", 1, 150.0), _row("EDMM", 8, 900.0)]}))
    (b / "load-rows.jsonl").write_text(json.dumps(_row("vLLM", 1, 100.0)) + "\n")
    assert load_merge.main([str(a), str(b), "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "load-merged.md").read_text()
    assert "NVIDIA H100, tree `abcdef1`" in text and "rows log only" in text
    ratios = text.split("Ratios over EDMM")[1]
    assert "| vLLM | EDMM | 2048 | fresh | 1 | 0.6667" in ratios  # 100 / 150, c=8 unmatched
    assert "| 8 |" not in ratios


def test_a_folder_without_rows_is_named_in_the_error(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        load_merge.main([str(tmp_path / "missing"), "--out", str(tmp_path / "out")])
    assert exc.value.code == 2
    assert "missing: neither load.json nor load-rows.jsonl" in capsys.readouterr().err
