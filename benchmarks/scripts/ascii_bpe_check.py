"""`edmm.model.ascii_bpe` against the tokenizer itself on a corpus of ASCII files (CPU).

    python -m benchmarks.scripts.ascii_bpe_check --tokenizer DIR --root DIR [--seconds 900]
        [--recovered-merges]

Encodes every ASCII text file under ``--root`` (``.py .pyi .md .rst .txt .json .html .c .h``;
files holding an added token's text are skipped: the prompt encoder cuts those out before) with
`AsciiBPE` and with the Hugging Face tokenizer, whole, until ``--seconds`` have passed, and
counts the files whose ids differ. ``--recovered-merges``: the tokenizer's merges replaced by
one per token (`edmm.model.qwen_vocab.recovered_merges` over its vocabulary), the form of
Qwen2.5's published tokenizer.json. Writes ascii-bpe-check.{csv,json,md} into ``--out``: one
row per file extension, and the two encoders' total times.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from edmm.bench.results import ResultWriter, collect_environment

EXTENSIONS = (".py", ".pyi", ".md", ".rst", ".txt", ".json", ".html", ".c", ".h")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", required=True, help="a tokenizer folder")
    parser.add_argument("--root", required=True, help="the folder whose files are the corpus")
    parser.add_argument("--seconds", type=float, default=900.0, help="stop after this long")
    parser.add_argument("--out", default="ascii-bpe-check", help="folder for the results")
    parser.add_argument("--recovered-merges", action="store_true",
                        help="replace the merges by one recovered merge per token")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from edmm.model.ascii_bpe import AsciiBPE
    from edmm.model.prompt_encoder import cuttable_split

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    fast: Any = tok._tokenizer
    if args.recovered_merges:
        fast = _with_recovered_merges(fast)
    split = cuttable_split(fast)
    bpe = AsciiBPE.of(fast, split) if split is not None else None
    if bpe is None:
        parser.error(f"--tokenizer: {args.tokenizer} gets no ASCII fast path")
    assert bpe is not None
    added = [t.content for t in tok.added_tokens_decoder.values()]
    stats: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    start = time.monotonic()
    for path in sorted(Path(args.root).rglob("*")):
        if time.monotonic() - start > args.seconds:
            break
        if path.suffix not in EXTENSIONS or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not text.isascii() or any(a in text for a in added):
            continue
        t0 = time.perf_counter()
        fast_ids = bpe.encode(text)
        t1 = time.perf_counter()
        ids = fast.encode(text, add_special_tokens=False).ids
        t2 = time.perf_counter()
        row = stats[path.suffix]
        row["files"] += 1
        row["tokens"] += len(ids)
        row["differing_files"] += fast_ids != ids
        row["ascii_bpe_s"] += t1 - t0
        row["tokenizer_s"] += t2 - t1
    rows = [{"extension": ext, **{k: round(v, 3) if k.endswith("_s") else int(v)
                                  for k, v in row.items()}}
            for ext, row in sorted(stats.items())]
    writer = ResultWriter(args.out, "ascii-bpe-check", collect_environment("cpu"))
    writer.add_rows(rows)
    paths = writer.write(rows, title="tiktoken over the vocabulary's ranks against the "
                         "tokenizer, ASCII files",
                         notes=[f"tokenizer: {args.tokenizer}; corpus: {args.root}; each file "
                                "encoded whole by both (no added tokens in it)"])
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _with_recovered_merges(fast: Any) -> Any:
    """A copy of the ``tokenizers.Tokenizer`` ``fast`` with `recovered_merges`."""
    import json

    from tokenizers import Tokenizer

    from edmm.model.ascii_bpe import vocab_bytes
    from edmm.model.qwen_vocab import byte_level, recovered_merges

    spec = json.loads(fast.to_str())
    ranks = vocab_bytes(spec["model"]["vocab"])
    if ranks is None:
        raise SystemExit("--recovered-merges: the tokenizer's vocabulary is not byte-level")
    spec["model"]["merges"] = [[byte_level(a), byte_level(b)] for a, b in recovered_merges(ranks)]
    return Tokenizer.from_str(json.dumps(spec))


if __name__ == "__main__":
    raise SystemExit(main())
