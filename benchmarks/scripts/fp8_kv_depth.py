"""How FP8 KV's logit error grows with depth on the qwen2.5-7b shapes (random weights, CPU).

    python -m benchmarks.scripts.fp8_kv_depth --layers 1,4,8 --tokens 512 --out DIR

For each depth L: the ``qwen2.5-7b`` preset's config cut to L layers, random weights
(`init_random`, seed 0), float32, the reference SDPA attention on the CPU. A prefill of
``--tokens`` random ids, then 8 decode steps, three times: with a float32 KV cache (the
reference), a bfloat16 one and an FP8 one (e4m3, scales calibrated as the engine does). The
logits of the 9 last positions against the reference: relative error (norm of the difference
over the norm) mean and max, and argmax agreement. Writes ``fp8-kv-depth.{json,md}``.

Random weights are not trained ones: the residual stream is mostly attention outputs that
average random V rows, so e4m3's per-value rounding error (~3.6% RMS) reaches the logits
undiminished and adds up layer after layer. This bounds what the GPU test of the 28-layer
logits may see; it says nothing of FP8's accuracy on a trained model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch

from edmm.kernels._common import FP8_KV_DTYPE
from edmm.model.attention import AttentionMetadata
from edmm.model.config import resolve_preset
from edmm.model.kv_quant import calibrate_kv_scales, calibration_ids
from edmm.model.loader import build_empty, init_random

DECODE_STEPS = 8
KV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": FP8_KV_DTYPE}


@torch.inference_mode()
def logits_with(model: Any, ids: torch.Tensor, prompt: int, dtype: torch.dtype) -> torch.Tensor:
    """Logits [1 + DECODE_STEPS, vocab] of a prefill of ``prompt`` ids then the decode steps,
    with a KV cache of ``dtype``."""
    cfg = model.cfg
    scales = (calibrate_kv_scales(model, calibration_ids(None, cfg.vocab_size))
              if dtype == FP8_KV_DTYPE else None)
    model.set_kv_scales(scales)
    cache = torch.zeros(1, prompt + DECODE_STEPS, cfg.num_layers, 2, cfg.num_kv_heads,
                        cfg.head_dim, dtype=dtype)  # [1, n, L, 2, Hkv, D]
    pos, out = 0, []
    for n in (prompt,) + (1,) * DECODE_STEPS:
        meta = AttentionMetadata.build([0], [n], [pos + n], "cpu")
        h = model(ids[pos:pos + n], meta.token_index, cache, meta)
        out.append(model.compute_logits(h[-1:]).float())
        pos += n
    return torch.cat(out)


def measure(layers: int, prompt: int) -> list[dict[str, Any]]:
    cfg = dataclasses.replace(resolve_preset("qwen2.5-7b"), num_layers=layers)
    model = build_empty(cfg, "cpu", torch.float32, prompt + DECODE_STEPS, None)
    init_random(model, seed=0)
    model.eval().requires_grad_(False)
    ids = torch.randint(0, cfg.vocab_size, (prompt + DECODE_STEPS,),
                        generator=torch.Generator().manual_seed(1))
    got = {name: logits_with(model, ids, prompt, dt) for name, dt in KV_DTYPES.items()}
    ref, rows = got["fp32"], []
    for name in ("bf16", "fp8"):
        rel = (got[name] - ref).norm(dim=-1) / ref.norm(dim=-1)
        rows.append({"layers": layers, "kv": name, "rel_mean": float(rel.mean()),
                     "rel_max": float(rel.max()),
                     "argmax_agree": float((got[name].argmax(-1) == ref.argmax(-1)).float()
                                           .mean())})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", default="1,4,8")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    rows = [r for n in a.layers.split(",") for r in measure(int(n), a.tokens)]
    a.out.mkdir(parents=True, exist_ok=True)
    cmd = f"python -m benchmarks.scripts.fp8_kv_depth --layers {a.layers} --tokens {a.tokens}"
    (a.out / "fp8-kv-depth.json").write_text(json.dumps({"command": cmd, "rows": rows},
                                                        indent=1))
    lines = [f"# FP8 KV logit error by depth, qwen2.5-7b shapes, random weights (CPU, "
             f"{time.strftime('%Y-%m-%d')})", "", f"    {cmd}", "",
             "| layers | KV | logits rel. error mean | max | argmax agreement |",
             "|---:|---|---:|---:|---:|"]
    lines += [f"| {r['layers']} | {r['kv']} | {r['rel_mean']:.4f} | {r['rel_max']:.4f} | "
              f"{r['argmax_agree']:.3f} |" for r in rows]
    (a.out / "fp8-kv-depth.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
