"""Where the time of a decode step and of a cached-prefix prefill goes (torch.profiler, H200).

    python -m benchmarks.scripts.profile_model [--context 16384] [--attention auto] [--out DIR]

Prints, for the qwen2.5-7b preset on the arena (attention backend ``--attention``: auto,
fa4, triton): the top CUDA kernels of a decode step, of a 512-token prefill on a cached prefix
and of a full prefill (time per step; the decode step completes a ``--context``-token context,
as `edmm bench ttft` times it), their sum against the wall time, and the wall time of the parts
of a graph-replayed decode step and 512-token prefill (medians of 30): mapping the new tokens'
pages (``grow``, timed apart), building the inputs (``grow`` included), `forward` (copy into
the graph's buffers, launch the replay), `sample` (launch), the wait for the device, and the
graph's replay alone (and the host time of its replay call). With ``--full-prefill-chunk N``
also the full prefill in passes of N tokens, and the host's side of those passes (building
inputs, launching each pass) against the wall time: where the host, not the device, sets the
pace. ``--sections`` picks the parts.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from edmm.bench.model_ops import EdmmSide, ModelOpsConfig
from edmm.engine.cuda_graph import CudaGraphRunner


def _kernel_table(prof: profile, steps: int, top: int = 18) -> str:
    events = [e for e in prof.key_averages()
              if e.device_type == DeviceType.CUDA and e.device_time_total > 0]  # kernels only
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in events)
    lines = [f"GPU kernel time per step: {total / steps / 1e3:.3f} ms",
             "| kernel | calls/step | us/step | share |", "|---|---:|---:|---:|"]
    for e in events[:top]:
        lines.append(f"| {e.key[:90]} | {e.count / steps:.0f} | "
                     f"{e.device_time_total / steps:.1f} | {e.device_time_total / total:.1%} |")
    return "\n".join(lines)


def _profile(side: EdmmSide, ids: torch.Tensor, keep: int, end: int, steps: int,
             top: int = 18, chunk: int = 0) -> str:
    for _ in range(2):
        side.truncate(keep)
        side.extend(ids[keep:end], chunk)
    walls = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            side.truncate(keep)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            side.extend(ids[keep:end], chunk)
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) * 1e3)
    return f"wall per step (profiled): {sum(walls) / len(walls):.3f} ms\n" + _kernel_table(
        prof, steps, top)


def _gap_table(prof: profile, steps: int, top: int = 12) -> str:
    """Idle time of the device between consecutive kernels (and copies) of ``steps`` profiled
    steps (a gap of more than `STEP_GAP_US` is the pause between steps): the sum per step, and
    the pairs with the most of it. A negative gap (programmatic dependent launch: a kernel
    starts while the one before drains) counts as overlap."""
    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    pairs: dict[tuple[str, str], list[float]] = {}
    busy = sum(e.time_range.end - e.time_range.start for e in kernels)  # us
    overlap = 0.0
    for a, b in itertools.pairwise(kernels):
        gap = b.time_range.start - a.time_range.end  # us
        if gap > STEP_GAP_US:
            continue
        if gap < 0:
            overlap -= gap
        else:
            pairs.setdefault((a.name[:48], b.name[:48]), []).append(gap)
    total = sum(sum(v) for v in pairs.values())
    lines = [f"{len(kernels) / steps:.0f} kernels a step, busy {busy / steps / 1e3:.3f} ms, idle "
             f"between kernels {total / steps / 1e3:.3f} ms a step (overlap {overlap / steps:.1f}"
             " us)", "| kernel | next kernel | gaps/step | us/step | mean us |",
             "|---|---|---:|---:|---:|"]
    for (a, b), gaps in sorted(pairs.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"| {a} | {b} | {len(gaps) / steps:.0f} | {sum(gaps) / steps:.1f} | "
                     f"{sum(gaps) / len(gaps):.2f} |")
    return "\n".join(lines)


STEP_GAP_US = 1500.0  # us; the steps are 2 ms apart


def _gaps(side: EdmmSide, ids: torch.Tensor, keep: int, end: int, steps: int) -> str:
    """`_gap_table` of ``steps`` graph-replayed steps appending ids[keep:end]."""
    for _ in range(2):
        side.truncate(keep)
        side.extend(ids[keep:end])
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            side.truncate(keep)
            torch.cuda.synchronize()
            time.sleep(0.002)  # > STEP_GAP_US: steps apart
            side.extend(ids[keep:end])
            torch.cuda.synchronize()
    return _gap_table(prof, steps)


def _step_parts(side: EdmmSide, ids: torch.Tensor, keep: int, end: int,
                steps: int = 30) -> str:
    """Host-side parts of a graph-replayed step appending ids[keep:end] against the graph
    alone; ``grow`` (mapping the new tokens' pages) is timed apart, then inside ``inputs``."""
    parts: dict[str, list[float]] = {k: [] for k in ("grow", "inputs", "forward", "sample",
                                                      "wait", "total", "graph alone",
                                                      "replay call (host)")}
    runner = side.runner
    assert isinstance(runner, CudaGraphRunner)
    with torch.inference_mode():
        for _ in range(steps):
            side.truncate(keep)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            side.arena.grow(side.slot, end)
            parts["grow"].append((time.perf_counter() - t0) * 1e3)
            side.truncate(keep)
            torch.cuda.synchronize()
            t = [time.perf_counter()]
            inputs = side.inputs(ids[keep:end])
            t.append(time.perf_counter())
            hidden = runner.forward(inputs)
            t.append(time.perf_counter())
            token = runner.sample(hidden, inputs)
            t.append(time.perf_counter())
            token.item()
            t.append(time.perf_counter())
            for k, a, b in zip(("inputs", "forward", "sample", "wait"), t, t[1:], strict=False):
                parts[k].append((b - a) * 1e3)
            parts["total"].append((t[-1] - t[0]) * 1e3)
            n = end - keep  # the inputs of the step above are still loaded
            graph = runner.graph_for(n)
            assert graph is not None
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            graph.replay()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            parts["graph alone"].append((time.perf_counter() - t0) * 1e3)
            parts["replay call (host)"].append((t1 - t0) * 1e3)
    rows = [f"| {k} | {statistics.median(v):.3f} |" for k, v in parts.items()]
    return "| part | median ms |\n|---|---:|\n" + "\n".join(rows)


def _chunk_parts(side: EdmmSide, ids: torch.Tensor, chunk: int, steps: int = 3) -> str:
    """Host time of a full prefill in passes of ``chunk`` tokens (medians of ``steps``):
    building each pass's inputs (mapping its pages included) and launching its forward,
    summed over the passes, against the wall time of the whole prefill. Host time close to
    the wall time: the host sets the pace, and the device waits between launches."""
    parts: dict[str, list[float]] = {k: [] for k in ("inputs (all passes)",
                                                      "launch (all passes)", "sample + wait",
                                                      "wall")}
    starts = [*range(0, ids.shape[0], chunk), ids.shape[0]]
    with torch.inference_mode():
        for _ in range(steps):
            side.truncate(0)
            torch.cuda.synchronize()
            t_in = t_fw = 0.0
            t0 = time.perf_counter()
            for lo, hi in itertools.pairwise(starts):
                a = time.perf_counter()
                inputs = side.inputs(ids[lo:hi])
                b = time.perf_counter()
                hidden = side.runner.forward(inputs)
                t_in, t_fw = t_in + b - a, t_fw + time.perf_counter() - b
            c = time.perf_counter()
            side.runner.sample(hidden, inputs).item()
            end = time.perf_counter()
            for k, v in zip(parts, (t_in, t_fw, end - c, end - t0), strict=True):
                parts[k].append(v * 1e3)
    rows = [f"| {k} | {statistics.median(v):.3f} |" for k, v in parts.items()]
    return "| part | median ms |\n|---|---:|\n" + "\n".join(rows)


SECTIONS = ("decode", "cached", "full", "chunked", "parts", "gaps")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--fast-only", action="store_true", help="skip the eager SDPA variant")
    parser.add_argument("--attention", default="auto",
                        help="attention backend of the fast variant: auto, fa4, triton")
    parser.add_argument("--full-prefill-chunk", type=int, default=0,
                        help="also profile the full prefill in passes of this many tokens")
    parser.add_argument("--matmul-routes", default=None,
                        help="the projections' skinny routing table (default: the committed "
                             "one; off: cuBLAS)")
    parser.add_argument("--matmul-pdl", action="store_true",
                        help="launch every routed skinny matmul with PDL (an experiment)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"parts to profile, of {', '.join(SECTIONS)}")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    if not sections <= set(SECTIONS):
        parser.error(f"--sections: unknown parts {sorted(sections - set(SECTIONS))}")
    ctx = args.context
    report = [f"# profile, qwen2.5-7b preset, context {ctx}, {torch.cuda.get_device_name()}"]
    for eager in (False,) if args.fast_only else (True, False):
        cfg = ModelOpsConfig(contexts=(ctx,), eager=eager, matmul_routes=args.matmul_routes,
                              matmul_pdl=args.matmul_pdl)
        side = EdmmSide(cfg, ctx, "sdpa" if eager else args.attention)
        ids = torch.randint(0, side.cfg.vocab_size, (ctx + 1,), device="cuda")
        side.extend(ids[:ctx])
        name = ("eager SDPA" if eager else
                f"{type(side.model.backend).__name__} + fused pointwise + CUDA graph")
        report += _sections(side, ids, name, sections, args.full_prefill_chunk, eager)
        side.close()
    text = "\n".join(report)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile.md").write_text(text + "\n")


def _sections(side: EdmmSide, ids: torch.Tensor, name: str, sections: set[str], chunk: int,
              eager: bool) -> list[str]:
    ctx = ids.shape[0] - 1
    out = []
    if "decode" in sections:
        out.append(f"\n## decode step ({name})\n" + _profile(side, ids, ctx - 1, ctx, 10))
    if "cached" in sections:
        out.append(f"\n## prefill 512 on cached prefix ({name})\n"
                   + _profile(side, ids, ctx - 512, ctx, 5))
    if "full" in sections:
        out.append(f"\n## full prefill of {ctx} tokens ({name}, eager)\n"
                   + _profile(side, ids, 0, ctx, 2, top=24))
    if chunk and "chunked" in sections:
        out.append(f"\n## full prefill of {ctx} tokens in passes of {chunk} ({name}, eager)\n"
                   + _profile(side, ids, 0, ctx, 2, top=24, chunk=chunk))
        out.append(f"\n## full prefill in passes of {chunk}: host side\n"
                   + _chunk_parts(side, ids[:ctx], chunk))
    if not eager and "gaps" in sections:
        out.append(f"\n## device idle between kernels, decode step ({name})\n"
                   + _gaps(side, ids, ctx - 1, ctx, 10))
        out.append(f"\n## device idle between kernels, prefill 512 on cached prefix ({name})\n"
                   + _gaps(side, ids, ctx - 512, ctx, 5))
    if not eager and "parts" in sections:
        out.append("\n## decode step parts (CUDA graph)\n" + _step_parts(side, ids, ctx - 1, ctx))
        out.append("\n## prefill 512 parts (CUDA graph)\n"
                   + _step_parts(side, ids, ctx - 512, ctx))
    return out


if __name__ == "__main__":
    main()
