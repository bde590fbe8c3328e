"""Does a host-to-GPU KV restore overlap decode steps? (issue 19's target, H200)

    PYTHONPATH=. python3 -m benchmarks.scripts.restore_overlap --out DIR [--context 16384]
        [--batch 8] [--restore-gib 1] [--steps 30] [--model qwen2.5-7b]

Builds the engine on ``--model`` (random weights, bf16, CUDA graphs), prefills ``--batch``
sequences of ``--context`` tokens and lets them decode. A paused session's KV of
``--restore-gib`` GiB is copied to pinned host memory (`HostKVStore.save`, blocks of 16 tokens
whose consecutive runs are one copy each), then:

1. ``alone``: ``--steps`` decode steps, each timed on the host (`Engine.step` returns once the
   step's tokens are on the host);
2. ``beside``: the restore is issued on the side stream (`StreamCopier`, what the engine does)
   and decode steps run until it is done; each step that started before the restore ended is
   timed; repeated until ``--steps`` such steps (a new restore when one ends);
3. ``sync``: the same restore with synchronous copies (`SyncCopier`, the old path), then one
   step: the step's wait is the copy's length.

Reports restore GiB/s (CUDA events on the copy stream, alone and beside steps), save GiB/s,
median decode step alone and beside a restore, their ratio (target <= 1.1) and the sync
path's step + copy. Writes ``restore-overlap.json`` and ``restore-overlap.md`` (device, date,
command) under ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.scripts.record import write_record
from edmm.engine import Engine, EngineConfig, SamplingParams
from edmm.memory import KVArena, KVSpec, PagePool, open_backend
from edmm.memory.copies import StreamCopier, SyncCopier
from edmm.memory.offload import BlockSave, HostKVStore
from edmm.model import resolve_preset

TARGET_RATIO = 1.1
TARGET_GIB_S = 40.0


def _engine(args: argparse.Namespace, restore_tokens: int) -> Engine:
    return Engine(EngineConfig(
        model=args.model, device="cuda", dtype="bfloat16",
        max_model_len=max(args.context + _decode_tokens(args) + 16, restore_tokens),
        num_slots=args.batch + 4, max_num_seqs=args.batch, max_num_batched_tokens=8192,
        cuda_graph_token_sizes=()))


def _decode_tokens(args: argparse.Namespace) -> int:
    """Tokens each sequence may decode: warm-up, alone, beside, the sync step, and spare."""
    return 4 * args.steps + 32


def _decoding(engine: Engine, args: argparse.Namespace) -> None:
    """``batch`` sequences of ``context`` random tokens, prefilled, each decoding."""
    g = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=_decode_tokens(args), ignore_eos=True)
    for i in range(args.batch):
        ids = torch.randint(0, vocab, (args.context,), generator=g).tolist()
        engine.add_request(f"r{i}", ids, params)
    while engine.num_prefilling():
        engine.step()
    for _ in range(5):  # warm the decode graph
        engine.step()


def _timed_step(engine: Engine) -> float:
    t0 = time.perf_counter()
    engine.step()
    return time.perf_counter() - t0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run the three phases; return the numbers (seconds, GiB/s)."""
    cfg = resolve_preset(args.model)
    token_bytes = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2  # bf16
    restore_tokens = int(args.restore_gib * 2**30) // token_bytes
    engine = _engine(args, restore_tokens)
    # The paused session's slot: an arena of its own on the engine's GPU, beside the engine's.
    backend = open_backend("cuda")
    pool = PagePool(backend, -(-restore_tokens * token_bytes // backend.page_size))
    spec = KVSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    arena = KVArena(pool, spec, num_slots=1, max_tokens=restore_tokens)
    side = StreamCopier(arena.kv.device)
    store = HostKVStore(arena, capacity_bytes=2 * restore_tokens * token_bytes, copier=side)
    session = arena.allocate()
    arena.grow(session, restore_tokens)
    arena.kv[session, :restore_tokens].normal_()
    bt = store.block_tokens
    saves = [BlockSave(i, start, min(bt, restore_tokens - start))
             for i, start in enumerate(range(0, restore_tokens, bt))]
    blocks = [(b.key, b.start) for b in saves]
    saved, held = store.save(session, saves)
    assert saved is not None and held == len(saves)
    side.wait(saved)
    _decoding(engine, args)
    alone = [_timed_step(engine) for _ in range(args.steps)]
    restore_alone = store.load(session, blocks, 0, restore_tokens)
    side.wait(restore_alone)
    beside: list[float] = []
    restores: list[float] = []
    while len(beside) < args.steps:
        ticket = store.load(session, blocks, 0, restore_tokens)
        while not side.poll(ticket) and len(beside) < args.steps:
            beside.append(_timed_step(engine))
        side.wait(ticket)
        assert ticket.seconds is not None
        restores.append(ticket.seconds)
    view = arena.token_bytes_view(session, 0, restore_tokens)  # [bytes] uint8
    view.zero_()  # on the compute stream: the side stream's copy is ordered after it
    check = store.load(session, blocks, 0, restore_tokens)
    side.wait(check)
    host = torch.cat([store.host_bytes(b.key) for b in saves])  # [bytes] uint8
    restored_equal = bool(torch.equal(view.cpu(), host))
    sync = SyncCopier().copy(store.load_pairs(session, blocks, 0, restore_tokens), False)
    sync_step = _timed_step(engine)
    nbytes = restore_tokens * token_bytes
    gib = nbytes / 2**30
    assert saved.seconds and restore_alone.seconds and sync.seconds
    a, b = statistics.median(alone), statistics.median(beside)
    result = {
        "restore_bytes": nbytes, "restore_tokens": restore_tokens,
        "save_gib_s": gib / saved.seconds,
        "restore_gib_s_alone": gib / restore_alone.seconds,
        "restore_gib_s_beside_steps": gib / statistics.median(restores),
        "restore_gib_s_sync": gib / sync.seconds,
        "decode_step_alone_ms": a * 1e3, "decode_step_beside_restore_ms": b * 1e3,
        "ratio": b / a, "steps_alone": len(alone), "steps_beside": len(beside),
        "restores_beside": len(restores),
        "sync_restore_then_step_ms": (sync.seconds + sync_step) * 1e3,
        "restored_equal": restored_equal,
    }
    store.clear()
    del view, host
    arena.close()
    pool.close()
    backend.close()
    engine.close()
    return result


def markdown(r: dict[str, Any], header: str) -> str:
    """The numbers against the issue's targets."""
    ok = "PASS" if r["ratio"] <= TARGET_RATIO else "MISS"
    gib_ok = "PASS" if r["restore_gib_s_beside_steps"] >= TARGET_GIB_S else "MISS"
    return "\n".join([
        header, "",
        "| what | measured | target |", "|---|---:|---|",
        f"| restore {r['restore_bytes'] / 2**30:.2f} GiB, alone | "
        f"{r['restore_gib_s_alone']:.1f} GiB/s | >= {TARGET_GIB_S} |",
        f"| restore beside decode steps | {r['restore_gib_s_beside_steps']:.1f} GiB/s | "
        f">= {TARGET_GIB_S}: {gib_ok} |",
        f"| save (offload) | {r['save_gib_s']:.1f} GiB/s | |",
        f"| synchronous restore (old path) | {r['restore_gib_s_sync']:.1f} GiB/s | |",
        f"| decode step alone (median of {r['steps_alone']}) | "
        f"{r['decode_step_alone_ms']:.2f} ms | |",
        f"| decode step beside a restore (median of {r['steps_beside']}) | "
        f"{r['decode_step_beside_restore_ms']:.2f} ms | |",
        f"| ratio beside / alone | {r['ratio']:.3f} | <= {TARGET_RATIO}: {ok} |",
        f"| synchronous restore, then a step | {r['sync_restore_then_step_ms']:.2f} ms | |",
        f"| restored bytes equal the saved ones | {r['restored_equal']} | True |",
    ])


def main(argv: list[str] | None = None) -> int:
    """CLI entry; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="qwen2.5-7b")
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--restore-gib", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("restore_overlap needs a CUDA GPU", file=sys.stderr)
        return 2
    with torch.inference_mode():
        result = measure(args)
    md = write_record(args, result, script="restore_overlap", argv=argv, device="cuda",
                      stem="restore-overlap", title="Restore beside decode steps",
                      markdown=markdown)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
