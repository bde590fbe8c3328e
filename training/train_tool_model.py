"""Train the embedded tool model: ``python -m training.train_tool_model --out FOLDER`` (from the
repository root).

A small Qwen2 (the ``tiny`` preset's architecture and tokenizer) trained with transformers on
the generated conversations of :mod:`training.tool_corpus`, rendered with the embedded chat
template exactly as ``edmm serve`` renders a request; the loss covers only the assistant's
tokens (its tool calls, answers and the closing ``<|im_end|>``). Seeded and deterministic on
one machine (torch's CPU kernels may round differently elsewhere). The folder it writes is an
ordinary HF model folder. The shipped ``edmm/model/assets/tool-tiny`` came from five runs on
one shared CPU core (about 25, 10, 4, 5 and 8 minutes), each starting from the last one's
folder:

    python -m training.train_tool_model --out /tmp/p1 --stop-after 401
    python -m training.train_tool_model --init /tmp/p1 --copy-phase 1 --steps 240 \\
        --batch 12 --lr 3e-3 --warmup 20 --seed 1 --conversations 4000 --out /tmp/p2
    python -m training.train_tool_model --init /tmp/p2 --copy-phase 2 --steps 300 \\
        --batch 16 --lr 3e-3 --warmup 20 --seed 2 --conversations 5000 --out /tmp/p3
    python -m training.train_tool_model --init /tmp/p3 --copy-phase 1 --steps 250 \\
        --batch 12 --lr 2e-3 --warmup 10 --seed 3 --conversations 3000 --out /tmp/p4
    python -m training.train_tool_model --init /tmp/p4 --copy-phase 1 --steps 250 \\
        --batch 12 --lr 1.5e-3 --warmup 10 --seed 4 --conversations 3000 \\
        --out edmm/model/assets/tool-tiny

The first learns the format and which tool to call; the others, on shorter conversations where
copying from the question is most of the reply, teach it to copy (phases 2, 4 and 5 mix some
of the full corpus back in: parallel calls, direct answers).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from edmm.model.config import resolve_preset
from edmm.model.tiny import ensure_tiny_model
from training.tool_corpus import conversation, copy_conversation, short_copy_conversation

IGNORE = -100
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@dataclass(frozen=True)
class TrainConfig:
    """What the run does; the defaults made the shipped weights."""

    out: Path
    steps: int = 600
    batch: int = 8
    lr: float = 4e-3
    warmup: int = 50
    seed: int = 0
    conversations: int = 8000
    threads: int = 1
    stop_after: int | None = None  # stop after this many steps (of the ``steps`` schedule)
    init: Path | None = None  # start from this model folder (the second phase)
    copy_phase: int = 0  # 1: tool_corpus.copy_conversation, 2: short_copy_conversation


def completion_text(message: dict[str, Any]) -> str:
    """An assistant message as the model writes it (what the chat template renders for it)."""
    parts = [message.get("content") or ""]
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        parts.append(f'<tool_call>\n{{"name": "{fn["name"]}", "arguments": {fn["arguments"]}}}'
                     "\n</tool_call>")
    return "\n".join(p for p in parts if p) + "<|im_end|>"


def render_example(tok: Any, tools: list[dict[str, Any]],
                   messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of one conversation: labels are IGNORE outside the replies.

    Each reply follows its prompt rendered with ``add_generation_prompt=True``, so the
    sequence is what the server feeds the model at every turn.
    """
    spans: list[tuple[int, int]] = []
    text = ""
    for j, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = tok.apply_chat_template(messages[:j], tools=tools or None, tokenize=False,
                                         add_generation_prompt=True)
        if not prompt.startswith(text):
            raise ValueError(f"the template's render of turn {j} does not extend turn {j - 1}")
        reply = completion_text(m)
        spans.append((len(prompt), len(prompt) + len(reply)))
        text = prompt + reply
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = enc["input_ids"]
    labels = [IGNORE] * len(ids)
    for i, (start, end) in enumerate(enc["offset_mapping"]):
        if any(s <= start and end <= e for s, e in spans):
            labels[i] = ids[i]
    return ids, labels


def build_dataset(tok: Any, n: int, seed: int,
                  copy_phase: int = 0) -> list[tuple[list[int], list[int]]]:
    """``n`` rendered conversations, number ``seed * 10**6 + i`` for i < n (of
    :func:`copy_conversation` in copy phase 1, :func:`short_copy_conversation` in 2)."""
    make = (conversation, copy_conversation, short_copy_conversation)[copy_phase]
    return [render_example(tok, *make(seed * 10**6 + i)) for i in range(n)]


def batches(data: list[tuple[list[int], list[int]]], size: int,
            rng: random.Random) -> list[list[int]]:
    """Indices of ``data`` in batches of similar lengths (little padding), in random order."""
    by_len = sorted(range(len(data)), key=lambda i: len(data[i][0]))
    out = [by_len[i : i + size] for i in range(0, len(by_len) - size + 1, size)]
    rng.shuffle(out)
    return out


def _batch(rows: list[tuple[list[int], list[int]]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``(ids, labels)`` [batch, width]: with causal attention no real token
    sees a pad, so no attention mask is needed; pads carry IGNORE labels."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)  # [batch, width]
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for r, (x, y) in enumerate(rows):
        ids[r, : len(x)] = torch.tensor(x)
        labels[r, : len(y)] = torch.tensor(y)
    return ids, labels


def _lr(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(cfg: TrainConfig) -> Path:
    """Train and write the model folder ``cfg.out``; returns it."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    tiny = ensure_tiny_model()
    tok = AutoTokenizer.from_pretrained(str(tiny), local_files_only=True)
    hf = resolve_preset("tiny").to_hf_dict()
    if cfg.init is None:
        model = Qwen2ForCausalLM(Qwen2Config(**hf, attn_implementation="eager")).float()  # type: ignore[call-arg]
    else:
        model = Qwen2ForCausalLM.from_pretrained(str(cfg.init), dtype=torch.float32,
                                                 attn_implementation="eager")
    data = build_dataset(tok, cfg.conversations, cfg.seed, cfg.copy_phase)
    order = random.Random(cfg.seed)
    plan: list[list[int]] = []
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98),
                            weight_decay=0.01)
    model.train()
    t0 = time.perf_counter()
    for step in range(cfg.stop_after or cfg.steps):
        if not plan:
            plan = batches(data, cfg.batch, order)
        ids, labels = _batch([data[i] for i in plan.pop()], tok.pad_token_id)
        for group in opt.param_groups:
            group["lr"] = _lr(step, cfg)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 20 == 0 or step == (cfg.stop_after or cfg.steps) - 1:
            if step % 200 == 0 and step:
                _save(model, hf, tiny, cfg.out)
            print(f"step {step:5d}  loss {loss.item():.4f}  "
                  f"{time.perf_counter() - t0:7.1f} s", flush=True)
    _save(model, hf, tiny, cfg.out)
    return cfg.out


def _save(model: Any, hf: dict[str, Any], tiny: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()
             if not k.endswith("rotary_emb.inv_freq")}
    save_file(state, str(out / "model.safetensors"), {"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    gen = {"bos_token_id": hf["bos_token_id"], "eos_token_id": hf["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    for name in _TOKENIZER_FILES:
        if (tiny / name).is_file():
            shutil.copy(tiny / name, out / name)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry: every :class:`TrainConfig` field is a flag."""
    d = TrainConfig(out=Path("."))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="model folder to write")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    p.add_argument("--batch", type=int, default=d.batch, help="conversations per step")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (cosine decay)")
    p.add_argument("--warmup", type=int, default=d.warmup, help="linear warm-up steps")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of corpus, init and order")
    p.add_argument("--conversations", type=int, default=d.conversations,
                   help="generated conversations to sample batches from")
    p.add_argument("--threads", type=int, default=d.threads, help="torch CPU threads")
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop after this many steps of the --steps schedule (default: all)")
    p.add_argument("--init", type=Path, default=None,
                   help="continue from this model folder (default: a fresh random init)")
    p.add_argument("--copy-phase", type=int, choices=(0, 1, 2), default=0,
                   help="0: the full corpus; 1: short, copy-heavy conversations; 2: the "
                        "shortest ones (JSON extraction, single calls to a lone tool)")
    a = p.parse_args(argv)
    train(TrainConfig(a.out, a.steps, a.batch, a.lr, a.warmup, a.seed, a.conversations,
                      a.threads, a.stop_after, a.init, a.copy_phase))


if __name__ == "__main__":
    main()
