"""A fleet of sessions on one shared prefix: pages used, offload and restore, restore GiB/s.

    PYTHONPATH=. python3 -m benchmarks.scripts.shared_prefix_fleet --out DIR [--sessions 16]
        [--prefix 16384] [--private 2048] [--offloaded 4] [--model qwen2.5-7b]
        [--policy sessions|blocks]

No model runs: the KV arena of ``--model``'s shapes (bf16, 2 MiB pages) is filled with
random values, as a prefill would fill it, through the prefix index the engine uses
(`PrefixCache` over `KVArena`, with its host tier on a CUDA side stream):

1. ``--sessions`` sessions are admitted one after the other, each on the same ``--prefix``
   tokens and then ``--private`` tokens of its own: the first computes the prefix, the others
   branch from it (`PrefixCache.acquire`). Pages used against the fleet's arithmetic (the
   prefix's full pages once, each session's pages past them) and against one private copy per
   session.
2. ``--offloaded`` of them pause and are evicted to the host (their KV: the blocks no other
   slot holds only, the prefix already on the host once); pages used again.
3. They come back (``sessions``: `PrefixCache.restore` by tag; ``blocks``: the admission loads
   what the GPU lacks): each branches from the prefix the others still hold and loads its
   private tokens only. Pages used (the fleet's count again), the restored KV compared byte for
   byte, restore GiB/s (CUDA events on the copy stream).
4. A cold restore: every slot freed, one session restored from the host alone (prefix and
   private tokens): the GiB/s of one large restore.

Writes ``shared-prefix-fleet-POLICY.json`` and ``.md`` (device, date, command) under ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.scripts.record import write_record
from edmm.engine import PrefixCache
from edmm.engine.kv_policy import CACHE_POLICIES
from edmm.engine.prefix_cache import EntryRank
from edmm.memory import KVArena, KVSpec, PagePool, open_backend
from edmm.memory.copies import make_copier
from edmm.memory.offload import HostKVStore
from edmm.model import resolve_preset

BLOCK = 16


def _admit(cache: PrefixCache, tokens: list[int]) -> int:
    """Admit ``tokens``: the longest cached prefix (branched, or loaded from the host), then
    the rest written with random KV, as a prefill would; return the slot."""
    arena = cache.arena
    hit = cache.acquire(tokens, len(tokens))
    slot = arena.allocate() if hit is None else hit.slot
    start = 0 if hit is None else hit.num_tokens
    arena.grow(slot, len(tokens))
    arena.kv[slot, start:len(tokens)].normal_()
    cache.track(slot, tokens, len(tokens))
    return slot


def _evict_all(cache: PrefixCache, live: dict[int, int], prompts: list[list[int]]) -> None:
    """Every live slot (``live``: session -> slot) paused and evicted to the host."""
    for s, slot in live.items():
        cache.release(slot, prompts[s], len(prompts[s]), tag=f"s{s}", rank=EntryRank.RETAINED)
    live.clear()
    while cache.evict_one():
        pass
    cache.offload_store().drain()


def _bring_back(cache: PrefixCache, policy: str, s: int, prompt: list[int]) -> int:
    """Session ``s`` back from the host: by its tag (``sessions``), or by the admission of its
    prompt (``blocks``); return its slot."""
    if policy == "blocks":
        hit = cache.acquire(prompt, len(prompt))
        assert hit is not None and hit.num_tokens == len(prompt)
        cache.track(hit.slot, prompt, len(prompt))
        return hit.slot
    assert cache.restore(f"s{s}")
    (slot,) = cache.tagged(f"s{s}")
    cache.acquire(prompt, len(prompt), own_tag=f"s{s}")  # adopted: a live slot again
    cache.track(slot, prompt, len(prompt))
    return slot


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """The fleet, its offload and restore; pages and GiB/s."""
    cfg = resolve_preset(args.model)
    spec = KVSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    backend = open_backend(args.device, host_page_size=2 << 20)
    page = backend.page_size
    length = args.prefix + args.private
    full = args.prefix * spec.token_bytes // page

    def pages_for(n: int) -> int:
        return -(-n * spec.token_bytes // page)

    fleet = full + args.sessions * (pages_for(length) - full)
    pool = PagePool(backend, fleet + 8)
    arena = KVArena(pool, spec, num_slots=args.sessions + 4, max_tokens=length)
    host_tokens = args.prefix + args.sessions * (args.private + BLOCK) + BLOCK
    store = HostKVStore(arena, host_tokens * spec.token_bytes,
                        make_copier(arena.kv.device, side_stream=True), block_tokens=BLOCK)
    cache = PrefixCache(arena, BLOCK, offload=store, cache_policy=CACHE_POLICIES[args.policy])
    prefix = list(range(1, args.prefix + 1))
    prompts = [[*prefix, *range(10**7 * (s + 1), 10**7 * (s + 1) + args.private)]
               for s in range(args.sessions)]
    live = {s: _admit(cache, p) for s, p in enumerate(prompts)}
    admitted, shared = pool.num_used, pool.num_shared
    paused = list(range(1, 1 + args.offloaded))
    expected = {s: arena.kv[live[s], :length].clone() for s in paused}  # [tokens, ...] bf16
    _evict_all(cache, {s: live.pop(s) for s in paused}, prompts)
    offloaded = pool.num_used
    loaded, load_s = store.counters.loaded_bytes, store.counters.load_s
    for s in paused:
        live[s] = _bring_back(cache, args.policy, s, prompts[s])
    store.drain()
    restored = pool.num_used
    equal = all(torch.equal(arena.kv[live[s], :length], expected[s]) for s in paused)
    warm_bytes, warm_s = store.counters.loaded_bytes - loaded, store.counters.load_s - load_s
    _evict_all(cache, live, prompts)  # cold: nothing resident
    emptied = pool.num_used
    loaded, load_s = store.counters.loaded_bytes, store.counters.load_s
    s = paused[0] if paused else 0
    slot = _bring_back(cache, args.policy, s, prompts[s])
    store.drain()
    cold_bytes, cold_s = store.counters.loaded_bytes - loaded, store.counters.load_s - load_s
    cold_equal = s not in expected or torch.equal(arena.kv[slot, :length], expected[s])
    result = {
        "policy": args.policy, "page_bytes": page, "token_bytes": spec.token_bytes,
        "tokens_per_page": page / spec.token_bytes, "prefix_full_pages": full,
        "prefix_tokens_on_shared_pages": full * page // spec.token_bytes,
        "pages_fleet_expected": fleet, "pages_one_copy_per_session":
            args.sessions * pages_for(length),
        "pages_after_admission": admitted, "pages_shared_after_admission": shared,
        "pages_after_offload": offloaded, "pages_after_restore": restored,
        "pages_after_evicting_all": emptied,
        "restored_equal": equal, "restore_bytes": warm_bytes,
        "restore_gib_s": warm_bytes / 2**30 / warm_s if warm_s else None,
        "cold_restore_bytes": cold_bytes,
        "cold_restore_gib_s": cold_bytes / 2**30 / cold_s if cold_s else None,
        "cold_restored_equal": bool(cold_equal),
        "host_blocks": store.num_held, "saved_bytes": store.counters.saved_bytes,
    }
    cache.release(slot, [], 0)
    cache.clear()
    arena.close()
    pool.close()
    backend.close()
    return result


def markdown(r: dict[str, Any], header: str) -> str:
    """The pages and rates as a table."""
    def gib(v: float | None) -> str:
        return f"{v:.1f} GiB/s" if v else "n/a"

    return "\n".join([
        header, "",
        "| what | measured |", "|---|---:|",
        f"| tokens a 2 MiB page holds | {r['tokens_per_page']:.2f} |",
        f"| prefix: full pages shared (tokens on them) | {r['prefix_full_pages']} "
        f"({r['prefix_tokens_on_shared_pages']}) |",
        f"| pages after admission / the fleet's arithmetic | {r['pages_after_admission']} / "
        f"{r['pages_fleet_expected']} |",
        f"| pages with one private copy per session | {r['pages_one_copy_per_session']} |",
        f"| pages mapped by more than one slot | {r['pages_shared_after_admission']} |",
        f"| pages after the offload | {r['pages_after_offload']} |",
        f"| pages after the restore | {r['pages_after_restore']} |",
        f"| pages after evicting every session | {r['pages_after_evicting_all']} |",
        f"| restored KV equal to what left | {r['restored_equal']} |",
        f"| restore (private tokens only): bytes, rate | {r['restore_bytes'] / 2**20:.0f} MiB, "
        f"{gib(r['restore_gib_s'])} |",
        f"| cold restore (whole context): bytes, rate | "
        f"{r['cold_restore_bytes'] / 2**20:.0f} MiB, {gib(r['cold_restore_gib_s'])} |",
        f"| cold restore equal | {r['cold_restored_equal']} |",
        f"| host blocks held / bytes saved | {r['host_blocks']} / "
        f"{r['saved_bytes'] / 2**30:.2f} GiB |",
    ])


def main(argv: list[str] | None = None) -> int:
    """CLI entry; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="qwen2.5-7b")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--prefix", type=int, default=16384)
    parser.add_argument("--private", type=int, default=2048)
    parser.add_argument("--offloaded", type=int, default=4)
    parser.add_argument("--policy", choices=("sessions", "blocks"), default="sessions")
    parser.add_argument("--device", choices=("cuda", "host"), default="cuda",
                        help="host: the host twin and synchronous copies (a dry run)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("shared_prefix_fleet needs a CUDA GPU (or --device host)", file=sys.stderr)
        return 2
    if not 0 <= args.offloaded < args.sessions:
        print("--offloaded must be in [0, --sessions)", file=sys.stderr)
        return 2
    if args.prefix < BLOCK:
        print(f"--prefix must be >= {BLOCK} (one block)", file=sys.stderr)
        return 2
    if args.private < 1:
        print("--private must be >= 1", file=sys.stderr)
        return 2
    with torch.inference_mode():
        result = measure(args)
    md = write_record(args, result, script="shared_prefix_fleet", argv=argv,
                      device="cuda" if args.device == "cuda" else "cpu",
                      stem=f"shared-prefix-fleet-{args.policy}",
                      title=f"A fleet on one shared prefix ({args.policy})", markdown=markdown)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
