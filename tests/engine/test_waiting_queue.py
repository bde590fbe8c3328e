"""`WaitingQueue` against a plain-Python model: admission order is (priority, arrival)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

from edmm.engine import InvalidRequestError, SamplingParams, Sequence
from edmm.engine.engine import Request
from edmm.engine.scheduler import WaitingQueue

OPS = st.lists(st.tuples(st.sampled_from(["push", "pop", "remove", "requeue"]),
                         st.integers(-2, 2), st.integers(0, 30)), max_size=60)


@settings(max_examples=examples(200), deadline=None)
@given(OPS)
def test_waiting_queue_matches_a_sorted_list(ops: list[tuple[str, int, int]]) -> None:
    queue, model = WaitingQueue(), []  # model: (priority, arrival, seq), sorted on demand
    popped: list[Sequence] = []  # sequences taken out by pop (running): may be requeued
    arrivals = iter(range(10**6))
    for op, priority, pick in ops:
        if op == "push":
            seq = Sequence.new(f"r{len(model)}-{priority}", [1], SamplingParams(),
                               priority=priority)
            seq.arrival = next(arrivals)
            queue.push(seq)
            model.append(seq)
        elif op == "pop" and model:
            want = min(model, key=lambda s: (s.priority, s.arrival))
            assert queue.pop() is want
            model.remove(want)
            popped.append(want)
        elif op == "remove" and model:
            seq = model.pop(pick % len(model))
            queue.remove(seq)
        elif op == "requeue" and popped:  # a preempted sequence goes back under its arrival
            seq = popped.pop(pick % len(popped))
            queue.push(seq)
            model.append(seq)
        assert list(queue) == sorted(model, key=lambda s: (s.priority, s.arrival))
        assert len(queue) == len(model) and bool(queue) == bool(model)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_request_priority_must_be_finite(bad: float) -> None:
    with pytest.raises(InvalidRequestError, match="priority"):
        Request("r", None, [1], SamplingParams(), priority=bad)
    assert Request("r", None, [1], SamplingParams(), priority=-3.5).priority == -3.5
