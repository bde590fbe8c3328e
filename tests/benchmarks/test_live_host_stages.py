"""`benchmarks.scripts.live_host_stages` on the tiny model's tokenizer: every stage timed."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("fastapi")  # the server extra (the GPU machine has none)
pytest.importorskip("openai")

from benchmarks.scripts.live_host_stages import measure
from edmm.bench.live import load_tokenizer


def test_every_stage_is_timed(tiny_dir: Path) -> None:
    rows = measure(load_tokenizer(str(tiny_dir)), 2048, runs=2)
    stages = [r["stage"] for r in rows]
    assert stages == ["sdk", "parse", "parse, FastAPI's way", "convert", "surrogate check",
                      "render+tokenize", "render+tokenize window", "render+tokenize unprepared",
                      "render+tokenize uncut",
                      "full render+tokenize", "request"]
    assert all(r["min_ms"] > 0 and r["n"] == 2 for r in rows)
    assert abs(rows[0]["prompt_tokens"] - 2048) < 80


@pytest.mark.slow  # a server, subprocess or seconds of waiting: the thorough tier
def test_body_transfer_parts(tiny_dir: Path) -> None:
    """`benchmarks.scripts.body_transfer`: every part of the body's way is timed, in order."""
    pytest.importorskip("uvicorn")
    from benchmarks.scripts.body_transfer import measure, resume_body
    from edmm.bench.peers import free_port as _free_port

    body = resume_body(load_tokenizer(str(tiny_dir)), 2048)
    parts = measure(body, 2, _free_port())
    assert all(len(v) == 2 for v in parts.values())
    first = [max(parts[p]) for p in ("httpx before its first write", "first bytes at the server",
                                     "app called", "body read")]
    assert all(x > 0 for x in first)
    assert all(a <= b for a, b in zip(parts["app called"], parts["body read"], strict=True))
    assert min(parts["writes"]) >= 2 and min(parts["reads"]) >= 1


def test_resume_engine_path_times_a_speculation_hit(tiny_dir: Path) -> None:
    """`benchmarks.scripts.resume_engine_path`: every part of a C resume on the engine thread
    is timed, each run a speculation hit (the script checks it)."""
    from benchmarks.scripts.resume_engine_path import measure as engine_path

    rows = engine_path(str(tiny_dir), 2048, runs=2)
    assert [r["part"] for r in rows] == ["begin", "cache match", "first step"]
    assert all(r["min_ms"] > 0 and r["n"] == 2 for r in rows)
    by_part = {r["part"]: r["min_ms"] for r in rows}
    assert by_part["cache match"] < by_part["first step"]  # the match is part of the step
