"""`benchmarks.scripts.turn_times`: per server and turn kind, generation time and tokens."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from benchmarks.scripts.turn_times import main, turn_rows

FIELDS = ("kind", "policy", "ends_in_call", "ttft_s", "total_s", "completion_tokens")


def _csv(path: Path, turns: list[tuple[str, bool, float, float, int]]) -> Path:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        w.writeheader()
        w.writerow({"kind": "job", "policy": "edmm"})  # job rows are skipped
        for policy, call, ttft, total, tokens in turns:
            w.writerow(dict(zip(FIELDS, ("turn", policy, str(call), ttft, total, tokens),
                                strict=True)))
    return path


def test_rows_per_server_and_turn_kind(tmp_path: Path) -> None:
    path = _csv(tmp_path / "a.csv", [("edmm", True, 0.1, 0.6, 51), ("edmm", True, 0.3, 1.3, 101),
                                     ("edmm", False, 0.05, 0.15, 1), ("vllm", True, 0.2, 0.7, 51)])
    rows = {(r["server"], r["turn ends in"]): r for r in turn_rows(path)}
    call = rows["edmm", "a tool call"]
    assert call["turns"] == 2 and call["TTFT mean (ms)"] == 200.0
    assert call["generation mean (s)"] == 0.75 and call["completion tokens mean"] == 76.0
    assert call["ms / token p50"] == 10.0 and call["ms / token p90"] == 10.0
    text = rows["edmm", "text"]  # one token: no time per token after the first
    assert text["ms / token p50"] is None and text["generation mean (s)"] == 0.1
    assert rows["vllm", "a tool call"]["turns"] == 1


def test_cli_writes_the_table_and_refuses_a_missing_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _csv(tmp_path / "a.csv", [("vllm", False, 0.1, 0.3, 21)])
    assert main([str(path), "--out", str(tmp_path / "t.md")]) == 0
    assert "| vllm | text | 1 | 100.0 | 0.2 | 21.0 | 10.0 | 10.0 |" in capsys.readouterr().out
    assert (tmp_path / "t.md").read_text().startswith("| server |")
    with pytest.raises(SystemExit):
        main([str(tmp_path / "none.csv")])
