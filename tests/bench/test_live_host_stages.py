"""`edmm.bench.scripts.live_host_stages` on the tiny model's tokenizer: every stage timed."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("fastapi")  # the server extra (the GPU machine has none)
pytest.importorskip("openai")

from edmm.bench.live import load_tokenizer
from edmm.bench.scripts.live_host_stages import measure


def test_every_stage_is_timed(tiny_dir: Path) -> None:
    rows = measure(load_tokenizer(str(tiny_dir)), 2048, runs=2)
    stages = [r["stage"] for r in rows]
    assert stages == ["sdk", "parse", "parse, FastAPI's way", "convert", "surrogate check",
                      "render+tokenize", "render+tokenize unprepared", "full render+tokenize",
                      "request"]
    assert all(r["min_ms"] > 0 and r["n"] == 2 for r in rows)
    assert abs(rows[0]["prompt_tokens"] - 2048) < 80
