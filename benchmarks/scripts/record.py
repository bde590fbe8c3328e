"""The record a measurement script leaves in its ``--out`` folder: one JSON file (the device, the
date, the command, the arguments, the result) and one Markdown report headed by the same facts.
Not a script: the scripts that write such a record import `write_record`."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edmm.bench.results import collect_environment


def write_record(args: argparse.Namespace, result: dict[str, Any], *, script: str,
                 argv: list[str] | None, device: str, stem: str, title: str,
                 markdown: Callable[[dict[str, Any], str], str]) -> str:
    """Write ``args.out/STEM.json`` and ``args.out/STEM.md`` (the folder made if missing) and
    return the Markdown.

    The JSON holds ``device`` (GPU, driver, CUDA, torch, python, git commit and dirtiness of
    `collect_environment` on ``device``), ``date`` (UTC, ISO), ``command`` (``python3 -m
    benchmarks.scripts.SCRIPT`` with ``argv``, or the process's arguments when None), ``args``
    (``vars(args)``, ``out`` as a string) and ``result``. The Markdown is ``markdown(result,
    header)``, where ``header`` is ``# TITLE`` followed by the device, date and command lines.
    """
    date = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    command = f"python3 -m benchmarks.scripts.{script} " + shlex.join(
        sys.argv[1:] if argv is None else argv)
    env = collect_environment(device)
    facts = {"gpu": env.gpu_name, "driver": env.driver_version, "cuda": env.cuda_runtime,
             "torch": env.torch, "python": env.python, "git_commit": env.git_commit,
             "git_dirty": env.git_dirty}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(
        {"device": facts, "date": date, "command": command,
         "args": vars(args) | {"out": str(args.out)}, "result": result}, indent=2))
    line = ", ".join(f"{k} {v}" for k, v in facts.items())
    md = markdown(result, f"# {title}\n\n- device: {line}\n- date (UTC): {date}\n"
                          f"- command: `{command}`")
    (out / f"{stem}.md").write_text(md + "\n")
    return md
