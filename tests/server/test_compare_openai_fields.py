"""``benchmarks/scripts/compare_openai_fields.py``: the reply shapes it compares, and a run
against the live server (both sides the same server here; the lead runs vLLM against EDMM)."""

from __future__ import annotations

from pathlib import Path

import pytest
from server_helpers import MODEL, LiveServer

from benchmarks.scripts.compare_openai_fields import CASES, compare, main, shape


def test_shape_keeps_types_and_enumerations() -> None:
    reply = {"object": "chat.completion", "choices": [
        {"index": 0, "finish_reason": "stop", "message": {"content": "hi", "role": "assistant"}},
        {"index": 1, "finish_reason": "length", "message": {"content": None}}]}
    assert set(shape(reply)) == {
        "object = 'chat.completion'", "choices[].index: number",
        "choices[].finish_reason = 'stop'", "choices[].finish_reason = 'length'",
        "choices[].message.content: str", "choices[].message.content: null",
        "choices[].message.role = 'assistant'"}
    same = compare((200, {"a": 1}), (200, {"a": 2}), "c")
    assert same is None
    differs = compare((200, {"a": 1, "tool_calls": []}), (400, {"a": 1}), "c")
    assert differs is not None and differs.status == (200, 400)
    assert differs.only_a == ["tool_calls: []"] and differs.only_b == []


@pytest.mark.slow  # a server, subprocess or seconds of waiting: the thorough tier
def test_a_run_against_the_server(server: LiveServer, tmp_path: Path) -> None:
    out = tmp_path / "compare.md"
    assert main(["--a", server.url, "--a-model", MODEL, "--b", server.url, "--b-model", MODEL,
                 "--out", str(out)]) == 0
    text = out.read_text()
    assert text.splitlines()[0].endswith(f"of {len(CASES)} cases: same status and shape.")
    # the same server: statuses agree in every case (the text-dependent shapes may not)
    rows = [ln.split(" | ") for ln in text.splitlines()[4:]]
    assert all(row[1] == row[2] for row in rows), text
