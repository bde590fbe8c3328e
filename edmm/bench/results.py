"""Benchmark result files, stamped with where, when and how they were produced.

:func:`collect_environment` records the machine, software versions, git commit
and command line; :class:`ResultWriter` writes per-iteration rows as CSV, and
everything (environment, summary, rows, notes) as JSON and as a Markdown
report. :func:`plot_bars` draws a grouped bar chart when matplotlib is there.
"""

from __future__ import annotations

import csv
import dataclasses
import enum
import json
import math
import numbers
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import torch

_T = TypeVar("_T")
_TOOL_TIMEOUT_S = 10.0
_REPO_DIR = Path(__file__).resolve().parents[2]  # the checkout when run from source


class ReportError(ValueError):
    """Invalid input to the report writers (bad name, unusable rows or columns)."""


@dataclass(frozen=True)
class Environment:
    """Where, when and how a benchmark ran. Fields that could not be found are None."""

    device: str
    hostname: str
    platform: str
    python: str
    torch: str
    transformers: str | None
    gpu_name: str | None
    driver_version: str | None
    cuda_runtime: str | None
    cpu_model: str | None
    timestamp_utc: str
    git_commit: str | None
    git_dirty: bool | None
    command: str

    def as_dict(self) -> dict[str, Any]:
        """Fields as a plain dict, in declaration order."""
        return dataclasses.asdict(self)


def collect_environment(device: str, repo_dir: Path | None = None) -> Environment:
    """Describe this run for ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...).

    GPU fields are filled only for a CUDA device that torch can see. A missing
    tool (``git``, ``nvidia-smi``) or package leaves its field None; nothing
    here raises. ``repo_dir`` defaults to the checkout holding this package.
    """
    gpu_name = driver = runtime = None
    if device.startswith("cuda") and torch.cuda.is_available():
        gpu_name = _safe(lambda: torch.cuda.get_device_name(_cuda_index(device)))
        driver = _cuda_driver_version()
        runtime = torch.version.cuda
    repo = repo_dir or _REPO_DIR
    # A copy of the tree (the GPU machine's) may carry a stale .git or none: EDMM_GIT_COMMIT,
    # when set, names the tree and wins (its dirtiness is then unknown).
    named = os.environ.get("EDMM_GIT_COMMIT")
    commit = named or _run_tool(["git", "rev-parse", "HEAD"], cwd=repo)
    status = None if named else _run_tool(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo)
    return Environment(
        device=device,
        hostname=socket.gethostname(),
        platform=platform.platform(),
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=_package_version("transformers"),
        gpu_name=gpu_name,
        driver_version=driver,
        cuda_runtime=runtime,
        cpu_model=_cpu_model(),
        timestamp_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        git_commit=commit,
        git_dirty=None if commit is None or status is None else bool(status),
        command=_command_line(),
    )


def _command_line() -> str:
    """The command as typed: ``python -m edmm ...`` when run as a module."""
    argv = list(sys.argv)
    if argv and argv[0].endswith(os.path.join("edmm", "__main__.py")):
        argv[0:1] = ["python", "-m", "edmm"]
    return shlex.join(argv)


def _cuda_index(device: str) -> int:
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def _cuda_driver_version() -> str | None:
    """NVIDIA driver version: ``torch.cuda.driver_version()`` if torch has it, else nvidia-smi."""
    from_torch = getattr(torch.cuda, "driver_version", None)
    if callable(from_torch):
        version = _safe(from_torch)
        if version is not None:
            return str(version)
    out = _run_tool(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    lines = [line.strip() for line in (out or "").splitlines() if line.strip()]
    return lines[0] if lines else None


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or None


def _package_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _run_tool(cmd: list[str], cwd: Path | None = None) -> str | None:
    """Stripped stdout of ``cmd``, or None if it is missing, fails or hangs."""
    try:
        proc = subprocess.run(
            cmd, cwd=cwd, capture_output=True, text=True, timeout=_TOOL_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _safe(fn: Callable[[], _T]) -> _T | None:
    """``fn()``, or None if it raises (optional facts must not sink a benchmark)."""
    try:
        return fn()
    except Exception:
        return None


# ---------------------------------------------------------------- progress


class Progress:
    """Progress on stderr: ``[label] done/total what (elapsed)``, one line rewritten in place
    on a terminal, else a line at each quarter (logs stay short)."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done = label, max(1, total), 0
        self.t0 = time.monotonic()
        self._tty = sys.stderr.isatty()

    def step(self, what: str = "") -> None:
        """One unit done."""
        self.done += 1
        text = (f"[{self.label}] {self.done}/{self.total} {what} "
                f"({time.monotonic() - self.t0:.0f} s)")
        if self._tty:
            end = "\n" if self.done >= self.total else ""
            print(f"\r{text}   ", end=end, file=sys.stderr, flush=True)
        elif self.done * 4 // self.total > (self.done - 1) * 4 // self.total:
            print(text, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- writer


class ResultWriter:
    """Collects per-iteration rows and writes ``<name>.csv``, ``<name>.json``, ``<name>.md``."""

    def __init__(self, out_dir: Path | str, name: str, env: Environment) -> None:
        if not name or name in (".", "..") or any(c in name for c in "/\\\0"):
            raise ReportError(f"name must be a plain file stem, got {name!r}")
        self.out_dir = Path(out_dir)
        self.name = name
        self.env = env
        self.rows: list[dict[str, Any]] = []

    def add_rows(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """Append per-iteration rows (copied; key order is kept for the CSV columns)."""
        self.rows.extend(dict(r) for r in rows)

    def write(
        self,
        summary_rows: Sequence[Mapping[str, Any]],
        title: str,
        notes: Sequence[str] = (),
        meta: Mapping[str, Any] | None = None,
    ) -> dict[str, Path]:
        """Write the three files into ``out_dir`` (created if needed); ``meta``: facts about
        the run that a later step checks (kept under ``meta`` in the JSON).

        Returns:
            ``{"csv": ..., "json": ..., "md": ...}`` paths.
        """
        self.out_dir.mkdir(parents=True, exist_ok=True)
        paths = {ext: self.out_dir / f"{self.name}.{ext}" for ext in ("csv", "json", "md")}
        _write_csv(paths["csv"], self.rows)
        doc = {
            "name": self.name,
            "title": title,
            "environment": self.env.as_dict(),
            "summary": [dict(r) for r in summary_rows],
            "rows": self.rows,
            "notes": list(notes),
        }
        if meta is not None:
            doc["meta"] = dict(meta)
        text = json.dumps(_jsonable(doc), indent=2, allow_nan=False)
        paths["json"].write_text(text + "\n", encoding="utf-8")
        paths["md"].write_text(
            render_markdown(self.env, summary_rows, title, notes), encoding="utf-8"
        )
        return paths


def columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Column names: the first row's keys in order, then new keys as they first appear."""
    seen: dict[str, None] = {}
    for r in rows:
        for k in r:
            seen.setdefault(str(k), None)
    return list(seen)


def _write_csv(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    cols = columns(rows)
    with path.open("w", newline="", encoding="utf-8") as f:
        if not cols:
            return
        writer = csv.DictWriter(f, fieldnames=cols, restval="")
        writer.writeheader()
        for r in rows:
            writer.writerow({str(k): _csv_cell(v) for k, v in r.items()})


def _csv_cell(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, (dict, list, tuple)):
        return json.dumps(_jsonable(v))
    return _jsonable(v)


def _jsonable(v: Any) -> Any:
    """Plain JSON types; non-finite floats become None, numpy/torch scalars numbers."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, enum.Enum):
        return _jsonable(v.value)
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return _jsonable(dataclasses.asdict(v))
    if hasattr(v, "item") and callable(v.item):
        item = _safe(v.item)
        if isinstance(item, (bool, int, float)):
            return _jsonable(item)
    return str(v)


# ---------------------------------------------------------------- markdown


def render_markdown(
    env: Environment,
    summary_rows: Sequence[Mapping[str, Any]],
    title: str,
    notes: Sequence[str] = (),
) -> str:
    """The Markdown report: header with the environment, summary table, notes."""
    parts = [f"# {title}", "", *_env_lines(env), ""]
    parts.append(markdown_table(summary_rows) if summary_rows else "_No summary rows._")
    if notes:
        parts += ["", "## Notes", "", *(f"- {n}" for n in notes)]
    return "\n".join(parts) + "\n"


def _env_lines(env: Environment) -> list[str]:
    device = env.device
    if env.gpu_name:
        device += f" ({env.gpu_name})"
    commit = env.git_commit or "unknown"
    if env.git_dirty:
        commit += " (uncommitted changes)"
    software = f"Python {env.python}, torch {env.torch}"
    if env.transformers:
        software += f", transformers {env.transformers}"
    return [
        f"- **Device:** {device}",
        f"- **Driver:** {env.driver_version or 'n/a'}; CUDA runtime {env.cuda_runtime or 'n/a'}",
        f"- **CPU:** {env.cpu_model or 'unknown'}",
        f"- **Host:** {env.hostname}, {env.platform}",
        f"- **Software:** {software}",
        f"- **Date (UTC):** {env.timestamp_utc}",
        f"- **Command:** {_code_span(env.command)}",
        f"- **Git commit:** {commit}",
    ]


def _code_span(text: str) -> str:
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A GitHub Markdown table of ``rows``; numeric columns are right-aligned.

    Columns follow :func:`columns`; missing cells are empty. Floats get four
    significant digits (no decimals from 1000 up, scientific below 0.001).
    """
    cols = columns(rows)
    if not cols:
        raise ReportError("markdown_table needs at least one row with one column")
    numeric = [all(_is_number(r.get(c)) for r in rows if r.get(c) is not None) for c in cols]
    header = "| " + " | ".join(_escape(c) for c in cols) + " |"
    rule = "|" + "|".join("---:" if num else "---" for num in numeric) + "|"
    body = ["| " + " | ".join(format_cell(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join([header, rule, *body])


def format_cell(v: Any) -> str:
    """One Markdown table cell: ints as is, floats to 4 significant digits, text escaped."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, numbers.Integral):
        return str(int(v))
    if isinstance(v, numbers.Real):
        return _format_float(float(v))
    if isinstance(v, enum.Enum):
        return _escape(str(v.value))
    return _escape(str(v))


def _format_float(x: float) -> str:
    if not math.isfinite(x):
        return str(x)
    ax = abs(x)
    if ax == 0:
        return "0"
    if ax >= 1e15 or ax < 1e-3:
        return f"{x:.3e}"
    if ax >= 1000:
        return f"{x:.0f}"
    decimals = 3 - math.floor(math.log10(ax))
    return f"{x:.{decimals}f}"


def _is_number(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", " ").replace("\n", " ")


# ---------------------------------------------------------------- plots


GROUPS_CAPTION = (
    "A: the tool result appended at the end, the prefix reused (prefix hit).  "
    "B: the result inserted mid-prompt, everything after it recomputed.  "
    "C: B's prompt prefilled speculatively while the tool ran, committed by a slot swap."
)


def device_label(device: str) -> str:
    """What a plot title calls ``device``: the GPU's name, or ``CPU (model name)``."""
    env = collect_environment(device)
    if env.gpu_name:
        return env.gpu_name
    return f"CPU ({env.cpu_model})" if env.cpu_model else "CPU"


def tokens_label(n: int) -> str:
    """A token count for an axis: ``256``, ``4K`` (exact multiples of 1024 only), ``1500``."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def plot_bars(
    summary_rows: Sequence[Mapping[str, Any]],
    x: str,
    y: str,
    group: str | None,
    path: Path | str,
    title: str,
    log_y: bool = False,
    *,
    x_label: str | None = None,
    y_label: str | None = None,
    legend_title: str | None = None,
    caption: str | None = None,
) -> Path:
    """Grouped bar chart of ``y`` per ``x`` value, one bar colour per ``group`` value, as PNG
    (``log_y``: a logarithmic y axis, for values spanning decades).

    ``x_label`` / ``y_label`` name the axes in words and units (default: the column names),
    ``legend_title`` the groups; the legend sits outside the axes (it covers no bar) and
    ``caption`` (wrapped) under the plot.

    Needs matplotlib (imported here, so the rest of the module does not).
    Raises :class:`RuntimeError` without it and :class:`ReportError` on rows
    without a numeric ``y`` or with a repeated ``(x, group)`` pair.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise RuntimeError("plot_bars needs matplotlib: pip install matplotlib") from e
    import textwrap

    bars = _bar_values(summary_rows, x, y, group)
    xs = list(dict.fromkeys(k[0] for k in bars))
    groups = list(dict.fromkeys(k[1] for k in bars))
    width = 0.8 / len(groups)
    fig = Figure(figsize=(max(7.0, 0.7 * len(xs) * len(groups) + 4), 5.0), layout="constrained")
    ax = fig.add_subplot()
    for gi, g in enumerate(groups):
        pos = [
            i + (gi - (len(groups) - 1) / 2) * width for i, xv in enumerate(xs) if (xv, g) in bars
        ]
        vals = [bars[(xv, g)] for xv in xs if (xv, g) in bars]
        ax.bar(pos, vals, width=width, label=None if group is None else str(g))
    if log_y:
        ax.set_yscale("log")
    ax.set_xticks(range(len(xs)))
    ax.set_xticklabels([str(v) for v in xs])
    ax.set_xlabel(x_label or x)
    ax.set_ylabel(y_label or y)
    # Wrapped within the axes: the legend stands beside them, up to the figure's top.
    ax.set_title("\n".join(textwrap.wrap(title, 70)), fontsize=10)
    if group is not None:
        fig.legend(title=legend_title or group, loc="outside right upper", fontsize=8,
                   title_fontsize=8)
    if caption:
        fig.supxlabel("\n".join(textwrap.wrap(caption, 120)), fontsize=7, ha="left", x=0.01)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=120)
    return out


def _bar_values(
    rows: Sequence[Mapping[str, Any]], x: str, y: str, group: str | None
) -> dict[tuple[Any, Any], float]:
    """``{(x value, group value): y}`` in row order."""
    if not rows:
        raise ReportError("plot_bars needs at least one row")
    bars: dict[tuple[Any, Any], float] = {}
    for r in rows:
        if x not in r or not _is_number(r.get(y)) or (group is not None and group not in r):
            raise ReportError(f"plot_bars: row lacks {x!r}, numeric {y!r} or {group!r}: {r}")
        key = (r[x], None if group is None else r[group])
        if key in bars:
            raise ReportError(f"plot_bars: repeated ({x}, {group}) = {key}")
        bars[key] = float(r[y])
    return bars
