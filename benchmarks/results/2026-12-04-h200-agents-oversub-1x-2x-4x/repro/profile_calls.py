"""Inclusive host seconds and calls of the agent layer's, engine's and memory layer's main
functions during one `edmm bench agents` run (functions wrapped with a timer; nothing else
changes), or, with ``pinned-alloc`` as the only argument, the speed of fresh pinned host
allocations. Run from the repository root on the GPU machine:

    PYTHONPATH=. python3 benchmarks/results/2026-12-04-h200-agents-pinned-host/profile_calls.py \
        bench agents --model qwen2.5-7b --device cuda ... --policies edmm --out /tmp/p1
    PYTHONPATH=. python3 benchmarks/results/2026-12-04-h200-agents-pinned-host/profile_calls.py \
        pinned-alloc
"""
import collections
import functools
import importlib
import sys
import time

import torch

WRAPPED = {
    "edmm.memory.offload": ["HostKVStore.save", "HostKVStore.load", "HostKVStore.release",
                            "HostKVStore.poll", "HostBlocks.take"],
    "edmm.memory.copies": ["StreamCopier.copy", "StreamCopier.compute_wait", "StreamCopier.poll",
                           "StreamCopier.wait"],
    "edmm.memory.arena": ["KVArena.branch", "KVArena.commit", "KVArena.free", "KVArena.grow",
                          "KVArena.reclaim", "KVArena.truncate", "KVArena._map_pages",
                          "KVArena._unmap_pages", "KVArena._make_private"],
    "edmm.engine.prefix_cache": ["PrefixCache._write_behind", "PrefixCache.evict_one",
                                 "PrefixCache.restore", "PrefixCache._await",
                                 "PrefixCache.release", "PrefixCache.set_retention"],
    "edmm.agent.api": ["AgentEngine.step", "AgentEngine._speculate", "AgentEngine._branch_pays",
                       "AgentEngine._apply_retention", "AgentEngine._promote_overdue",
                       "AgentEngine._expire_windows", "AgentEngine._on_output",
                       "AgentEngine.await_tools", "AgentEngine.resume",
                       "AgentEngine._drop_branches"],
    "edmm.engine.engine": ["Engine.step"],
    "edmm.engine.scheduler": ["Scheduler.schedule", "Scheduler.update",
                              "Scheduler._admit_speculation", "Scheduler._unassign"],
}
totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])  # name -> calls, s


def wrap(module: str, qualname: str) -> None:
    owner = importlib.import_module(module)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[qualname][0] += 1
            totals[qualname][1] += time.perf_counter() - t0

    setattr(owner, name, timed)


def pinned_alloc() -> None:
    torch.empty(1, pin_memory=True)  # the CUDA context
    for mib in (16, 64, 128, 256):
        t0 = time.perf_counter()
        torch.empty(mib << 20, dtype=torch.uint8, pin_memory=True)
        dt = time.perf_counter() - t0
        print(f"pinned alloc {mib} MiB (fresh size): {dt * 1e3:.2f} ms = "
              f"{mib / 1024 / dt:.2f} GiB/s")


if __name__ == "__main__":
    if sys.argv[1:] == ["pinned-alloc"]:
        pinned_alloc()
        sys.exit(0)
    for module, names in WRAPPED.items():
        for qualname in names:
            wrap(module, qualname)
    from edmm.cli import main

    rc = main(sys.argv[1:])
    print(f"{'function':45s} {'calls':>7s} {'seconds':>9s}")
    for qualname, (calls, seconds) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        print(f"{qualname:45s} {calls:7d} {seconds:9.4f}")
    sys.exit(rc)
