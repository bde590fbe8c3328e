"""``edmm bench agents``'s trace and peer options: the generated trace by version (v1 as before,
byte for byte), written as JSONL or TraceLab CSV with its statistics printed, read back from
either, and bad options as one-line errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from edmm.bench.agents.fleet import FleetConfig, generate_fleet
from edmm.bench.agents.trace import GeneratorConfig, generate, read_jsonl, to_jsonl
from edmm.bench.agents.tracelab import read_tracelab
from edmm.cli import main


def _ok(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_v1_is_the_first_generator_byte_for_byte(capsys, tmp_path: Path) -> None:
    out = tmp_path / "v1.jsonl"
    _ok(capsys, ["bench", "agents", "--generator", "v1", "--jobs", "5", "--seed", "2",
                 "--loads", "2", "--write-trace", str(out)])
    want = generate(dataclasses.replace(GeneratorConfig(), num_jobs=5), 2)
    assert out.read_text() == to_jsonl(want)


def test_v2_is_the_default_and_prints_its_statistics(capsys, tmp_path: Path) -> None:
    out = tmp_path / "v2.csv"
    text = _ok(capsys, ["bench", "agents", "--jobs", "6", "--loads", "2", "--seed", "1",
                        "--turns", "20,30", "--context-limit", "65536", "--agent-types", "codex",
                        "--token-scale", "0.5", "--write-trace", str(out)])
    assert "| statistic | published | this trace | replayed (tokens x0.5, times x1) |" in text
    assert "| model calls per session, median [min-max] | ~33 [20-60] |" in text
    jobs = read_tracelab(out)
    want = generate_fleet(FleetConfig(num_jobs=6, turns=(20, 30), context_limit=65536,
                                      names=("codex",)), 1)
    assert [len(j.turns) for j in jobs] == [len(j.turns) for j in want]
    assert {j.agent for j in jobs} == {f"prefix-{round(8500 * 0.5)}"}
    again = tmp_path / "again.jsonl"  # the CSV read back and written as JSONL
    _ok(capsys, ["bench", "agents", "--trace", str(out), "--loads", "2",
                 "--write-trace", str(again)])
    assert read_jsonl(again) == jobs


@pytest.mark.parametrize("argv, words", [
    (["--turns", "30,20"], ["--turns", "low <= high"]),
    (["--agent-types", "gemini"], ["--agent-types", "gemini"]),
    (["--http", "--peer", "sglang"], ["--peer", "vllm, vllm-offload, vllm-fp8 or a URL"]),
    (["--http", "--peer", "vllm"], ["--peer vllm needs --peer-model-dir"]),
    (["--http", "--policies", "none"], ["no policy and no peer"]),
    (["--http", "--loads", "1.5"], ["--loads", "whole numbers"]),
    (["--http", "--call-tokens", "56"], ["--call-tokens", "in process only"]),
    (["--call-tokens", "0"], ["--call-tokens"]),
])
def test_bad_options_are_one_line(capsys, argv: list[str], words: list[str]) -> None:
    line = _error(capsys, ["bench", "agents", "--jobs", "2", "--loads", "1", *argv]
                  if "--loads" not in argv else ["bench", "agents", "--jobs", "2", *argv])
    for w in words:
        assert w in line, line
