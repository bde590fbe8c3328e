"""The README results tables, regenerated from the committed H200 results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.scripts.results_table import (
    BEGIN,
    END,
    ResultsTableError,
    main,
    render,
    replace_block,
    result_dirs,
)

H200 = Path(__file__).resolve().parents[2] / "benchmarks/results/2026-11-29-h200"


def _summary(name: str) -> list[dict]:
    return json.loads((H200 / name).read_text())["summary"]


def _row(table: str, label: str) -> list[str]:
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == label:
            return cells
    raise AssertionError(f"no row {label!r}")


def test_group_rows_equal_the_json() -> None:
    out = render([H200])
    for name, label in (("agent-ttft.json", "EDMM"),
                        ("agent-ttft-transformers.json", "transformers")):
        by = {(r["context_tokens"], r["group"]): r["ttft_trimmed_mean_ms"]
              for r in _summary(name)}
        for ctx in (4096, 16384, 32768):
            cells = _row(out, f"{ctx // 1024}K {label}")
            t = {g: by[(ctx, g)] for g in "ABC"}
            for cell, g in zip(cells[1:4], "ABC", strict=True):
                want = f"{t[g]:.0f} ms" if t[g] >= 1000 else f"{t[g]:.1f} ms"
                assert cell == want
            assert cells[4] == f"{t['B'] / t['A']:.2f}x" and cells[5] == f"{t['C'] / t['A']:.2f}"
    seed = _row(out, "seed (vLLM live / standalone)")
    assert seed[4:] == ["8.21x / 4.18x", "1.17 / 0.96"]
    # Spot checks against the README as written.
    assert _row(out, "4K EDMM")[1:] == ["35.3 ms", "65.2 ms", "6.2 ms", "1.85x", "0.18"]
    assert _row(out, "32K transformers")[2] == "1175 ms"


def test_vmm_line_and_model_table_equal_the_json() -> None:
    out = render([H200])
    vmm = {(r["op"], r["context_tokens"]): r for r in _summary("vmm-cuda.json")}
    commits = [vmm[("commit at resume (slot swap)", c)]["median_us"]
               for c in (4096, 16384, 32768)]
    assert " / ".join(f"{x:.1f}" for x in commits) + " µs at 4K / 16K / 32K" in out
    assert "remap 42.8 µs per 2 MiB page" in out and "40.0 µs through bare" in out
    assert "(1.07x, target ≤ 1.2x)" in out and "448 shared pages in 13.2 ms" in out
    assert "0.94 GB: 0.45 ms" in out and "0.25 / 0.64 / 1.12 ms at 4K / 16K / 32K" in out
    model = {(r["engine"], r["op"]): r for r in _summary("ttft-model.json")
             if r["context_tokens"] == 16384}
    decode = _row(out, "decode step")
    assert decode[1] == f"{model[('edmm', 'decode step')]['trimmed_mean_ms']:.2f} ms" == "5.14 ms"
    assert decode[2] == "18.7 ms" and "missed by 3%" in decode[3]
    assert _row(out, "512 tokens on a cached prefix")[1:3] == ["22.7 ms", "38.6 ms"]
    full = _row(out, "full prefill")
    assert full[1:3] == ["504 ms", "506 ms"] and full[3].endswith("(339 ms) — missed: 1.49x")
    assert "12.7 ms" in _row(out, "512 tokens on a cached prefix")[3]


def test_every_number_comes_from_the_folder(tmp_path: Path) -> None:
    """Only the agent file: only the A/B/C table, EDMM rows; numbers follow the file."""
    doc = json.loads((H200 / "agent-ttft.json").read_text())
    for r in doc["summary"]:
        r["ttft_trimmed_mean_ms"] *= 2
    (tmp_path / "agent-ttft.json").write_text(json.dumps(doc))
    out = render([tmp_path])
    assert "transformers" not in out and "VMM" not in out
    assert _row(out, "4K EDMM")[1] == "70.6 ms"
    with pytest.raises(ResultsTableError):
        render([tmp_path / "empty"])


def test_first_folder_wins_and_the_live_table(tmp_path: Path) -> None:
    """A newer folder's files shadow an older one's; the live table takes the streamed TTFT,
    or the non-streamed latency where no TTFT was measured (NaN)."""
    doc = json.loads((H200 / "agent-ttft.json").read_text())
    for r in doc["summary"]:
        r["ttft_trimmed_mean_ms"] /= 2
    (tmp_path / "agent-ttft.json").write_text(json.dumps(doc))
    live = [{"context_tokens": 4096, "group": g, "prompt_tokens": 4100 + i,
             "cached_tokens": 4000 + i, "ttft_trimmed_mean_ms": t, "total_trimmed_mean_ms": 2 * i}
            for i, (g, t) in enumerate((("A", 40.0), ("B", 80.0), ("C", 20.0)), start=1)]
    live.append({"context_tokens": 8192, "group": "A", "prompt_tokens": 1, "cached_tokens": 1,
                 "ttft_trimmed_mean_ms": None, "total_trimmed_mean_ms": 50.0})  # as written
    live += [{"context_tokens": 8192, "group": g, "prompt_tokens": 9, "cached_tokens": 8,
              "ttft_trimmed_mean_ms": float("nan"), "total_trimmed_mean_ms": t}
             for g, t in (("B", 200.0), ("C", 25.0))]
    (tmp_path / "agent-ttft-live.json").write_text(json.dumps({"summary": live}))
    out = render([tmp_path, H200])
    assert _row(out, "4K EDMM")[1] == "17.7 ms"  # the newer folder's file (35.3 / 2)
    assert "VMM" in out and "| 16K context |" in out  # the older folder fills the rest
    assert _row(out, "4K")[1:7] == ["40.0 ms", "80.0 ms", "20.0 ms", "2.00x", "0.50",
                                    "4003 / 4103"]
    assert _row(out, "8K")[1:6] == ["50.0 ms", "200.0 ms", "25.0 ms", "4.00x", "0.50"]
    # The live folder holds the in-process groups too: what HTTP adds (4K only: no 8K run).
    alone = {(r["context_tokens"], r["group"]): r["ttft_trimmed_mean_ms"] for r in doc["summary"]}
    assert _row(out, "4K")[7] == (f"{40.0 - alone[(4096, 'A')]:.1f} ms / "
                                  f"{20.0 - alone[(4096, 'C')]:.1f} ms")
    assert _row(out, "8K")[7] == ""


def test_the_live_table_without_the_same_runs_groups(tmp_path: Path) -> None:
    """Live groups from a folder without in-process ones: no "HTTP adds" column; the SDK's
    share is shown beside it when the live file has it."""
    live = [{"context_tokens": 16384, "group": g, "prompt_tokens": 9, "cached_tokens": 8,
             "ttft_trimmed_mean_ms": t, "total_trimmed_mean_ms": t, "sdk_median_ms": 4.0}
            for g, t in (("A", 30.0), ("B", 300.0), ("C", 10.0))]
    (tmp_path / "agent-ttft-live.json").write_text(json.dumps({"summary": live}))
    out = render([tmp_path, H200])
    assert "HTTP adds" not in out and len(_row(out, "16K")) == 7
    (tmp_path / "agent-ttft.json").write_text((H200 / "agent-ttft.json").read_text())
    row = _row(render([tmp_path]), "16K")
    alone = {(r["context_tokens"], r["group"]): r["ttft_trimmed_mean_ms"]
             for r in _summary("agent-ttft.json")}
    assert row[7:] == [f"{30.0 - alone[(16384, 'A')]:.1f} ms / "
                       f"{10.0 - alone[(16384, 'C')]:.1f} ms", "4.0 ms / 4.0 ms"]


def test_readme_block_is_replaced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n{BEGIN}\nold table\n{END}\nafter\n")
    assert main([str(H200), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert "old table" not in text and text.startswith("# x\n\nbefore\n" + BEGIN + "\n")
    assert text.endswith(f"\n{END}\nafter\n") and "| 16K EDMM |" in text
    assert capsys.readouterr().out.strip() in text
    # Idempotent.
    assert main([str(H200), "--readme", str(readme)]) == 0 and readme.read_text() == text
    readme.write_text("no markers\n")
    assert main([str(H200), "--readme", str(readme)]) == 1
    with pytest.raises(ResultsTableError):
        replace_block(f"{END}\n{BEGIN}\n", "x")
    assert "results:begin" in capsys.readouterr().err and readme.read_text() == "no markers\n"


def test_groups_plot_from_committed_files(tmp_path: Path) -> None:
    """`agent-ttft.png` is rebuilt from the JSON files alone, with or without the peer's."""
    from edmm.bench.resume_peer import plot_groups

    for name in ("agent-ttft.json", "agent-ttft-transformers.json"):
        (tmp_path / name).write_text((H200 / name).read_text())
    png = plot_groups(tmp_path)
    assert png == tmp_path / "agent-ttft.png" and png.read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "agent-ttft-transformers.json").unlink()
    assert plot_groups(tmp_path).stat().st_size > 0


def test_result_dirs_are_found_by_name_newest_first(tmp_path: Path) -> None:
    for name in ("2026-11-29-h200", "2026-11-30-h200", "2026-11-30-h200-session9",
                 "2026-11-30-h200-session10", "2026-11-30-cpu", "notes", "2026-12-01-h200"):
        (tmp_path / name).mkdir()
    (tmp_path / "2026-12-02-h200").write_text("a file, not a folder")
    names = [p.name for p in result_dirs(tmp_path)]
    assert names == ["2026-12-01-h200", "2026-11-30-h200-session10", "2026-11-30-h200-session9",
                     "2026-11-30-h200", "2026-11-29-h200"]
    assert [p.name for p in result_dirs(tmp_path, device="cpu")] == ["2026-11-30-cpu"]


def test_the_live_table_with_raw_http(tmp_path: Path) -> None:
    """Raw-HTTP resumes (no SDK) get their own A / C (C/A) and what they add over the same
    call's in-process groups, beside the SDK's."""
    live = [{"context_tokens": 16384, "group": g, "prompt_tokens": 9, "cached_tokens": 8,
             "ttft_trimmed_mean_ms": t, "total_trimmed_mean_ms": t, "sdk_median_ms": 4.0,
             "raw_ttft_trimmed_mean_ms": raw}
            for g, t, raw in (("A", 50.0, 40.0), ("B", 300.0, 290.0), ("C", 30.0, 12.0))]
    (tmp_path / "agent-ttft-live.json").write_text(json.dumps({"summary": live}))
    row = _row(render([tmp_path]), "16K")
    assert len(row) == 8 and row[7] == "40.0 ms / 12.0 ms (0.30)"
    (tmp_path / "agent-ttft.json").write_text((H200 / "agent-ttft.json").read_text())
    row = _row(render([tmp_path]), "16K")
    alone = {(r["context_tokens"], r["group"]): r["ttft_trimmed_mean_ms"]
             for r in _summary("agent-ttft.json")}
    assert row[9] == "40.0 ms / 12.0 ms (0.30)"
    assert row[10] == (f"{40.0 - alone[(16384, 'A')]:.1f} ms / "
                       f"{12.0 - alone[(16384, 'C')]:.1f} ms")


def test_live_contexts_from_several_calls(tmp_path: Path) -> None:
    """A results folder whose calls measured one live context each (and the in-process
    groups in one of them): one live table with both contexts, each beside the groups; a
    context in two folders is the first folder's."""
    def live(ctx: int, a: float) -> list[dict]:
        return [{"context_tokens": ctx, "group": g, "prompt_tokens": 9, "cached_tokens": 8,
                 "ttft_trimmed_mean_ms": t, "total_trimmed_mean_ms": t,
                 "raw_ttft_trimmed_mean_ms": t - 5.0}
                for g, t in (("A", a), ("B", 10 * a), ("C", a / 4))]
    first, second = tmp_path / "call1", tmp_path / "call2"
    for folder, rows in ((first, live(16384, 40.0)),
                         (second, live(16384, 99.0) + live(32768, 60.0))):
        folder.mkdir()
        (folder / "agent-ttft-live.json").write_text(json.dumps({"summary": rows}))
    (second / "agent-ttft.json").write_text((H200 / "agent-ttft.json").read_text())
    table = render([first, second])
    alone = {(r["context_tokens"], r["group"]): r["ttft_trimmed_mean_ms"]
             for r in _summary("agent-ttft.json")}
    assert _row(table, "16K")[1] == "40.0 ms"  # the first folder's 16K
    assert _row(table, "32K")[1] == "60.0 ms"
    assert _row(table, "16K")[7].startswith(f"{40.0 - alone[(16384, 'A')]:.1f} ms")


def test_each_live_context_beside_its_own_calls_groups(tmp_path: Path) -> None:
    """A newer call measured 16K live and in process; an older one 16K and 32K. The 16K row
    is the newer call's beside its own groups, the 32K row the older call's beside its own:
    the in-process groups are taken per context, first folder first."""
    def rows(ctx: int, a: float, key: str) -> list[dict]:
        return [{"context_tokens": ctx, "group": g, "prompt_tokens": 9, "cached_tokens": 8,
                 key: t, "total_trimmed_mean_ms": t} for g, t in (("A", a), ("B", 10 * a),
                                                                 ("C", a / 4))]
    new, old = tmp_path / "new", tmp_path / "old"
    for folder, live, alone in ((new, rows(16384, 40.0, "ttft_trimmed_mean_ms"),
                                 rows(16384, 30.0, "ttft_trimmed_mean_ms")),
                                (old, rows(16384, 50.0, "ttft_trimmed_mean_ms")
                                 + rows(32768, 70.0, "ttft_trimmed_mean_ms"),
                                 rows(16384, 20.0, "ttft_trimmed_mean_ms")
                                 + rows(32768, 64.0, "ttft_trimmed_mean_ms"))):
        folder.mkdir()
        (folder / "agent-ttft-live.json").write_text(json.dumps({"summary": live}))
        (folder / "agent-ttft.json").write_text(json.dumps({"summary": alone}))
    table = render([new, old])
    assert _row(table, "16K")[1] == "40.0 ms"
    assert _row(table, "16K")[7].startswith("10.0 ms")  # 40 - the newer call's 30
    assert _row(table, "32K")[1] == "70.0 ms"
    assert _row(table, "32K")[7].startswith("6.0 ms")  # 70 - the older call's 64
