"""What the ``edmm bench`` commands share: the device, the output folder, the printed report.

Light to import (torch loads on first call), so that building the command line stays quick.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Callable, Mapping
from pathlib import Path

OUT_HELP = "output folder (default: benchmarks/results/<date>-<device>)"


def default_out_dir(device_tag: str) -> Path:
    """``benchmarks/results/<UTC date>-<device>``."""
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    return Path("benchmarks/results") / f"{date}-{device_tag}"


def device_tag(use_cuda: bool) -> str:
    """``cpu``, or the GPU's name in lower case, spaces as dashes, without ``NVIDIA``
    (``h200``)."""
    import torch

    if not use_cuda or not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name().replace("NVIDIA ", "").replace(" ", "-").lower()


def cpu_note(device: str) -> None:
    """Say, before a CPU run's tables, that its sizes and numbers are not the GPU targets."""
    if not device.startswith("cuda"):
        print("(CPU run: the tiny model in small sizes shows that every mechanism works; the "
              "README's targets and H200 numbers are GPU targets, not expected here.)\n")


def plot_line(make: Callable[[], Path]) -> None:
    """Print the plot ``make`` writes, or why it was skipped (no matplotlib)."""
    try:
        print(f"plot: {make()}")
    except RuntimeError as e:  # no matplotlib
        print(f"plot skipped: {e}")


def print_report(paths: Mapping[str, str | Path]) -> None:
    """Print a run's Markdown report (``paths["md"]``), then every file it wrote."""
    print(Path(paths["md"]).read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
