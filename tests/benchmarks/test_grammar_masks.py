"""`benchmarks.scripts.grammar_masks`: a step's grammar masks timed row by row and in
parallel, on the embedded model's tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.scripts.grammar_masks import COLUMNS, main


def test_a_row_per_batch_size_and_way_of_filling(tiny_dir: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "masks.md"
    assert main(["--tokenizer", str(tiny_dir), "--rows", "1,3", "--steps", "3",
                 "--threads", "2", "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert lines[0] == "| " + " | ".join(COLUMNS) + " |"
    cells = [line.strip("| ").split(" | ") for line in lines[2:]]
    assert [c[:3] for c in cells] == [["1", "row by row", "1"], ["1", "parallel", "2"],
                                      ["3", "row by row", "1"], ["3", "parallel", "2"]]
    assert all(float(c[3]) > 0 and float(c[4]) >= float(c[3]) for c in cells)
    assert capsys.readouterr().out == out.read_text()


def test_bad_rows_name_the_flag(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--tokenizer", str(tiny_dir), "--rows", "8,x"])
    assert "--rows" in capsys.readouterr().err
