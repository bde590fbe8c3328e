"""Where an engine step's time goes under load, in process (no HTTP): host vs device.

    python -m benchmarks.scripts.engine_step_profile --device cuda --model qwen2.5-7b \
        --seqs 32,64 --prompt 2048 --output 256 --out OUT [--sync]

For each batch size B: B requests of ``--prompt`` random tokens and ``--output`` tokens each
(ignore_eos) are all queued at once and stepped to the end. Every step's host time is split
as the engine reports it (`Engine.last_step_timing`: schedule, launch, wait for sampled
tokens, process them); the wait is the host idle while the device computes, so the rest is
host time the device may wait for (with async scheduling it overlaps the device's work).
With ``SPIN=1`` a second Python thread spins meanwhile (the server's event loop runs in such a
thread): its iterations per second, against the same loop alone, say how much of the GIL the
engine thread leaves it, and the step times how much such a thread slows the engine. Writes
``engine-steps.json`` (every step) and prints a summary table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import threading
import time
from pathlib import Path

from edmm.engine.config import EngineConfig
from edmm.engine.engine import Engine
from edmm.engine.sampling import SamplingParams


def timed_step(engine: Engine, steps: list[dict[str, float]]) -> int:
    """One engine step; its phases (`Engine.last_step_timing`), wall time and shape go to
    ``steps``; the number of outputs it returned."""
    t = time.perf_counter()
    outs = engine.step()
    row = {"total": time.perf_counter() - t}
    if engine.last_step_timing is not None:
        row.update(dataclasses.asdict(engine.last_step_timing))
    if engine.last_step is not None:
        row["tokens"] = float(sum(engine.last_step.query_lens))
        row["seqs"] = float(len(engine.last_step.query_lens))
    steps.append(row)
    return len(outs)


def spin_rate(stop: threading.Event, out: list[float]) -> None:
    n, t = 0, time.perf_counter()
    while not stop.is_set():
        for _ in range(1000):
            n += 1
    out.append(n / (time.perf_counter() - t))


def measure(engine: Engine, batch: int, prompt: int, output: int, cuda: bool,
            rng: random.Random, spin: bool) -> dict[str, object]:
    vocab = engine.model_config.vocab_size
    steps: list[dict[str, float]] = []
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    for i in range(batch):
        ids = [rng.randrange(1000, min(vocab, 100_000)) for _ in range(prompt)]
        engine.add_request(f"b{batch}-{i}", ids, params)
    stop, rate = threading.Event(), []  # type: ignore[var-annotated]
    th = threading.Thread(target=spin_rate, args=(stop, rate))
    if spin:
        th.start()
    t0 = time.perf_counter()
    tokens = 0
    while engine.has_unfinished():
        tokens += timed_step(engine, steps)
    wall = time.perf_counter() - t0
    if spin:
        stop.set()
        th.join()
    decode = [s for s in steps if s.get("tokens") == s.get("seqs") and s.get("seqs")]

    def med(key: str, rows: list[dict[str, float]]) -> float:
        vals = [r[key] for r in rows if key in r]
        return statistics.median(vals) * 1e3 if vals else float("nan")

    host = [s["total"] - s.get("wait_s", 0.0) for s in steps]
    return {
        "batch": batch, "prompt": prompt, "output": output, "steps": len(steps),
        "wall_s": wall, "output_tok_s": tokens / wall,
        "host_s_total": sum(host), "host_frac": sum(host) / wall,
        "decode_steps": len(decode),
        "decode_total_ms_p50": med("total", decode),
        "decode_schedule_ms_p50": med("schedule_s", decode),
        "decode_launch_ms_p50": med("launch_s", decode),
        "decode_wait_ms_p50": med("wait_s", decode),
        "decode_process_ms_p50": med("process_s", decode),
        "spin_rate": rate[0] if rate else None, "raw": steps,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seqs", default="32,64")
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--output", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--sync", action="store_true", help="no async scheduling")
    a = p.parse_args()
    seqs = [int(x) for x in a.seqs.split(",")]
    cuda = a.device.startswith("cuda")
    cfg = EngineConfig(model=a.model, device=a.device, dtype=a.dtype if cuda else None,
                       max_num_seqs=max(seqs), num_slots=max(seqs) + 8,
                       max_model_len=a.prompt + a.output + 16,
                       max_num_batched_tokens=a.max_num_batched_tokens,
                       async_scheduling=False if a.sync else None)
    engine = Engine(cfg)
    rng = random.Random(0)
    stop, alone = threading.Event(), []  # type: ignore[var-annotated]
    th = threading.Thread(target=spin_rate, args=(stop, alone))
    th.start()
    time.sleep(1.0)
    stop.set()
    th.join()
    measure(engine, min(seqs), min(64, a.prompt), 8, cuda, rng, spin=False)  # warm-up
    spin = bool(os.environ.get("SPIN"))
    results = [measure(engine, b, a.prompt, a.output, cuda, rng, spin=spin) for b in seqs]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "engine-steps.json").write_text(json.dumps(
        {"spin_alone": alone[0], "results": results}, indent=1))
    print(f"spin loop alone: {alone[0]:.3g} it/s")
    keys = [k for k in results[0] if k != "raw"]
    print(" | ".join(keys))
    for r in results:
        print(" | ".join(f"{r[k]:.4g}" if isinstance(r[k], float) else str(r[k]) for k in keys))


if __name__ == "__main__":
    main()
