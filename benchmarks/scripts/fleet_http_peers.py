"""A small agent fleet over HTTP against ``edmm serve``, vLLM APC and vLLM + offload, sized for
one device call: ``--budget-s`` bounds when a load point may still start.

    PYTHONPATH=.:/tmp/site python3 -m benchmarks.scripts.fleet_http_peers --out DIR \\
        [--loads 3,6] [--budget-s 420] [--dry-run]

Each load point (lowest first) is one ``edmm bench agents --http`` run into ``DIR/load-N``:
``edmm serve`` under the ``edmm`` policy (``--policies``: also the rebuilt ``lru`` and
``offload``), then ``--peer vllm`` and ``--peer vllm-offload``,
every engine on the same generated fleet (v2; ``--jobs``, ``--turns``, scales below), seed,
KV memory and host memory. The next load point starts only while the time spent so far plus
the previous load point's duration stays within ``--budget-s`` (servers start once per load
point and engine, so a load point costs about as much as the one before it); a skipped point
is printed and noted in ``DIR/fleet-http-peers.md``. Then, with the load points of an earlier
run named by ``--merge-also`` (another device call's), ``edmm bench agents-merge`` of the
load points writes into ``DIR`` itself: ``agents.{json,md,csv}``, the timeline, the knee plot
and the pages plot (``.png``), with the all-turn knees and the peer targets; last,
``DIR.tgz`` holds the whole folder (the per-load reports and the servers' logs too).

The engines: ``--model`` (default the ``qwen2.5-7b`` preset, random weights) with the
tokenizer of ``--peer-model-dir`` (so every engine counts the same tokens), and vLLM from
that HF folder with ``--load-format dummy``, found on ``--peer-python-path``. ``--dry-run``
prints the commands and runs nothing; ``--model``/``--device``/``--dtype``/``--tokenizer``
and ``--trace-arg`` exist so the same plumbing runs on the CPU against stand-ins
(``tests/benchmarks/test_fleet_http_peers.py``).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from pathlib import Path

from edmm.bench.agents.merge import result_doc

# A small fleet: six top-level jobs of 6-8 model calls (seed 1: a subagent, two compactions,
# user messages), a 32K context limit, prefixes and contexts at a quarter of their size, tool
# and user times x0.02.
FLEET = ("--jobs", "6", "--turns", "6,8", "--context-limit", "32768", "--token-scale", "0.25",
         "--time-scale", "0.02", "--seed", "1")
PEERS = ("vllm", "vllm-offload")
SUMMARY = "fleet-http-peers.md"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="results folder (created)")
    p.add_argument("--loads", default="3,6", help="concurrent sessions, comma-separated")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="start another load point only within this many seconds")
    p.add_argument("--model", default="qwen2.5-7b", help="edmm serve's model ('' : the tiny one)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokenizer", default=None,
                   help="edmm serve's tokenizer folder (default: --peer-model-dir)")
    p.add_argument("--peer-model-dir", default="/tmp/qwen25-7b-dummy")
    p.add_argument("--peer-python-path", default="/tmp/site")
    p.add_argument("--peers", default=",".join(PEERS), help="comma-separated --peer values")
    p.add_argument("--policies", default="edmm",
                   help="edmm serve's policies, comma-separated (default edmm; lru,offload,edmm "
                        "also runs the rebuilt baselines beside their real counterparts)")
    p.add_argument("--trace-arg", action="append", default=[],
                   help="extra edmm bench agents option (after the fleet's), repeatable")
    p.add_argument("--merge-also", action="append", default=[], type=Path,
                   help="a load point's folder from an earlier run merged with these "
                        "(skipped with a line if absent), repeatable")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    try:
        args.load_list = [int(x) for x in args.loads.split(",")]
    except ValueError:
        p.error(f"--loads: whole numbers, comma-separated, not {args.loads!r}")
    if not args.load_list or min(args.load_list) < 1:
        p.error(f"--loads: at least one load, each >= 1, not {args.loads!r}")
    return args


def bench_argv(args: argparse.Namespace, load: int, out: Path) -> list[str]:
    """The ``edmm bench agents --http`` command of one load point."""
    tokenizer = args.tokenizer or args.peer_model_dir
    model = ["--model", args.model] if args.model else []
    peers = [x for peer in args.peers.split(",") if peer for x in ("--peer", peer)]
    return [sys.executable, "-m", "edmm", "bench", "agents", "--http", *model,
            "--tokenizer", tokenizer, "--device", args.device, "--dtype", args.dtype,
            *FLEET, *args.trace_arg, "--policies", args.policies, "--loads", str(load), *peers,
            "--peer-model-dir", args.peer_model_dir,
            "--peer-python-path", args.peer_python_path, "--out", str(out)]


def merge_argv(folders: Sequence[Path], out: Path) -> list[str]:
    return [sys.executable, "-m", "edmm", "bench", "agents-merge", *map(str, folders),
            "--out", str(out)]


def _run(argv: Sequence[str]) -> None:
    print("+ " + shlex.join(argv), flush=True)
    subprocess.run(argv, check=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out: Path = args.out
    if args.dry_run:
        for load in args.load_list:
            print(shlex.join(bench_argv(args, load, out / f"load-{load}")))
        print(shlex.join(merge_argv([out / f"load-{n}" for n in args.load_list], out)))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    done: list[Path] = []
    lines: list[str] = []
    last_s = 0.0
    for load in sorted(args.load_list):
        spent = time.monotonic() - t0
        if done and spent + last_s > args.budget_s:
            lines.append(f"- load {load}: skipped ({spent:.0f} s spent + {last_s:.0f} s for "
                         f"the last load point > --budget-s {args.budget_s:g})")
            print(lines[-1], flush=True)
            continue
        start = time.monotonic()
        folder = out / f"load-{load}"
        _run(bench_argv(args, load, folder))
        last_s = time.monotonic() - start
        command = shlex.join(bench_argv(args, load, folder))
        lines.append(f"- load {load}: {last_s:.0f} s (`{command}`)")
        done.append(folder)
    for folder in args.merge_also:
        if result_doc(folder) is not None:
            done.append(folder)
        else:
            lines.append(f"- {folder}: not merged (no agents-http.json there)")
            print(lines[-1], flush=True)
    _run(merge_argv(done, out))
    lines.append(f"- merged: `{shlex.join(merge_argv(done, out))}`; "
                 f"{time.monotonic() - t0:.0f} s in all")
    (out / SUMMARY).write_text("# Fleet over HTTP: edmm serve, vLLM peers\n\n"
                               + "\n".join(lines) + "\n", encoding="utf-8")
    with tarfile.open(out.with_name(out.name + ".tgz"), "w:gz") as tar:
        tar.add(out, arcname=out.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
