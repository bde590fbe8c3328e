"""`edmm bench single` against a stand-in server that models a prefix cache with known costs
(the real peers, vLLM on a GPU, run on the device machine)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from edmm.bench.load import RequestRecord
from edmm.bench.peers import ServerSpec
from edmm.bench.single import (
    SingleBenchError,
    SingleConfig,
    _decode_row,
    comparison_table,
    run_single_bench,
    seed_note,
    trimmed_mean,
)
from edmm.cli import main as cli_main

STANDIN = Path(__file__).with_name("standin_server.py")


def standin(name: str, first_ms: float, prefill_us: float) -> ServerSpec:
    return ServerSpec(name, launch=(sys.executable, str(STANDIN), "--port", "{port}",
                                    "--first-ms", str(first_ms), "--token-ms", "4",
                                    "--prefill-us-per-token", str(prefill_us)),
                      ready_timeout_s=60.0)


def test_trimmed_mean_drops_the_extremes() -> None:
    assert trimmed_mean([1.0, 2.0, 3.0, 100.0]) == pytest.approx(2.5)
    assert trimmed_mean([4.0, 6.0]) == pytest.approx(5.0)


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="insert_fraction"):
        SingleConfig(insert_fraction=1.0)
    with pytest.raises(ValueError, match="decode_tokens"):
        SingleConfig(decode_tokens=1)
    with pytest.raises(ValueError, match="token_range"):
        SingleConfig(token_range=(3, 3))


def test_decode_row_time_per_token_and_errors() -> None:
    recs = [RequestRecord(ttft_s=0.1, e2e_s=0.1 + 0.004 * 9, output_tokens=10),
            RequestRecord(ttft_s=0.2, e2e_s=0.2 + 0.006 * 9, output_tokens=10)]
    row = _decode_row("X", 2, recs)
    assert row["median_ms"] == pytest.approx(5.0) and row["tok_s"] == pytest.approx(400.0)
    with pytest.raises(SingleBenchError, match="batch 2: HTTP 500"):
        _decode_row("X", 2, [*recs, RequestRecord(error="HTTP 500")])


def test_comparison_table_ratios() -> None:
    rows = [{"server": s, "measure": "A", "context": 10, "trimmed_mean_ms": v, "median_ms": 0}
            for s, v in (("E", 10.0), ("V", 20.0))]
    assert "| A | 10 | 10.00 | 20.00 | 2.00 |" in comparison_table(rows)
    rows.append({"server": "V", "measure": "B", "context": 10, "trimmed_mean_ms": 90.0})
    note = seed_note(rows)
    assert "B/A 8.21x" in note and "V at 10: B/A 4.50x" in note and "E at 10" not in note


@pytest.mark.slow  # two server subprocesses; the arithmetic: the tests above
def test_single_requests_against_stand_ins(tmp_path: Path) -> None:
    """Each measurement waits what the stand-in's prefix cache says it must (first 10 ms plus
    0.5 ms per uncached token: A 40 new tokens, B the 100 after the insertion too, full all
    240, floor 16), so A < B < full; the faster stand-in measures faster; decode per token is
    at least the stand-in's 4 ms."""
    cfg = SingleConfig(contexts=(200,), result_tokens=40, repeats=3, decode_batches=(1, 3),
                       decode_tokens=5, token_range=(10, 100_000), device="cpu")
    paths = run_single_bench(cfg, [standin("slow", 10, 500), standin("fast", 5, 250)],
                             tmp_path)
    rows = {(r["server"], r["measure"]): r for r in json.loads(
        Path(paths["json"]).read_text())["summary"]}
    for measure, uncached in (("floor", 16), ("A", 40), ("B", 140), ("full", 240)):
        assert rows[("slow", measure)]["min_ms"] >= 10 + 0.5 * uncached
        assert rows[("fast", measure)]["min_ms"] >= 5 + 0.25 * uncached
    for s in ("slow", "fast"):
        a, b, full = (rows[(s, m)]["trimmed_mean_ms"] for m in ("A", "B", "full"))
        assert a < b < full
        assert rows[(s, "decode b=3")]["median_ms"] >= 4.0 * 0.8
    assert rows[("fast", "full")]["trimmed_mean_ms"] < rows[("slow", "full")]["trimmed_mean_ms"]
    assert "| full | 200 |" in Path(paths["md"]).read_text()


def test_cli_names_the_flag_on_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli_main(["bench", "single", "--no-edmm"])
    assert e.value.code == 2
    assert "--no-edmm needs at least one --peer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["bench", "single", "--peer", "sglang"])
    assert "--peer: unknown peer 'sglang'" in capsys.readouterr().err


def test_a_bad_token_range_names_its_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli_main(["bench", "single", "--token-range", "5", "--peer", "http://127.0.0.1:9"])
    assert e.value.code == 2
    assert "--token-range: two integers LOW,HIGH, not '5'" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "expected"), [
    ([], (3, 1024)),  # the embedded model: its vocabulary, past the special ids
    (["--edmm-args", "--model /m --device cuda"], (1000, 100_000)),
    (["--edmm-args=--model=/m"], (1000, 100_000)),
    (["--edmm-args=--no-prefix-spares"], (3, 1024)),  # still the embedded model
    (["--no-edmm", "--peer", "http://127.0.0.1:9"], (1000, 100_000)),
    (["--token-range", "5,9"], (5, 9)),
])
def test_token_range_default_fits_the_served_model(argv: list[str],
                                                   expected: tuple[int, int]) -> None:
    from edmm.bench.commands.common import token_range
    from edmm.cli import build_parser

    for command in ("load", "single"):
        args = build_parser().parse_args(["bench", command, *argv])
        assert token_range(args) == expected
