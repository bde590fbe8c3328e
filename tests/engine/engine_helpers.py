"""Helpers of the engine tests: tiny random HF checkpoints with HF greedy references, run loops."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hf_weights import randomize_

from edmm.engine import Engine, RequestOutput, SamplingParams

MakeEngine = Callable[..., Engine]

VOCAB = 256
NEW_TOKENS = 32
PROMPT_LENS = (3, 17, 40, 65)
# 2 layers x {K, V} x 2 kv heads x 16 dims x 4 B = 512 B per token: 8 tokens per 4 KiB page.
HOST_PAGE = 4096
TOKENS_PER_PAGE = 8

HF_SHAPE: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
    pad_token_id=None,
)


@dataclass(frozen=True)
class HFCase:
    """A tiny random HF checkpoint on disk and the HF greedy continuations of its prompts."""

    folder: Path
    hf_model: Any
    prompts: list[list[int]]
    reference: list[list[int]]  # HF generate(do_sample=False), NEW_TOKENS each

    def greedy(self, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
        """HF greedy continuation of any prompt (never stops at EOS)."""
        out = self.hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                                     min_new_tokens=n, eos_token_id=None, pad_token_id=0)
        return out[0, len(prompt):].tolist()


def build_case(root: Path, arch: str) -> HFCase:
    import transformers

    cfg_cls = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig}[arch]
    model = transformers.AutoModelForCausalLM.from_config(
        cfg_cls(**HF_SHAPE), dtype=torch.float32, attn_implementation="eager")
    randomize_(model, seed=0)
    model.eval()
    folder = root / arch
    model.save_pretrained(str(folder))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    case = HFCase(folder, model, prompts, [])
    return HFCase(folder, model, prompts, [case.greedy(p) for p in prompts])



def greedy(max_tokens: int = NEW_TOKENS, **kwargs: Any) -> SamplingParams:
    """Greedy params that ignore EOS (random models emit it at random)."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def run_to_completion(engine: Engine, check: Callable[[Engine], None] | None = None,
                      ) -> dict[str, RequestOutput]:
    """Step until every request finished; ``check(engine)`` after each step."""
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if check is not None:
            check(engine)
    return final
