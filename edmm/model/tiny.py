"""The embedded models: a tiny Qwen2 trained for the tool-call format, and its random twin.

``default_model()`` is the folder of the shipped tool model (package data, a few MB: the
``tiny`` preset's architecture and tokenizer trained by the source repository's
``training/train_tool_model.py`` on generated tool-use conversations; it knows the format, not
the world). It is the default model of ``LLM()``, ``AgentEngine()``, ``edmm serve`` and
``edmm demo``.

``ensure_tiny_model()`` builds the random tiny model once (no downloads, ~1 s) under
``$EDMM_CACHE`` or ``~/.cache/edmm`` and returns the HF-format folder, loadable with
``load_model`` / ``load_tokenizer`` or with transformers itself; tests compare it against
transformers.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from edmm.model.config import resolve_preset
from edmm.model.errors import ModelNotFoundError
from edmm.model.loader import export_hf_state_dict, load_model
from edmm.model.prompt_encoder import QWEN2_SPLIT
from edmm.model.tiny_assets import CHAT_TEMPLATE, SPECIAL_TOKENS, TOOL_TOKENS, corpus

TINY_VERSION = "v1"  # bump whenever the built folder would change
TINY_SEED = 0
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


TOOL_MODEL_DIR = Path(__file__).parent / "assets" / "tool-tiny"


def default_model() -> Path:
    """The shipped tool model's folder (config, safetensors weights, tokenizer, template)."""
    if not _is_complete(TOOL_MODEL_DIR):
        raise ModelNotFoundError(f"the embedded tool model is missing from {TOOL_MODEL_DIR} "
                                "(a broken install?); reinstall edmm, or rebuild it in a source "
                                "checkout with python -m training.train_tool_model --out FOLDER")
    return TOOL_MODEL_DIR


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir``, else ``$EDMM_CACHE``, else ``~/.cache/edmm``."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("EDMM_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "edmm"


def ensure_tiny_model(cache_dir: str | Path | None = None) -> Path:
    """Path of the tiny model folder, building it first if needed.

    Safe under concurrency: each builder writes a private temp dir and renames it into
    place atomically; a loser of the race discards its copy.
    """
    root = cache_root(cache_dir)
    final = root / f"tiny-qwen2-{TINY_VERSION}"
    if _is_complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        build_tiny_model(tmp)
        tmp.chmod(0o755)
        try:
            tmp.rename(final)
        except OSError:
            if not _is_complete(final):  # lost the race to a finished build: fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _is_complete(folder: Path) -> bool:
    return all((folder / f).is_file() for f in _REQUIRED_FILES)


def build_tiny_model(folder: Path) -> None:
    """Write config.json, model.safetensors and the tokenizer files into ``folder``."""
    cfg = resolve_preset("tiny")
    save_tiny_tokenizer(folder, cfg.vocab_size)
    model, _ = load_model("tiny", "cpu", torch.float32, seed=TINY_SEED, max_positions=1)
    save_file(export_hf_state_dict(model), str(folder / "model.safetensors"), {"format": "pt"})
    hf = cfg.to_hf_dict()
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    gen = {"bos_token_id": hf["bos_token_id"], "eos_token_id": hf["eos_token_id"]}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def train_tiny_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE trained on the embedded corpus.

    Ids 0-2 are the special tokens ``<|endoftext|> <|im_start|> <|im_end|>``, ids 3-8 the
    tool/think markers (added, never split, but not "special": they survive
    ``skip_special_tokens`` decoding, as in Qwen).
    """
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            # Qwen2's pre-tokenization: transformers 5 rebuilds Qwen2Tokenizer with exactly
            # this pipeline, so training with it makes AutoTokenizer and tokenizer.json agree.
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*SPECIAL_TOKENS, *TOOL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    spec = json.loads(tok.to_str())
    for added in spec["added_tokens"]:
        added["special"] = added["content"] in SPECIAL_TOKENS
    return Tokenizer.from_str(json.dumps(spec))


def save_tiny_tokenizer(folder: Path, vocab_size: int = 1024) -> None:
    """Train the tokenizer and save it (with the chat template) as a PreTrainedTokenizerFast."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=train_tiny_tokenizer(vocab_size),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=resolve_preset("tiny").max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    # Name the Qwen2 class so transformers 4.x (Qwen2TokenizerFast) and 5.x agree.
    cfg_path = folder / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "Qwen2Tokenizer"
    cfg_path.write_text(json.dumps(tok_cfg, indent=2) + "\n")
