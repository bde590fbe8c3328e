"""The A/B/C resume groups through HF transformers: the peer a user would otherwise pick.

The same prompts' shapes as `edmm.bench.resume` (context C of n - |R| tokens, a tool result R,
insertion point p), on transformers' best path for each (SDPA attention, a DynamicCache):

- A: copy the session's cache, prefill R;
- B: copy the cache's first p tokens, recompute R + C[p:] (its prefix ends at the insertion);
- C: copy a cache that already holds the whole prompt but its last token (computed before the
  clock starts, as EDMM's speculation is), prefill the last token.

Each time runs from the copy to the first token, device synchronised around it.
"""

from __future__ import annotations

import copy
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from edmm.bench.model_ops import HFSide, ModelOpsConfig
from edmm.bench.results import (
    GROUPS_CAPTION,
    Progress,
    ResultWriter,
    collect_environment,
    plot_bars,
    tokens_label,
)
from edmm.bench.resume import GROUPS, ResumeBenchConfig
from edmm.bench.stats import ratio, summarize
from edmm.model.config import ModelConfig

PEER_NAMES = {"A": "cached prefix copied, result appended",
              "B": "prefix copied up to the insertion, recompute from it",
              "C": "cache of the speculated prompt copied, last token prefilled"}


def _timed(side: HFSide, cache: Any, ids: torch.Tensor, keep: int | None) -> float:
    """Copy ``cache`` (cropped to ``keep`` tokens), prefill ``ids``, take the first token."""
    if side.device.type == "cuda":
        torch.cuda.synchronize(side.device)
    t0 = time.perf_counter()
    side.cache = copy.deepcopy(cache)
    if keep is not None:
        side.truncate(keep)
    int(side.extend(ids))  # the host waits for the token
    return (time.perf_counter() - t0) * 1e3


@torch.inference_mode()
def measure_peer(side: HFSide, cfg: ResumeBenchConfig, vocab: int) -> list[dict[str, Any]]:
    """Per-iteration rows of every group at every context (warm-up iterations dropped)."""
    rng = random.Random(cfg.seed)
    dev = side.device
    rows: list[dict[str, Any]] = []
    progress = Progress("peer groups",
                        len(cfg.contexts) * len(GROUPS) * (cfg.warmup + cfg.iterations))
    for n in cfg.contexts:
        ctx = torch.tensor([rng.randrange(vocab) for _ in range(n - cfg.result_tokens)],
                           device=dev)
        res = torch.tensor([rng.randrange(vocab) for _ in range(cfg.result_tokens)],
                           device=dev)
        p = int(cfg.insert_fraction * ctx.shape[0])
        inserted = torch.cat((ctx[:p], res, ctx[p:]))  # B's and C's prompt, n tokens
        side.truncate(0)
        side.extend(ctx)
        base = side.cache
        side.cache = None
        side.extend(inserted[:-1])
        speculated = side.cache
        plans = {"A": (base, res, None), "B": (base, inserted[p:], p),
                 "C": (speculated, inserted[-1:], None)}
        for group in GROUPS:
            cache, ids, keep = plans[group]
            for i in range(cfg.warmup + cfg.iterations):
                ms = _timed(side, cache, ids, keep)
                progress.step(f"context {n} group {group}")
                if i >= cfg.warmup:
                    rows.append({"engine": "transformers", "context_tokens": n, "group": group,
                                 "iteration": i - cfg.warmup, "ttft_ms": ms,
                                 "prefilled_tokens": ids.shape[0]})
        side.cache = base = speculated = None
    return rows


def model_config(model: str | None) -> ModelConfig:
    """The config of a local folder, a preset, or (None) the embedded tiny model."""
    from edmm.model.config import resolve_preset
    from edmm.model.tiny import ensure_tiny_model

    if model is None:
        return ModelConfig.from_folder(ensure_tiny_model())
    if Path(model).is_dir():
        return ModelConfig.from_folder(model)
    return resolve_preset(model)


def run_peer_bench(cfg: ResumeBenchConfig, out_dir: Path) -> dict[str, Path]:
    """Run the peer's groups; write ``agent-ttft-transformers.{csv,json,md}``."""
    mcfg = model_config(cfg.model)
    tcfg = ModelOpsConfig(model=cfg.model or "tiny", device=cfg.device,
                           dtype=cfg.dtype or mcfg.dtype)
    side = HFSide(tcfg, mcfg)
    try:
        rows = measure_peer(side, cfg, mcfg.vocab_size)
    finally:
        side.close()
    summary = []
    for n in cfg.contexts:
        means: dict[str, float] = {}
        for group in GROUPS:
            s = summarize([r["ttft_ms"] for r in rows
                           if r["context_tokens"] == n and r["group"] == group])
            means[group] = s.trimmed_mean
            summary.append({"engine": "transformers", "context_tokens": n, "group": group,
                            "what": PEER_NAMES[group], "ttft_trimmed_mean_ms": s.trimmed_mean,
                            "median_ms": s.median, "p10_ms": s.p10, "p90_ms": s.p90,
                            "n": s.n, "ratio_to_A": ratio(s.trimmed_mean, means["A"])})
    writer = ResultWriter(out_dir, "agent-ttft-transformers", collect_environment(cfg.device))
    writer.add_rows(rows)
    notes = [f"transformers with SDPA and a DynamicCache; model {tcfg.model}, {tcfg.dtype}, "
             "random token ids; A and C copy a cache (C's holds the speculated prompt), B copies "
             "the prefix up to the insertion and recomputes the rest",
             f"iterations: {cfg.iterations} after {cfg.warmup} warm-up"]
    return writer.write(summary, title=f"A/B/C resume groups through transformers "
                        f"({cfg.device})", notes=notes)


def plot_groups(out_dir: Path, model: str | None = None) -> Path:
    """``agent-ttft.png``: TTFT of each group by context, EDMM beside transformers, from the
    ``agent-ttft.json`` (and, when there, ``agent-ttft-transformers.json``) in ``out_dir``
    (the bench's own output, or committed results: the plot is rebuilt from them); ``model``
    names the model in the title."""
    rows = []
    device = ""
    for name, engine in (("agent-ttft", "edmm"), ("agent-ttft-transformers", "transformers")):
        path = out_dir / f"{name}.json"
        if path.exists():
            doc = json.loads(path.read_text())
            env = doc.get("environment", {})
            device = device or env.get("gpu_name") or f"CPU ({env.get('cpu_model') or '?'})"
            for r in doc["summary"]:
                rows.append({"context": tokens_label(r["context_tokens"]),
                             "bar": f"{engine} {r['group']}",
                             "ttft_ms": r["ttft_trimmed_mean_ms"]})
    return plot_bars(rows, "context", "ttft_ms", "bar", out_dir / "agent-ttft.png",
                     f"Time to first token of a resumed agent turn, by group ({device}"
                     + (f", model {model})" if model else ")"), log_y=True,
                     x_label="context length (tokens)",
                     y_label="time to first token (ms, trimmed mean; log scale)",
                     legend_title="engine and group", caption=GROUPS_CAPTION)
