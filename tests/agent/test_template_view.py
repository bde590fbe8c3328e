"""Tool-call arguments reach a chat template as it needs them: as objects where it would
escape a string (Qwen2.5's ``arguments | tojson``), as sent where it prints strings verbatim;
either way the rendered history holds a call as the model wrote it."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from edmm.agent.render import arguments_as_objects, template_view


@pytest.fixture(scope="module")
def strict(tok: Any, tojson_template: str) -> Any:
    """``tok`` with Qwen2.5's way of printing a call's arguments (``| tojson`` only)."""
    other = copy.deepcopy(tok)
    other.chat_template = tojson_template
    return other


def _call(arguments: str) -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_dir)


def test_a_template_that_escapes_strings_gets_objects(tok: Any, strict: Any) -> None:
    assert arguments_as_objects(strict) and not arguments_as_objects(tok)
    sent = [{"role": "user", "content": "hi"}, _call('{"city": "Paris", "n": [1, 2]}')]
    assert template_view(strict, sent)[1]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Paris", "n": [1, 2]}
    assert template_view(tok, sent) == sent  # printed verbatim: left as sent
    assert sent[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris", "n": [1, 2]}'
    for kept in ("not json", "[1, 2]", '"a string"'):  # only a JSON object becomes one
        view = template_view(strict, [_call(kept)])
        assert view[0]["tool_calls"][0]["function"]["arguments"] == kept


@pytest.mark.parametrize("tojson_only", [False, True], ids=["verbatim", "tojson-only"])
def test_the_rendered_call_is_the_generated_text(tok: Any, strict: Any, tojson_only: bool,
                                                 ) -> None:
    """A call generated with tojson's separators (as the server's forced-call grammar emits
    it) renders back byte for byte, so the session's KV of the call is reused."""
    tk = strict if tojson_only else tok
    arguments = json.dumps({"city": "Paris", "unit": "celsius"})
    generated = '<tool_call>\n{"name": "f", "arguments": ' + arguments + "}\n</tool_call>"
    head = [{"role": "user", "content": "weather?"}]
    full = tk.apply_chat_template(template_view(tk, [*head, _call(arguments)]), tokenize=False)
    assert generated + "<|im_end|>" in full
    if tojson_only:  # what the template made of the string before
        escaped = tk.apply_chat_template([*head, _call(arguments)], tokenize=False)
        assert generated not in escaped and '"arguments": "{\\"city' in escaped
