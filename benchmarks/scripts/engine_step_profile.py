"""Where an engine step's time goes under load, in process (no HTTP): host vs device.

    PYTHONPATH=. python3 benchmarks/scripts/engine_step_profile.py --device cuda \
        --model qwen2.5-7b --seqs 32,64 --prompt 2048 --output 256 --out OUT

For each batch size B: B requests of ``--prompt`` random tokens and ``--output`` tokens each
(ignore_eos) are all queued at once and stepped to the end. Every step is split into
schedule / prepare / forward+sample launch / wait for the sampled tokens / update+detokenize,
by wrapping those methods, and the device time of the forward + sample is taken from CUDA
events. It also measures how much a second Python thread gets done while the engine steps
(a spin loop's iterations per second, against the same loop alone): the server's event loop
runs in such a thread, so a low share means the engine thread holds the GIL while the device
works. Writes ``engine-steps.json`` (every step) and prints a summary table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time
from pathlib import Path

import torch

from edmm.engine.config import EngineConfig
from edmm.engine.engine import Engine
from edmm.engine.sampling import SamplingParams


class StepClock:
    """Wraps the engine's step stages and records per-step times (seconds)."""

    def __init__(self, engine: Engine, cuda: bool) -> None:
        self.engine, self.cuda = engine, cuda
        self.steps: list[dict[str, float]] = []
        self.cur: dict[str, float] = {}
        sched, runner = engine.scheduler, engine.runner
        self._wrap(sched, "schedule", "schedule")
        self._wrap(sched, "update", "update")
        self._wrap(runner, "prepare", "prepare")
        orig_forward, orig_sample = runner.forward, runner.sample

        def forward(inputs):  # type: ignore[no-untyped-def]
            if self.cuda:
                self.ev0 = torch.cuda.Event(enable_timing=True)
                self.ev0.record()
            t = time.perf_counter()
            out = orig_forward(inputs)
            self.cur["forward_launch"] = time.perf_counter() - t
            return out

        def sample(hidden, inputs):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            out = orig_sample(hidden, inputs)
            if self.cuda:
                ev1 = torch.cuda.Event(enable_timing=True)
                ev1.record()
                t1 = time.perf_counter()
                ev1.synchronize()
                self.cur["wait"] = time.perf_counter() - t1
                self.cur["device"] = self.ev0.elapsed_time(ev1) / 1e3
            self.cur["sample_launch"] = time.perf_counter() - t
            return out

        runner.forward, runner.sample = forward, sample  # type: ignore[method-assign]

    def _wrap(self, obj: object, name: str, key: str) -> None:
        orig = getattr(obj, name)

        def timed(*a, **k):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            out = orig(*a, **k)
            self.cur[key] = time.perf_counter() - t
            return out

        setattr(obj, name, timed)

    def step(self) -> int:
        self.cur = {}
        t = time.perf_counter()
        outs = self.engine.step()
        self.cur["total"] = time.perf_counter() - t
        batch_tokens = self.engine.last_step
        if batch_tokens is not None:
            self.cur["tokens"] = float(sum(batch_tokens.query_lens))
            self.cur["seqs"] = float(len(batch_tokens.query_lens))
        self.steps.append(self.cur)
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
    clock = StepClock(engine, cuda)
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
        tokens += clock.step()
    wall = time.perf_counter() - t0
    if spin:
        stop.set()
        th.join()
    steps = clock.steps
    decode = [s for s in steps if s.get("tokens") == s.get("seqs") and s.get("seqs")]

    def med(key: str, rows: list[dict[str, float]]) -> float:
        vals = [r[key] for r in rows if key in r]
        return statistics.median(vals) * 1e3 if vals else float("nan")

    host = [s["total"] - s.get("wait", 0.0) for s in steps]
    return {
        "batch": batch, "prompt": prompt, "output": output, "steps": len(steps),
        "wall_s": wall, "output_tok_s": tokens / wall,
        "device_busy_frac": sum(s.get("device", 0.0) for s in steps) / wall,
        "host_s_total": sum(host),
        "decode_steps": len(decode),
        "decode_total_ms_p50": med("total", decode), "decode_device_ms_p50": med("device", decode),
        "decode_schedule_ms_p50": med("schedule", decode),
        "decode_prepare_ms_p50": med("prepare", decode),
        "decode_forward_launch_ms_p50": med("forward_launch", decode),
        "decode_wait_ms_p50": med("wait", decode), "decode_update_ms_p50": med("update", decode),
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
    a = p.parse_args()
    seqs = [int(x) for x in a.seqs.split(",")]
    cuda = a.device.startswith("cuda")
    cfg = EngineConfig(model=a.model, device=a.device, dtype=a.dtype if cuda else None,
                       max_num_seqs=max(seqs), num_slots=max(seqs) + 8,
                       max_model_len=a.prompt + a.output + 16,
                       max_num_batched_tokens=a.max_num_batched_tokens)
    engine = Engine(cfg)
    rng = random.Random(0)
    stop, alone = threading.Event(), []  # type: ignore[var-annotated]
    th = threading.Thread(target=spin_rate, args=(stop, alone))
    th.start()
    time.sleep(1.0)
    stop.set()
    th.join()
    measure(engine, min(seqs), 64, 8, cuda, rng, spin=False)  # warm-up
    spin = not os.environ.get("NOSPIN")
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
