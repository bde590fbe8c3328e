"""`SessionTag`: the agent's cache tags are values (compared and hashed by their fields), and
the agent finds its own tags by their type, never by parsing a string."""

from __future__ import annotations

import pytest
from agent_helpers import MakeAgent, greedy, run

from edmm.agent import AgentError, SessionTag, TagKind
from edmm.engine import SlotHints

PROMPT = list(range(1, 40))


def test_tags_are_values() -> None:
    assert SessionTag.session("s") == SessionTag("s", TagKind.SESSION)
    assert SessionTag.branch("s", "k") == SessionTag("s", TagKind.BRANCH, "k")
    assert hash(SessionTag.lost("s")) == hash(SessionTag("s", TagKind.LOST))
    tags = {SessionTag.session("s"), SessionTag.lost("s"), SessionTag.branch("s", "k"),
            SessionTag.branch("s", "j"), SessionTag.session("t")}
    assert len(tags) == 5
    assert SessionTag.session("s") != '["session", "s"]'  # no string stands for a tag


@pytest.mark.parametrize("kind, key", [(TagKind.BRANCH, ""), (TagKind.SESSION, "k"),
                                       (TagKind.LOST, "k")])
def test_only_a_branch_tag_has_a_key(kind: TagKind, key: str) -> None:
    with pytest.raises(ValueError, match="branch tag has a key"):
        SessionTag("s", kind, key)


def test_kv_of_no_session_is_found_by_the_type_of_its_tag(make_agent: MakeAgent) -> None:
    agent = make_agent()
    kv = agent.engine.kv
    agent.engine.add_request("ghost", PROMPT, greedy(2), SlotHints(SessionTag.session("ghost")))
    run(agent)
    assert kv.tagged(SessionTag.session("ghost"))
    with pytest.raises(AgentError, match="KV tagged for no session"):
        agent.check_integrity()
    assert kv.discard([SessionTag.session("ghost")]) == 1
    agent.check_integrity()
    # A string spelled like a session's tag is someone else's label, not the agent's.
    agent.engine.add_request("label", PROMPT, greedy(2), SlotHints('["session", "ghost"]'))
    run(agent)
    assert kv.tagged('["session", "ghost"]') and not kv.tagged(SessionTag.session("ghost"))
    agent.check_integrity()
