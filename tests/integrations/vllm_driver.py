"""Driver of the vLLM connector tests: one engine, agent-session scenarios, JSON out.

Run as a script (spawn-safe): ``python vllm_driver.py MODEL_DIR OUT_JSON [STORE_DIR]``;
without STORE_DIR the engine runs without the connector.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

BLOCK = 32
LOCAL_PREFIX = 100  # tokens of the prompt recomputed by another request before the resume
STORE_MAX_BYTES = 4 << 20  # a session of this model is ~0.3 MiB
SCENARIOS = ("plain", "local_prefix", "corrupt", "missing", "full", "expired", "untagged")


def build_model(folder: Path) -> Path:
    """A tiny random Qwen2 (head_dim 64, float32) with EDMM's embedded tokenizer."""
    import torch
    import transformers

    from edmm.model.tiny import ensure_tiny_model

    if (folder / "config.json").is_file():
        return folder
    tok_dir = ensure_tiny_model(folder.parent / "edmm-cache")
    cfg = transformers.Qwen2Config(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=2,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(0.05 * noise)
            else:
                p.copy_(0.2 * noise)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tok_dir / f).is_file():
            shutil.copy(tok_dir / f, tmp / f)
    tmp.rename(folder)
    return folder


def corrupt_store(store: Path) -> int:
    """Flip a byte in the payload of every kept block file; returns how many."""
    n = 0
    for f in (store / "sessions").rglob("*.kvb"):
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
        n += 1
    return n


def main(model_dir: str, out_json: str, store_dir: str | None) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = {}
    if store_dir:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="EDMMConnector",
            kv_connector_module_path="edmm.integrations.vllm.connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={
                "edmm_store_path": store_dir,
                "edmm_grace_s": 0.0,
                "edmm_store_max_bytes": STORE_MAX_BYTES,
            },
        )
    llm = LLM(
        model=model_dir,
        dtype="float32",
        block_size=BLOCK,
        max_model_len=1024,
        enforce_eager=True,
        enable_prefix_caching=True,
        seed=0,
        **kwargs,
    )
    rng = random.Random(0)

    def gen(
        ids: list[int], session: str | None, tool_s: float = 60.0
    ) -> tuple[list[int], int, float]:
        extra = {}
        if session is not None:
            extra = {"kv_transfer_params": {"edmm_session": session, "edmm_tool_s": tool_s}}
        sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, extra_args=extra)
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
        dt = time.perf_counter() - t0
        return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0), dt

    results: dict[str, Any] = {}
    for scenario in SCENARIOS:
        prompt = [rng.randrange(10, 1000) for _ in range(300)]
        tool = [rng.randrange(10, 1000) for _ in range(50)]
        session = None if scenario == "untagged" else f"s-{scenario}"
        tool_s = 0.0 if scenario == "expired" else 60.0
        filler = Path(store_dir or "/nonexistent") / "filler.bin"
        if store_dir and scenario == "full":  # no room left: nothing can be kept
            filler.parent.mkdir(parents=True, exist_ok=True)
            filler.write_bytes(bytes(STORE_MAX_BYTES))
            time.sleep(1.2)  # the worker rescans the store's size at most once a second
        out1, cached1, _ = gen(prompt, session, tool_s)
        if store_dir and scenario == "full":
            filler.unlink()
        assert llm.reset_prefix_cache(), "prefix cache reset refused"
        info: dict[str, Any] = {"prompt_len": len(prompt), "out1": out1, "cached1": cached1}
        if store_dir and scenario == "corrupt":
            info["corrupted"] = corrupt_store(Path(store_dir))
        if store_dir and scenario == "missing":
            shutil.rmtree(store_dir)
        if scenario == "expired":
            time.sleep(0.2)
        if scenario == "local_prefix":  # vLLM's own cache gets back the first blocks only
            gen(prompt[:LOCAL_PREFIX], None)
        resume = prompt + out1 + tool
        out2, cached2, dt = gen(resume, session)
        info.update(resume_len=len(resume), out2=out2, cached2=cached2, resume_s=dt)
        if scenario == "plain":  # a second tool call: the resumed turn is kept in its turn
            assert llm.reset_prefix_cache(), "prefix cache reset refused"
            resume3 = resume + out2 + [rng.randrange(10, 1000) for _ in range(40)]
            out3, cached3, _ = gen(resume3, session)
            info.update(resume3_len=len(resume3), out3=out3, cached3=cached3)
        results[scenario] = info
        if store_dir and Path(store_dir).exists():  # next scenario starts from a clean store
            for d in (Path(store_dir) / "sessions").iterdir():
                shutil.rmtree(d)
    Path(out_json).write_text(json.dumps(results))


if __name__ == "__main__":
    if sys.argv[1] == "--build":
        print(build_model(Path(sys.argv[2])))
    else:
        main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
