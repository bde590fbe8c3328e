"""``benchmarks.scripts.call_tokens``: device call 18 reads the forced call's length of the
newest HTTP fleet run on its machine."""

from __future__ import annotations

import json
import os
from pathlib import Path

from benchmarks.scripts.call_tokens import call_tokens, main


def _run(folder: Path, rows: list[dict[str, object]], mtime: float) -> None:
    folder.mkdir(parents=True)
    path = folder / "agents-http.json"
    path.write_text(json.dumps({"summary": rows}))
    os.utime(path, (mtime, mtime))


def test_the_newest_runs_edmm_row_decides(tmp_path: Path, capsys) -> None:
    assert call_tokens([tmp_path / "none"]) is None
    _run(tmp_path / "a" / "load-32", [{"server": "edmm serve", "call_tokens": 50}], 1000)
    _run(tmp_path / "b" / "load-32", [{"server": "vLLM", "call_tokens": 61},
                                      {"server": "edmm serve", "call_tokens": 56}], 2000)
    assert call_tokens([tmp_path / "a", tmp_path / "b"]) == 56
    _run(tmp_path / "c", [{"server": "vLLM", "call_tokens": 61}], 3000)  # vLLM alone
    assert call_tokens([tmp_path]) == 61
    assert main([str(tmp_path / "a")]) == 0
    assert capsys.readouterr().out.strip() == "50"
    assert main([str(tmp_path / "none")]) == 0 and capsys.readouterr().out == ""
