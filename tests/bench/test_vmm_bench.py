"""CPU smoke run of ``edmm bench vmm`` on the host twin, through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

from edmm.cli import main


def test_bench_vmm_smoke_writes_stamped_results(tmp_path: Path) -> None:
    rc = main(["bench", "vmm", "--backend", "host", "--contexts", "64,256", "--repeats", "3",
               "--pages", "4", "--host-page-size", "65536", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "vmm-host.json").read_text())
    ops = {r["op"] for r in data["summary"]}
    assert "commit at resume (slot swap)" in ops
    assert "remap, bare driver calls" in ops
    md = (tmp_path / "vmm-host.md").read_text()
    assert "Command" in md and "bench vmm" in md
    csv = (tmp_path / "vmm-host.csv").read_text().splitlines()
    assert csv[0].startswith("op,context_tokens")
    assert len(csv) == 1 + 5 + 1 + 2 * 4  # header, per-page, bare remap, 4 rows per context
    assert (tmp_path / "vmm-host.png").read_bytes()[:4] == b"\x89PNG"
