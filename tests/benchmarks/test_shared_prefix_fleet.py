"""The shared-prefix fleet measurement, on the host twin (and on a GPU under ``gpu``): pages
equal the fleet's arithmetic after admission and after the restore, and what comes back equals
what left; bad sizes are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.scripts.shared_prefix_fleet import main


@pytest.mark.parametrize("device", ["host", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("policy", ["sessions", "blocks"])
def test_the_fleet_measures_the_shared_count(tmp_path: Path, policy: str, device: str) -> None:
    """On the host twin (synchronous copies) and on a GPU (CUDA VMM, the copy side stream)."""
    assert main(["--out", str(tmp_path), "--device", device, "--sessions", "4", "--prefix",
                 "300", "--private", "80", "--offloaded", "2", "--policy", policy]) == 0
    r = json.loads((tmp_path / f"shared-prefix-fleet-{policy}.json").read_text())["result"]
    assert r["prefix_full_pages"] == 8  # 300 x 56 KiB on 2 MiB pages: 8.2
    assert r["pages_after_admission"] == r["pages_fleet_expected"] == 8 + 4 * 3
    assert r["pages_one_copy_per_session"] == 4 * 11
    assert r["pages_after_offload"] == 20 - 2 * 3 and r["pages_after_restore"] == 20
    assert r["pages_after_evicting_all"] == 0
    assert r["restored_equal"] and r["cold_restored_equal"]
    assert r["restore_bytes"] == 2 * 80 * r["token_bytes"]  # the private tokens only
    assert r["cold_restore_bytes"] == 380 * r["token_bytes"]


@pytest.mark.parametrize("flags", [["--offloaded", "8"], ["--prefix", "8"], ["--private", "0"]])
def test_bad_sizes_exit_2_with_one_line(tmp_path: Path, flags: list[str],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--out", str(tmp_path), "--device", "host", "--sessions", "8", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(flags[0])
    assert not list(tmp_path.iterdir())
