"""What an FP8 KV cache changes in the logits of the embedded tool model (CPU).

    PYTHONPATH=. python3 -m benchmarks.scripts.fp8_kv_accuracy [--headrooms 16] [--unit-scales]
        [--max-prompt-tokens N]

For each of two chat prompts (the weather question and the booking request, each with the
``get_weather`` tool), runs a prefill of the first half of the prompt and then one decode step
per token, over a KV cache of each dtype compared (BF16; FP8 with scales calibrated as the
engine does at each ``--headrooms``; with ``--unit-scales`` FP8 with every scale 1.0, vLLM's
default without checkpoint scales), against the same steps over an FP32 cache. Prints one
Markdown row per (prompt, cache): the relative logit error per position (error norm / logit
norm), mean and max, the share of positions whose argmax agrees, and the mean KL(FP32 || cache).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from edmm.kernels._common import FP8_KV_DTYPE
from edmm.model import load_model, load_tokenizer
from edmm.model.attention import AttentionMetadata
from edmm.model.kv_quant import FP8_HEADROOM, calibrate_kv_scales, calibration_ids
from edmm.model.tiny import default_model
from edmm.model.transformer import CausalLM

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
PROMPTS = {
    "weather": [{"role": "user", "content": "What is the weather in Paris?"}],
    "booking": [{"role": "user", "content": "Book a table for two at 8pm in Rome and tell me "
                                            "the price."}],
}


def step_logits(model: CausalLM, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    """float32 logits [n - n // 2 + 1, vocab] of a prefill of half of ``ids``, then a decode
    step per token, over a cache of ``dtype`` (an FP8 one reads the model's KV scales)."""
    cfg, n = model.cfg, len(ids)
    cache = torch.zeros(1, n, cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)
    out = []
    for lo, hi in ((0, n // 2), *((i, i + 1) for i in range(n // 2, n))):
        meta = AttentionMetadata.build([0], [hi - lo], [hi])
        hidden = model(torch.tensor(ids[lo:hi]), meta.token_index, cache, meta)
        out.append(model.compute_logits(hidden[-1:]))
    return torch.cat(out)


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict[str, float]:
    """Relative error per row (mean, max), argmax agreement and mean KL(ref || got) of logits
    [n, vocab]."""
    rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
    p = ref.softmax(-1)
    kl = (p * (p.clamp_min(1e-30).log() - got.log_softmax(-1))).sum(-1)
    return {"rel_mean": float(rel.mean()), "rel_max": float(rel.max()),
            "argmax": float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
            "kl_mean": float(kl.mean())}


@torch.inference_mode()
def measure(headrooms: tuple[float, ...] = (FP8_HEADROOM,), unit_scales: bool = False,
            max_prompt_tokens: int | None = None) -> list[dict[str, Any]]:
    """One row per (prompt, cache compared): `compare`'s numbers and the prompt's tokens."""
    folder = default_model()
    model, cfg = load_model(folder, "cpu")
    tok = load_tokenizer(folder)
    ids0 = calibration_ids(tok, cfg.vocab_size)
    caches: dict[str, tuple[torch.dtype, torch.Tensor | None]] = {"bf16": (torch.bfloat16, None)}
    for h in headrooms:
        caches[f"fp8, headroom {h:g}"] = (FP8_KV_DTYPE, calibrate_kv_scales(model, ids0, h))
    if unit_scales:
        ones = torch.ones(cfg.num_layers, 2, cfg.num_kv_heads, dtype=torch.float32)
        caches["fp8, scales 1.0"] = (FP8_KV_DTYPE, ones)
    rows = []
    for prompt, conversation in PROMPTS.items():
        text = tok.apply_chat_template(conversation, tools=TOOLS, add_generation_prompt=True,
                                       tokenize=False)
        ids = list(tok.encode(text, add_special_tokens=False))[:max_prompt_tokens]
        model.set_kv_scales(None)
        ref = step_logits(model, ids, torch.float32)
        for name, (dtype, scales) in caches.items():
            model.set_kv_scales(scales)
            rows.append({"prompt": prompt, "tokens": len(ids), "cache": name,
                         **compare(ref, step_logits(model, ids, dtype))})
    model.set_kv_scales(None)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| prompt | tokens | KV cache | rel. logit error, mean | max | argmax agrees "
             "| KL, mean |", "|---|---:|---|---:|---:|---:|---:|"]
    lines += [f"| {r['prompt']} | {r['tokens']} | {r['cache']} | {r['rel_mean']:.2%} | "
              f"{r['rel_max']:.2%} | {r['argmax']:.1%} | {r['kl_mean']:.2e} |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--headrooms", type=lambda s: tuple(float(x) for x in s.split(",")),
                        default=(FP8_HEADROOM,),
                        help="calibration headrooms of the FP8 caches (comma-separated)")
    parser.add_argument("--unit-scales", action="store_true",
                        help="also an FP8 cache with every scale 1.0")
    parser.add_argument("--max-prompt-tokens", type=int, default=None,
                        help="cut each prompt to this many tokens (default: whole)")
    args = parser.parse_args()
    print(markdown(measure(args.headrooms, args.unit_scales, args.max_prompt_tokens)))


if __name__ == "__main__":
    main()
