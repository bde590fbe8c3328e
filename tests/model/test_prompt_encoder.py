"""Incremental prompt encoding: always the tokenizer's own ids, with reuse where it applies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from edmm.model.prompt_encoder import PromptEncoder

WORDS = ["agent", "tool", " memory", "result\n", "  page", "<tool_call>", "</tool_call>", "{",
         '"key": 1', "}", "<think>", "é", "数据", "\t", "", "<|im_end|>", "<|im_start|>"]


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_dir)


text_st = st.lists(st.sampled_from(WORDS), max_size=12).map(" ".join)
message_st = st.tuples(st.sampled_from(["user", "assistant", "tool", "system"]), text_st)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
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
