"""The embedded tool model's training corpus: seeded, and rendered as the server renders
requests, with the loss on the assistant's replies only."""

from __future__ import annotations

from edmm.model import load_tokenizer
from edmm.model.tiny import default_model
from training.tool_corpus import conversation
from training.train_tool_model import IGNORE, completion_text, render_example


def test_corpus_is_deterministic_and_labels_only_replies() -> None:
    assert conversation(7) == conversation(7)
    assert conversation(7) != conversation(8)
    tok = load_tokenizer(default_model())
    for i in range(20):
        tools, messages = conversation(i)
        ids, labels = render_example(tok, tools, messages)
        target = tok.decode([t for t, y in zip(ids, labels, strict=True) if y != IGNORE])
        replies = "".join(completion_text(m) for m in messages if m["role"] == "assistant")
        assert target == replies
        assert tok.decode(ids).endswith(replies[-len(completion_text(messages[-1])):])
