"""Where a prefill's time goes in the engine with its serving defaults, in process (no HTTP).

    python -m benchmarks.scripts.prefill_step_profile --device cuda --model qwen2.5-7b \
        --prompts 2048,8192 --batches 1,8 --out OUT [--max-num-seqs N] [--shared-fraction 0.75]

The engine is built as `edmm serve` builds it (``EngineConfig`` defaults: running sequences
and slots sized from the device, CUDA graphs, async scheduling). For each prompt length P and
batch B, B requests of P random tokens and one output token are queued at once and stepped
until all finish; the wall time from queueing to the last output is the batch's time to first
tokens (median of ``--repeats``), and prefill tokens/s is B x P over it. One more repetition
runs under `torch.profiler`: the CUDA kernels by total device time (top ``--top``) and the
sum of all device time against the wall time (the rest is the device idle, waiting for the
host). Writes ``prefill-profile.json`` and ``prefill-profile.md`` under ``--out``.

``--shared-fraction f`` (as `edmm bench load --prefixes shared`): the first f x P tokens of
every prompt are another request's. Before each timed batch, one untimed request with a new
such prefix (and a suffix of its own) runs to its end, so the batch's requests find the prefix
in the cache, held by a finished request: they branch from it and prefill only the rest.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from edmm.engine.config import EngineConfig
from edmm.engine.engine import Engine
from edmm.engine.sampling import SamplingParams


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class BatchRun:
    """One timed batch: its wall seconds, the prompt tokens it found cached, and the arena's
    page maps meanwhile (branches from a cached prefix map its full pages)."""

    wall_s: float
    cached: int
    map_pages: int
    map_s: float


def run_batch(engine: Engine, prompt: int, batch: int, rng: random.Random, tag: str,
              shared: int = 0) -> BatchRun:
    """Queue ``batch`` requests of ``prompt`` random tokens (one output token each) and step to
    the end. ``shared`` > 0: their first ``shared`` tokens are a new prefix that an untimed
    request computed (and finished) first."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1000, min(vocab, 100_000)) for _ in range(n)]

    prefix = tokens(shared)
    if shared:
        engine.add_request(f"{tag}-prefix", prefix + tokens(prompt - shared), params)
        while engine.has_unfinished():
            engine.step()
    before = engine.kv.driver_time()
    t0 = time.perf_counter()
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", prefix + tokens(prompt - shared), params)
    cached = 0
    while engine.has_unfinished():
        cached += sum(out.num_cached_tokens for out in engine.step() if out.finished)
    wall = time.perf_counter() - t0
    after = engine.kv.driver_time()
    return BatchRun(wall, cached, after.map_pages - before.map_pages,
                    after.map_s - before.map_s)


def kernel_table(prof: Any, top: int) -> tuple[list[dict[str, Any]], float]:
    """The ``top`` CUDA kernels by total device time, and the device time of all of them."""
    rows = []
    for ev in prof.key_averages():
        dev = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if dev and ev.device_type == torch.autograd.DeviceType.CUDA:
            rows.append({"kernel": ev.key[:90], "calls": ev.count, "ms": dev / 1e3})
    rows.sort(key=lambda r: -r["ms"])
    return rows[:top], sum(r["ms"] for r in rows)


def profile_point(engine: Engine, prompt: int, batch: int, repeats: int, top: int,
                  rng: random.Random, shared_fraction: float = 0.0) -> dict[str, Any]:
    shared = int(prompt * shared_fraction)
    runs = [run_batch(engine, prompt, batch, rng, f"p{prompt}b{batch}r{r}", shared)
            for r in range(repeats)]
    walls = [run.wall_s for run in runs]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        wall = run_batch(engine, prompt, batch, rng, f"p{prompt}b{batch}prof", shared).wall_s
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    kernels, device_ms = kernel_table(prof, top)
    med = statistics.median(walls)
    return {"prompt": prompt, "batch": batch, "shared": shared,
            "cached_per_request": runs[-1].cached / batch,
            "map_pages": runs[-1].map_pages, "map_ms": runs[-1].map_s * 1e3,
            "wall_ms": [w * 1e3 for w in walls],
            "wall_ms_p50": med * 1e3, "prefill_tok_s": prompt * batch / med,
            "profiled_wall_ms": wall * 1e3, "device_ms": device_ms, "kernels": kernels}


def write_md(path: Path, cfg: EngineConfig, points: list[dict[str, Any]], cmd: str) -> None:
    lines = [f"# Prefill in process, `edmm serve` defaults ({_device_name()})", "",
             f"{time.strftime('%Y-%m-%d')}; max_num_seqs {cfg.max_num_seqs}, num_slots "
             f"{cfg.num_slots}, max_num_batched_tokens {cfg.max_num_batched_tokens}.", "",
             f"    {cmd}", "",
             "| prompt | of which another request's | found cached | batch "
             "| time to all first tokens p50 (ms) | prompt tok/s | pages mapped | their host ms |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {p['prompt']} | {p['shared']} | {p['cached_per_request']:.0f} | {p['batch']} "
              f"| {p['wall_ms_p50']:.1f} | {p['prefill_tok_s']:,.0f} | {p['map_pages']} "
              f"| {p['map_ms']:.2f} |" for p in points]
    lines += ["", "Pages mapped and their host ms: the arena's page maps (map + set access) "
              "during the last timed batch (a branch from a cached prefix maps its full pages; "
              "a new slot maps the pages its prompt needs)."]
    for p in points:
        lines += ["", f"## {p['prompt']} tokens x {p['batch']}: kernels of one profiled run "
                  f"(device {p['device_ms']:.1f} ms of {p['profiled_wall_ms']:.1f} ms wall, "
                  "under the profiler)", "", "| kernel | calls | ms |", "|---|---:|---:|"]
        lines += [f"| `{k['kernel']}` | {k['calls']} | {k['ms']:.2f} |" for k in p["kernels"]]
    path.write_text("\n".join(lines) + "\n")


def build_parser() -> argparse.ArgumentParser:
    """The script's options (the device calls' test parses their command lines with it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2.5-7b",
                   help="a preset or folder; '': the embedded model")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", default="2048,8192")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--max-num-seqs", type=int, default=0, help="0: the device's default")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--shared-fraction", type=float, default=0.0,
                   help="the part of every prompt another request computed first (0-1)")
    p.add_argument("--out", type=Path, required=True)
    return p


def main() -> None:
    p = build_parser()
    a = p.parse_args()
    prompts = [int(x) for x in a.prompts.split(",")]
    batches = [int(x) for x in a.batches.split(",")]
    cfg = EngineConfig(model=a.model or None, device=a.device, dtype=a.dtype or None,
                       max_num_seqs=a.max_num_seqs, kv_cache_dtype=a.kv_cache_dtype)
    engine = Engine(cfg)
    rng = random.Random(0)
    run_batch(engine, 256, 2, rng, "warm")  # CUDA graphs, kernels' first compiles
    if not 0.0 <= a.shared_fraction < 1.0:
        p.error("--shared-fraction: give a fraction in [0, 1)")
    points = [profile_point(engine, pr, b, a.repeats, a.top, rng, a.shared_fraction)
              for pr in prompts for b in batches]
    a.out.mkdir(parents=True, exist_ok=True)
    cmd = ("python -m benchmarks.scripts.prefill_step_profile --model " + a.model
           + f" --prompts {a.prompts} --batches {a.batches} --kv-cache-dtype {a.kv_cache_dtype}"
           + f" --shared-fraction {a.shared_fraction:g}")
    (a.out / "prefill-profile.json").write_text(json.dumps(
        {"device": _device_name(), "config": repr(engine.config),
         "points": points}, indent=1))
    write_md(a.out / "prefill-profile.md", engine.config, points, cmd)
    for pt in points:
        print(f"prompt {pt['prompt']} ({pt['shared']} shared) x{pt['batch']}: "
              f"{pt['map_pages']} pages mapped in {pt['map_ms']:.1f} ms; "
              f"{pt['wall_ms_p50']:.1f} ms "
              f"({pt['prefill_tok_s']:,.0f} tok/s); device {pt['device_ms']:.1f} of "
              f"{pt['profiled_wall_ms']:.1f} ms profiled")
        for k in pt["kernels"][:6]:
            print(f"    {k['ms']:8.2f} ms {k['calls']:5d}x {k['kernel']}")


if __name__ == "__main__":
    main()
