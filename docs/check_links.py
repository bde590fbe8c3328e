"""Check that the Markdown links of the docs resolve inside the repository.

``python docs/check_links.py`` (from the repository root) reads README.md, docs/*.md,
benchmarks/README.md and every results folder's README, and reports each relative link
``[text](path#anchor)`` whose file is not in the tree or whose anchor is no heading of that
file, and each code span naming a ``benchmarks/results/...`` path that does not exist (in the
top README, docs/ and the results index only: results READMEs name folders removed from the
tree on purpose). Exit status 1 if anything is broken.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_PATH = re.compile(r"`(benchmarks/results/[^`\s]*)`")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} +(.+)$", text, re.M)}


def check(md: Path, code_paths: bool) -> list[str]:
    text = FENCE.sub("", md.read_text(encoding="utf-8"))
    errors = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http:, mailto:
        file, _, anchor = target.partition("#")
        dest = (md.parent / file).resolve() if file else md
        if not dest.exists():
            errors.append(f"{md.relative_to(ROOT)}: no file {target}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            errors.append(f"{md.relative_to(ROOT)}: no heading #{anchor} in {file or md.name}")
    if code_paths:
        for path in CODE_PATH.findall(text):
            if not (ROOT / path).exists():
                errors.append(f"{md.relative_to(ROOT)}: no path {path}")
    return errors


def main() -> int:
    tops = [ROOT / "README.md", ROOT / "benchmarks/README.md",
            *sorted((ROOT / "docs").glob("*.md"))]
    results = sorted((ROOT / "benchmarks/results").glob("*/README.md"))
    errors = [e for md in tops for e in check(md, True)]
    errors += [e for md in results for e in check(md, False)]
    for e in errors:
        print(e)
    print(f"{len(tops) + len(results)} files checked, {len(errors)} broken")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
