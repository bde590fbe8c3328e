"""Incremental prompt encoding: always the tokenizer's own ids, with reuse where it applies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiers import examples
from transformers import AutoTokenizer

from edmm.model import prompt_encoder
from edmm.model.ascii_bpe import AsciiBPE
from edmm.model.errors import PromptTooLongError
from edmm.model.prompt_encoder import (
    LLAMA3_SPLIT,
    QWEN2_SPLIT,
    PromptEncoder,
    cut_points,
    cuttable,
    shared_prefix_len,
)

WORDS = ["agent", "tool", " memory", "result\n", "  page", "<tool_call>", "</tool_call>", "{",
         '"key": 1', "}", "<think>", "é", "数据", "\t", "", "<|im_end|>", "<|im_start|>"]


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_dir)


text_st = st.lists(st.sampled_from(WORDS), max_size=12).map(" ".join)
message_st = st.tuples(st.sampled_from(["user", "assistant", "tool", "system"]), text_st)


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                    HealthCheck.function_scoped_fixture])
@given(conversations=st.lists(st.lists(message_st, min_size=1, max_size=6), min_size=1,
                              max_size=6),
       edits=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30), text_st), max_size=6))
def test_ids_equal_the_tokenizer_s(tokenizer: Any, conversations: list[list[tuple[str, str]]],
                                   edits: list[tuple[int, int, str]]) -> None:
    """Growing conversations (an agent's turns), edits in earlier messages, unrelated ones."""
    encoder = PromptEncoder(tokenizer, capacity=4)
    assert encoder.incremental
    history: list[dict[str, str]] = []
    for k, turn in enumerate(conversations):
        history += [{"role": r, "content": c} for r, c in turn]
        if k < len(edits) and history:  # an earlier message changes (a mid-prompt insertion)
            i, _, extra = edits[k]
            msg = history[i % len(history)]
            history[i % len(history)] = {**msg, "content": msg["content"] + extra}
        text = tokenizer.apply_chat_template(history, tokenize=False,
                                             add_generation_prompt=True)
        assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False)


def test_a_growing_conversation_reuses_its_prefix(tokenizer: Any) -> None:
    encoder = PromptEncoder(tokenizer)
    history = [{"role": "system", "content": "You are helpful."},
               {"role": "user", "content": "agent tool memory " * 300}]
    first = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    n = len(encoder.encode(first))
    history += [{"role": "assistant", "content": "page cache"},
                {"role": "user", "content": "result " * 20}]
    second = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    ids = encoder.encode(second)
    assert ids == tokenizer.encode(second, add_special_tokens=False)
    assert n - 5 <= encoder.reused_tokens < n  # all but the generation prompt's tail
    assert encoder.encoded_tokens == n + len(ids) - encoder.reused_tokens


def test_tokens_that_strip_whitespace_turn_reuse_off(tiny_dir: Path, tmp_path: Path) -> None:
    from tokenizers import AddedToken

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    tok.add_tokens([AddedToken("<mem>", rstrip=True)])
    encoder = PromptEncoder(tok)
    assert not encoder.incremental
    text = "<|im_start|>user <mem>  x<|im_end|>"
    assert encoder.encode(text) == encoder.encode(text) == tok.encode(text,
                                                                      add_special_tokens=False)
    assert encoder.reused_tokens == 0


class _CountingTokenizer:
    """The tiny tokenizer, counting the characters its ``encode`` is given."""

    def __init__(self, tokenizer: Any) -> None:
        self._inner = tokenizer
        self.chars = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        self.chars += len(text)
        return list(self._inner.encode(text, **kwargs))


@pytest.mark.parametrize("incremental", [True, False], ids=["incremental", "whole"])
def test_a_prompt_far_over_the_limit_is_refused_early_and_not_kept(
        tokenizer: Any, incremental: bool) -> None:
    counting = _CountingTokenizer(tokenizer)
    encoder = PromptEncoder(counting)
    if not incremental:
        encoder._pattern = None  # as for a tokenizer whose added tokens strip whitespace
    huge = "<|im_start|>user\n" + "Paris is nice. " * 200_000 + "<|im_end|>\n"
    with pytest.raises(PromptTooLongError) as info:
        encoder.encode(huge, limit=1000)
    assert info.value.limit == 1000 and info.value.at_least > 1000
    assert counting.chars < len(huge) // 50  # only the first pieces were counted
    # Nothing of the refused prompt is kept: the same text again reuses nothing.
    ids = encoder.encode(huge[:20_000])
    assert ids == tokenizer.encode(huge[:20_000], add_special_tokens=False)
    assert encoder.reused_tokens == 0


def test_a_prompt_within_the_limit_is_encoded_exactly(tokenizer: Any) -> None:
    encoder = PromptEncoder(tokenizer)
    text = "<|im_start|>user\n" + "a b " * 300 + "<|im_end|>\n"
    want = tokenizer.encode(text, add_special_tokens=False)
    assert encoder.encode(text, limit=len(want)) == want
    with pytest.raises(PromptTooLongError) as info:  # just over: the exact count says so
        encoder.encode(text + "<|im_start|>", limit=len(want))
    assert info.value.at_least == len(want) + 1


def test_the_piecewise_count_never_refuses_a_prompt_that_fits(
        tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Counted in pieces (every text is, with one character per token allowed), a text is
    refused only past the limit: whitespace runs, a word cut between pieces, added tokens."""
    monkeypatch.setattr(prompt_encoder, "EXACT_CHARS_PER_TOKEN", 1)
    encoder = PromptEncoder(tokenizer)
    for text in (" " * 100_000, "a" * 100_000, "<|im_end|>x" * 5_000,
                 "memory agent, 数据 é " * 5_000):
        want = tokenizer.encode(text, add_special_tokens=False)
        assert encoder.encode(text, limit=len(want)) == want
        with pytest.raises(PromptTooLongError):
            encoder.encode(text + "!", limit=len(want) // 2)


@given(a=st.text("ab\u00e9\u4e16", max_size=40), b=st.text("ab\u00e9\u4e16", max_size=40))
def test_shared_prefix_len(a: str, b: str) -> None:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    assert shared_prefix_len(a, b) == n == shared_prefix_len(b, a)
    assert shared_prefix_len(a, a + b) == len(a)


def test_encode_array_is_the_callers_copy(tokenizer: Any) -> None:
    encoder = PromptEncoder(tokenizer)
    text = "<|im_start|>user\nagent tool<|im_end|>\n"
    ids = encoder.encode_array(text)
    assert ids.typecode == "q" and ids.tolist() == tokenizer.encode(text,
                                                                     add_special_tokens=False)
    ids[0] = -1  # the encoder's own copy is untouched
    assert encoder.encode(text + "<|im_start|>") == tokenizer.encode(
        text + "<|im_start|>", add_special_tokens=False)


def test_encode_ids_shares_the_prefix_ints_and_is_the_callers_copy(tokenizer: Any) -> None:
    """`encode_ids`: the list and its packed twin hold the tokenizer's ids; a later prompt's
    list takes the shared prefix's int objects from the earlier one (no int made per token);
    changing the returned list or array leaves the encoder's own untouched."""
    encoder = PromptEncoder(tokenizer)
    first = "<|im_start|>user\n" + "agent tool memory " * 50 + "<|im_end|>\n"
    a = encoder.encode_ids(first)
    assert list(a) == a.packed.tolist() == tokenizer.encode(first, add_special_tokens=False)
    second = first + "<|im_start|>assistant\nresult page 123456<|im_end|>\n"
    b = encoder.encode_ids(second)
    assert list(b) == b.packed.tolist() == tokenizer.encode(second, add_special_tokens=False)
    big = [i for i, t in enumerate(a) if t > 256]  # not CPython's small-int cache
    assert big and all(b[i] is a[i] for i in big)
    a[0], a.packed[0] = -1, -1
    again = encoder.encode_ids(first)
    assert list(again) == again.packed.tolist() == tokenizer.encode(first,
                                                                    add_special_tokens=False)


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                    HealthCheck.function_scoped_fixture])
@given(base=st.lists(message_st, min_size=1, max_size=4),
       branches=st.lists(st.tuples(st.integers(0, 400), text_st), min_size=1, max_size=8))
def test_skipped_prompts_never_offered_a_later_cut(
        tokenizer: Any, base: list[tuple[str, str]], branches: list[tuple[int, str]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Many recent prompts sharing a prefix (sessions of one conversation, each with its own
    result): the prompts `_longest_prefix` skips without comparing would have given no later
    cut: the reuse equals that of comparing every prompt, and the ids the tokenizer's."""
    history = [{"role": r, "content": c} for r, c in base]
    head = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    texts = [head[:cut % (len(head) + 1)] + extra + head[cut % (len(head) + 1):]
             for cut, extra in branches]
    fast, full = PromptEncoder(tokenizer), PromptEncoder(tokenizer)
    monkeypatch.setattr(full, "_no_longer", lambda other, text, shared: False)
    for text in [head, *texts, head, *reversed(texts)]:
        want = tokenizer.encode(text, add_special_tokens=False)
        assert fast.encode(text) == want == full.encode(text)
        assert fast.reused_tokens == full.reused_tokens


def test_a_prompt_seen_before_is_not_encoded_again(tokenizer: Any) -> None:
    """The same text again (a resume that is the predicted prompt, a client's retry) takes
    the kept ids as they are: the tokenizer is not called, the ids are still the caller's own
    copy, and the limit still holds."""
    encoder = PromptEncoder(tokenizer)
    text = "<|im_start|>user\n" + "agent tool memory " * 50 + "<|im_end|>\n"
    other = "<|im_start|>system\nsomething else<|im_end|>\n"
    want = tokenizer.encode(text, add_special_tokens=False)
    first = encoder.encode_ids(text)
    encoder.encode_ids(other)

    class NoEncode:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"the tokenizer was called ({name})")

    encoder._fast = NoEncode()
    encoder._tokenizer = NoEncode()
    first[0], first.packed[0] = -1, -1
    again = encoder.encode_ids(text)
    assert list(again) == again.packed.tolist() == want
    assert again is not first and encoder.reused_tokens >= len(want)
    with pytest.raises(PromptTooLongError):
        encoder.encode_ids(text, limit=len(want) - 1)


# Text around the places `cut_points` cuts at (a space between ASCII letters) and those it
# must not: contractions, digits (Llama 3 groups three), non-ASCII letters, combining marks,
# runs of whitespace, an added token.
CUT_PIECES = ["a", "Zy", " ", "  ", " b", "'s", "'re", "'LL", "e", "\u0301", "\u00e9", "数据",
              "\n", " \n", "1", "2345", ",", "!?", "\t", "<|im_end|>", "x y"]


def _llama3_style_tokenizer(tmp_path: Path) -> Any:
    """A small byte-level BPE trained with Llama 3's pre-tokenizer pattern."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["a cut between letters, it's 12345 words: Zy b x y"] * 20,
                            trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="module")
def llama3_style(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return _llama3_style_tokenizer(tmp_path_factory.mktemp("llama3"))


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                    HealthCheck.function_scoped_fixture])
@given(text=st.lists(st.sampled_from(CUT_PIECES), max_size=60).map("".join),
       every=st.integers(1, 8), which=st.sampled_from(["qwen2", "llama3"]))
def test_text_cut_between_letters_encodes_as_a_whole(
        tokenizer: Any, llama3_style: Any, text: str, every: int, which: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under both patterns of `CUTTABLE_SPLITS`, text cut wherever `cut_points` allows
    (pieces of a few characters) encodes to the whole text's ids."""
    tok = tokenizer if which == "qwen2" else llama3_style
    monkeypatch.setattr(prompt_encoder, "CUT_CHARS", every)
    encoder = PromptEncoder(tok)
    assert encoder._cut
    assert encoder.encode(text) == tok.encode(text, add_special_tokens=False)


def test_a_long_piece_is_encoded_in_cut_pieces(tokenizer: Any,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A tool result of ~3,000 characters between two added tokens goes to the tokenizer as
    pieces of about `CUT_CHARS` (each cut at a space between letters), not as one."""
    encoder = PromptEncoder(tokenizer)
    batches: list[list[str]] = []
    inner = encoder._encode_pieces
    monkeypatch.setattr(encoder, "_encode_pieces",
                        lambda pieces, added: batches.append(pieces) or inner(pieces, added))
    text = "<|im_start|>user\n" + "agent tool memory page " * 130 + "<|im_end|>\n"
    assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False)
    pieces = batches[0]
    long = [p for p in pieces if len(p) > 20]
    assert len(long) >= len(text) // prompt_encoder.CUT_CHARS - 1
    assert all(len(p) <= prompt_encoder.CUT_CHARS + 10 for p in long)
    assert all(p.startswith(" ") and p[1].isalpha() for p in long[1:])


def test_cut_points_lie_between_ascii_letters() -> None:
    text = "ab cd  ef,  gh é i 数 据 jk lm"
    cuts = cut_points(text, 0, len(text), 1)
    assert cuts == [2, 25]  # "ab| cd", "jk| lm": not before two spaces, a comma, "é" or "据"
    assert cut_points(text, 0, len(text), 100) == []
    assert cut_points(text, 3, 10, 1) == []  # only within [start, end)


def test_other_pipelines_are_not_cut(tiny_dir: Path) -> None:
    """A pre-tokenizer, normaliser or model other than those `cuttable` reasons about is
    encoded piece by piece at added tokens only."""
    from tokenizers import normalizers, pre_tokenizers

    fast = AutoTokenizer.from_pretrained(tiny_dir)._tokenizer
    assert cuttable(fast)
    changes = [
        ("normalizer", normalizers.NFKC()),
        ("normalizer", normalizers.Lowercase()),
        ("pre_tokenizer", pre_tokenizers.ByteLevel(add_prefix_space=False)),  # GPT-2's regex
        ("pre_tokenizer", pre_tokenizers.Sequence([
            pre_tokenizers.Split(" ", behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])),
        ("pre_tokenizer", pre_tokenizers.Metaspace()),
    ]
    for attr, value in changes:
        tok = AutoTokenizer.from_pretrained(tiny_dir)._tokenizer
        setattr(tok, attr, value)
        assert not cuttable(tok), (attr, value)
    level = AutoTokenizer.from_pretrained(tiny_dir)._tokenizer
    steps = level.pre_tokenizer
    level.pre_tokenizer = pre_tokenizers.Sequence([
        steps[0], pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=False)])
    assert not cuttable(level)
    assert not cuttable(object())


def test_a_hint_reuses_a_prefix_that_left_the_recent_prompts(tokenizer: Any) -> None:
    """`encode_text`'s handle, passed back as ``hint``, gives its ids to a text extending it
    after the recent prompts dropped it; ``keep=False`` keeps a text out of them."""
    encoder = PromptEncoder(tokenizer, capacity=2)
    base = "<|im_start|>user\n" + "many words here " * 200 + "<|im_end|>\n"
    _, handle = encoder.encode_text(base, keep=False)
    assert handle is not None
    for i in range(3):
        encoder.encode_ids(f"<|im_start|>user\nother {i}<|im_end|>\n")
    text = base + "<|im_start|>assistant\nmore words"
    reused = encoder.reused_tokens
    ids, _ = encoder.encode_text(text, hint=handle)
    assert list(ids) == tokenizer.encode(text, add_special_tokens=False)
    # Up to its last added token (the text after it is encoded again): without the hint,
    # nothing (the two recent prompts share nothing with it).
    assert encoder.reused_tokens - reused >= len(handle.ids) - 2
    reused = encoder.reused_tokens
    encoder.encode_ids(text + " and more")  # ``text`` was kept: its ids are reused
    assert encoder.reused_tokens - reused >= len(handle.ids)


def test_ascii_pieces_skip_the_tokenizer(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the fast path, only non-ASCII pieces reach the tokenizer's batch; the ids are
    the tokenizer's all the same."""
    encoder = PromptEncoder(tokenizer)
    assert encoder._ascii is not None
    batches: list[list[str]] = []
    inner = encoder._encode_batch
    monkeypatch.setattr(encoder, "_encode_batch",
                        lambda pieces: batches.append(pieces) or inner(pieces))
    text = "<|im_start|>tool\nagent tool 12 memory\n<|im_end|>\n数据 page<|im_end|>"
    assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False)
    assert batches == [["\n数据 page"]]  # an added token's piece is its id


def test_fast_bpe_off_or_refused(tokenizer: Any, tmp_path: Path) -> None:
    """``fast_bpe=False`` keeps every piece on the tokenizer; a vocabulary whose merges do not
    follow its ids (tiktoken's ranks) gets no fast path."""
    import json

    from tokenizers import Tokenizer

    off = PromptEncoder(tokenizer, fast_bpe=False)
    assert off._ascii is None and off.incremental
    text = "<|im_start|>tool\nagent tool 12\n<|im_end|>\n数据 page"
    assert off.encode(text) == tokenizer.encode(text, add_special_tokens=False)
    fast = tokenizer._tokenizer
    assert AsciiBPE.of(fast, QWEN2_SPLIT) is not None
    spec = json.loads(fast.to_str())
    spec["model"]["merges"] = spec["model"]["merges"][::-1]
    assert AsciiBPE.of(Tokenizer.from_str(json.dumps(spec)), QWEN2_SPLIT) is None


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                    HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=127), max_size=120),
       which=st.sampled_from(["qwen2", "llama3"]))
def test_ascii_bpe_equals_the_tokenizer(tokenizer: Any, llama3_style: Any, text: str,
                                        which: str) -> None:
    """tiktoken over the ranks gives the tokenizer's ids on any ASCII text, for the tiny
    model's vocabulary and one trained under Llama 3's pattern (merges as trained, one per
    token)."""
    tok = tokenizer if which == "qwen2" else llama3_style
    bpe = AsciiBPE.of(tok._tokenizer, QWEN2_SPLIT if which == "qwen2" else LLAMA3_SPLIT)
    assert bpe is not None
    for added in tok.added_tokens_decoder.values():
        text = text.replace(added.content, "")
    assert bpe.encode(text) == tok.encode(text, add_special_tokens=False)
