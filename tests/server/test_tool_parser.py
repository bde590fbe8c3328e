"""Hermes / Qwen ``<tool_call>`` parsing, whole and streamed."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

from edmm.server.tool_parser import StreamingToolParser, parse_reply, parse_tool_call

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, 2]}}\n' \
       '</tool_call>'
OTHER = '<tool_call>\n{"name": "calc", "arguments": {}}\n</tool_call>'


def test_plain_text_is_content() -> None:
    reply = parse_reply("Hello there.\n")
    assert reply.content == "Hello there.\n" and reply.tool_calls == []


def test_calls_keep_the_models_exact_argument_text() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"b":1,  "a": "x"}}\n' \
           '</tool_call>'
    reply = parse_reply(text)
    assert reply.content == "Let me check."  # the template's newline before the call dropped
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [("f", '{"b":1,  "a": "x"}')]


def test_parallel_calls_get_unique_ids() -> None:
    reply = parse_reply(CALL + "\n" + OTHER + "\n")
    assert reply.content is None
    assert [c.name for c in reply.tool_calls] == ["get_weather", "calc"]
    assert json.loads(reply.tool_calls[0].arguments) == {"city": "Paris", "n": [1, 2]}
    assert len({c.id for c in reply.tool_calls}) == 2


def test_other_key_order_and_parameters_alias() -> None:
    call = parse_tool_call(' {"arguments": {"x": 1}, "name": "f"} ')
    assert call is not None and (call.name, json.loads(call.arguments)) == ("f", {"x": 1})
    alias = parse_tool_call('{"name": "g", "parameters": {"y": 2}}')
    assert alias is not None and json.loads(alias.arguments) == {"y": 2}


@pytest.mark.parametrize("text", [
    pytest.param('<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>', id="bad-json"),
    pytest.param('<tool_call>\n{"arguments": {}}\n</tool_call>', id="no-name"),
    pytest.param('<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>', id="args-list"),
    pytest.param(CALL + " and then some text", id="text-after"),
])
def test_invalid_calls_leave_everything_as_content(text: str) -> None:
    reply = parse_reply(text)
    assert reply.content == text and reply.tool_calls == []


def _stream(text: str, step: int) -> tuple[str, list[tuple[str, str]]]:
    """Content and calls (name, arguments) reassembled from the fragments, OpenAI-style."""
    parser = StreamingToolParser()
    content, calls = "", []
    for end in range(step, len(text) + step, step):
        new, fragments = parser.feed(text[:end])
        content += new
        for f in fragments:
            if f.id is not None:
                assert f.index == len(calls) and f.arguments == "" and f.name
                calls.append([f.name, ""])
            else:
                assert f.index == len(calls) - 1 and f.arguments
                calls[-1][1] += f.arguments
    return content + parser.finish(text), [(n, a) for n, a in calls]


@pytest.mark.parametrize("step", [1, 2, 7, 1000])
@pytest.mark.parametrize("text", [
    "Just text, no tools.\n\nTwo lines.",
    "Text ending in a newline\n",
    "Thinking <tool_ about it",
    "Checking.\n" + CALL,
    CALL + "\n" + OTHER,
    CALL + "\n" + OTHER + "\n",
    "a\n<tool_call>\n{broken json}\n</tool_call>",
])
def test_streaming_matches_whole_parse(text: str, step: int) -> None:
    whole = parse_reply(text)
    content, calls = _stream(text, step)
    assert calls == [(c.name, c.arguments) for c in whole.tool_calls]
    assert (content or None) == whole.content


def test_streaming_never_sends_a_partial_tag_as_content() -> None:
    parser = StreamingToolParser()
    sent = ""
    text = "Sure.\n" + CALL
    for end in range(1, len(text) + 1):
        new, _ = parser.feed(text[:end])
        sent += new
        assert "<" not in sent and "\n" not in sent
    assert sent == "Sure." and len(parser.calls) == 1


def test_arguments_stream_as_they_are_written() -> None:
    """The name goes out with the head, then the argument text piece by piece, before the
    block closes (what OpenAI clients expect)."""
    parser = StreamingToolParser()
    text = "Sure.\n" + CALL
    head = text.index('{"city"')
    _, fragments = parser.feed(text[:head + 1])
    assert [(f.index, f.name, f.arguments) for f in fragments] == [
        (0, "get_weather", ""), (0, None, "{")]
    assert fragments[0].id is not None and fragments[1].id is None
    _, more = parser.feed(text[:head + 10])
    assert [f.arguments for f in more] == [text[head + 1:head + 10]]
    assert parser.calls == []  # not closed yet
    _, rest = parser.feed(text)
    assert "".join(f.arguments for f in [*fragments, *more, *rest]) == parser.calls[0].arguments
    assert parser.calls[0].id == fragments[0].id


@pytest.mark.parametrize("text, content, calls", [
    pytest.param(CALL + '\n<tool_call>\n{"name": "f"', None,
                 [("get_weather", '{"city": "Paris", "n": [1, 2]}')], id="cut-in-head"),
    pytest.param('Hm.\n<tool_call>\n{"name": "f", "arguments": {"a": [1, "x}', "Hm.",
                 [("f", '{"a": [1, "x}')], id="cut-in-arguments"),
    pytest.param('<tool_call>{"name": "f", "arguments": {}}', None, [("f", "{}")],
                 id="cut-before-end-tag"),
    pytest.param("<tool_call>\n{", None, [], id="cut-after-tag"),
])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_cut_reply_is_the_same_streamed_and_not(text: str, content: str | None,
                                                  calls: list[tuple[str, str]],
                                                  step: int) -> None:
    """A reply ending inside a block (max_tokens): complete calls plus the open one with the
    arguments written so far, no markup in the content; the same streamed."""
    whole = parse_reply(text)
    assert whole.cut and whole.content == content
    assert [(c.name, c.arguments) for c in whole.tool_calls] == calls
    streamed_content, streamed_calls = _stream(text, step)
    assert (streamed_content or None) == content and streamed_calls == calls


_KEYS = st.sampled_from(["city", "n", "q", "x y", 'k"'])
_JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-99, 999),
                               st.text("ab {}[]\",:\\}\n", max_size=6)),
                     lambda inner: st.one_of(st.lists(inner, max_size=3),
                                             st.dictionaries(_KEYS, inner, max_size=3)),
                     max_leaves=6)


@st.composite
def _replies(draw: st.DrawFn) -> str:
    """Optional content, then 0-3 calls with JSON arguments (compact or spaced), possibly cut
    anywhere after the first call started."""
    content = draw(st.sampled_from(["", "Let me look.", "a\nb", "x <tool_ y"]))
    blocks = []
    for _ in range(draw(st.integers(0, 3))):
        args = draw(st.dictionaries(_KEYS, _JSON, max_size=3))
        sep = draw(st.sampled_from([(", ", ": "), (",", ":")]))
        name = draw(st.sampled_from(["f", "get_weather", "run"]))
        blocks.append(f'<tool_call>\n{{"name": "{name}", "arguments": '
                      f"{json.dumps(args, separators=sep)}}}\n</tool_call>")
    text = (content + "\n" if content and blocks else content) + "\n".join(blocks)
    if blocks and draw(st.booleans()):
        start = text.index("<tool_call>")
        text = text[:draw(st.integers(start + 1, len(text)))]
    return text


@settings(max_examples=examples(300), deadline=None)
@given(text=_replies(), step=st.integers(1, 40))
def test_streamed_fragments_reassemble_to_the_whole_parse(text: str, step: int) -> None:
    whole = parse_reply(text)
    content, calls = _stream(text, step)
    assert calls == [(c.name, c.arguments) for c in whole.tool_calls]
    assert (content or None) == (whole.content or None)
    for c in whole.tool_calls if not whole.cut else []:
        assert isinstance(json.loads(c.arguments), dict)
