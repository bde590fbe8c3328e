"""`EngineLoop` on a fake engine: outputs, aborts, calls, failing steps, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from edmm.engine import CompletionOutput, RequestOutput
from edmm.server.engine_loop import EngineLoop, Submission
from edmm.server.errors import EngineStepError, ServiceUnavailableError


class FakeEngine:
    """Each queued request gets one token per step, and finishes after ``length`` tokens."""

    def __init__(self, length: int = 3) -> None:
        self.length = length
        self.requests: dict[str, int] = {}
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.fail_next = False
        self.reclaims = 0
        self.timers: list[float] = []  # monotonic times at which `tick` has work
        self.ticked: list[float] = []  # when `tick` found a timer due
        self.gate = threading.Event()
        self.gate.set()

    def add(self, request_id: str) -> None:
        if request_id in self.requests:
            raise ValueError(f"duplicate {request_id}")
        self.requests[request_id] = 0
        self.added.append(request_id)

    def step(self) -> list[RequestOutput]:
        if not self.gate.is_set():  # paused: no progress
            time.sleep(0.001)
            return []
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("boom")
        outs = []
        for rid in list(self.requests):
            self.requests[rid] += 1
            n = self.requests[rid]
            done = n >= self.length
            if done:
                del self.requests[rid]
            outs.append(RequestOutput(rid, None, [1], [CompletionOutput(
                0, "x" * n, [7] * n, "length" if done else None)], done, 0))
        return outs

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return self.requests.pop(request_id, None) is not None

    def reclaim(self) -> int:
        self.reclaims += 1
        return 0

    def tick(self) -> int:
        now = time.monotonic()
        due = [t for t in self.timers if t <= now]
        self.timers = [t for t in self.timers if t > now]
        self.ticked += [now] * len(due)
        return len(due)

    def next_timer_s(self) -> float | None:
        return max(0.0, min(self.timers) - time.monotonic()) if self.timers else None


@pytest.fixture
def loop() -> Iterator[EngineLoop[FakeEngine]]:
    lp = EngineLoop(FakeEngine())
    lp.start()
    yield lp
    lp.stop()


async def _collect(lp: EngineLoop[FakeEngine], rid: str) -> list[str]:
    _, stream = await lp.submit(rid, lambda e: e.add(rid))
    return [out.outputs[0].text async for out in stream.outputs()]


def test_outputs_stream_until_finished(loop: EngineLoop[FakeEngine]) -> None:
    async def main() -> list[list[str]]:
        return list(await asyncio.gather(*(_collect(loop, f"r{i}") for i in range(3))))

    assert asyncio.run(main()) == [["x", "xx", "xxx"]] * 3


def test_submit_error_is_raised_and_nothing_queued(loop: EngineLoop[FakeEngine]) -> None:
    async def main() -> None:
        loop.engine.gate.clear()
        _, stream = await loop.submit("dup", lambda e: e.add("dup"))
        with pytest.raises(ValueError, match="duplicate"):
            await loop.submit("dup", lambda e: e.add("dup"))
        loop.engine.gate.set()
        assert [o.outputs[0].text async for o in stream.outputs()] == ["x", "xx", "xxx"]

    asyncio.run(main())


def test_leaving_early_aborts(loop: EngineLoop[FakeEngine]) -> None:
    loop.engine.length = 1000

    async def main() -> None:
        _, stream = await loop.submit("long", lambda e: e.add("long"))
        async with contextlib.aclosing(stream.outputs()) as outputs:
            async for _ in outputs:
                break  # the consumer leaves after one output
        assert stream.aborted
        await loop.run(lambda e: None)  # the abort command ran before this one

    asyncio.run(main())
    assert loop.engine.aborted == ["long"]
    assert not loop.call(lambda e: e.has_unfinished()).result(5)


def test_failing_step_fails_requests_and_loop_survives(loop: EngineLoop[FakeEngine]) -> None:
    async def main() -> None:
        loop.engine.gate.clear()
        _, stream = await loop.submit("a", lambda e: e.add("a"))
        loop.engine.fail_next = True
        loop.engine.gate.set()
        with pytest.raises(EngineStepError, match="boom"):
            async for _ in stream.outputs():
                pass
        assert await _collect(loop, "b") == ["x", "xx", "xxx"]

    asyncio.run(main())
    assert loop.engine.aborted == ["a"] and loop.is_alive


def test_stop_fails_pending_and_refuses_new_work() -> None:
    lp = EngineLoop(FakeEngine(length=10**6))
    lp.start()

    async def main() -> None:
        _, stream = await lp.submit("a", lambda e: e.add("a"))
        lp.stop()
        with pytest.raises(ServiceUnavailableError):
            async for _ in stream.outputs():
                pass
        with pytest.raises(ServiceUnavailableError):
            await lp.submit("b", lambda e: e.add("b"))

    asyncio.run(main())
    assert not lp.is_alive


def test_idle_loop_reclaims_after_the_last_request(loop: EngineLoop[FakeEngine]) -> None:
    before = loop.call(lambda e: e.reclaims).result(5)
    assert asyncio.run(_collect(loop, "a")) == ["x", "xx", "xxx"]
    # the loop reclaimed once the request finished, before it slept on its queue
    assert loop.call(lambda e: e.reclaims).result(5) > before


def test_idle_hook_runs_when_the_loop_goes_idle_not_between_steps() -> None:
    """``on_idle`` runs on the engine thread each time the loop is about to sleep (after the
    last request), never while a request still needs steps."""
    engine = FakeEngine(length=5)
    seen: list[tuple[str, bool]] = []
    lp = EngineLoop(engine, on_idle=lambda: seen.append(
        (threading.current_thread().name, engine.has_unfinished())))
    lp.start()
    try:
        assert asyncio.run(_collect(lp, "a")) == ["x", "xx", "xxx", "xxxx", "xxxxx"]
        n = len(seen)
        lp.call(lambda e: None).result(5)  # a command while idle: idle again after it
        deadline = time.monotonic() + 5
        while len(seen) == n and time.monotonic() < deadline:
            time.sleep(0.001)
    finally:
        lp.stop()
    assert len(seen) > n >= 1
    assert all(name == "edmm-engine" and not busy for name, busy in seen)


def test_failing_idle_hook_is_logged_and_the_loop_serves_on() -> None:
    def fail() -> None:
        raise RuntimeError("hook")

    lp = EngineLoop(FakeEngine(), on_idle=fail)
    lp.start()
    try:
        assert asyncio.run(_collect(lp, "a")) == ["x", "xx", "xxx"]
        assert asyncio.run(_collect(lp, "b")) == ["x", "xx", "xxx"]
        assert lp.is_alive
    finally:
        lp.stop()


def test_engine_times_of_the_first_step_and_output(loop: EngineLoop[FakeEngine]) -> None:
    """`OutputStream.engine_ns`: the first step after the submission began after it, the
    first output was handed over after that step began and before the loop read it."""
    async def main() -> None:
        before = time.time_ns()
        _, stream = await loop.submit("t", lambda e: e.add("t"))
        outputs = stream.outputs()
        await outputs.__anext__()
        read = time.time_ns()
        step, put = stream.engine_ns
        assert step is not None and put is not None
        assert before <= step <= put <= read
        async for _ in outputs:
            pass
        assert stream.engine_ns == (step, put)  # the first ones, kept

    asyncio.run(main())


def _until(condition: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_submission_sent_from_another_thread(loop: EngineLoop[FakeEngine]) -> None:
    """`Submission`: made on the event loop, sent from another thread, awaited there."""
    async def main() -> list[str]:
        submission: Submission[FakeEngine, None] = Submission(loop, "s")
        sender = threading.Thread(target=submission.send, args=(lambda e: e.add("s"),))
        sender.start()
        sender.join()
        _, stream = await submission.result()
        return [out.outputs[0].text async for out in stream.outputs()]

    assert asyncio.run(main()) == ["x", "xx", "xxx"]


def test_cancelled_submission_queues_nothing_or_aborts(loop: EngineLoop[FakeEngine]) -> None:
    """Cancelled before it is sent: the engine never sees it; after it was queued: it is
    aborted."""
    async def main() -> None:
        early: Submission[FakeEngine, None] = Submission(loop, "early")
        early.cancel()
        early.send(lambda e: e.add("early"))
        late: Submission[FakeEngine, None] = Submission(loop, "late")
        loop.engine.gate.clear()  # no progress: "late" stays unfinished
        late.send(lambda e: e.add("late"))
        await asyncio.to_thread(_until, lambda: "late" in loop.engine.requests)
        late.cancel()
        await asyncio.to_thread(_until, lambda: "late" in loop.engine.aborted)
        loop.engine.gate.set()

    asyncio.run(main())
    assert loop.engine.added == ["late"] and loop.engine.aborted == ["late"]


def test_failed_submission_is_not_aborted(loop: EngineLoop[FakeEngine]) -> None:
    """A submission whose ``submit`` failed queued nothing: cancelling it aborts nothing."""
    async def main() -> None:
        loop.engine.gate.clear()  # "taken" stays unfinished
        _, stream = await loop.submit("taken", lambda e: e.add("taken"))
        again: Submission[FakeEngine, None] = Submission(loop, "taken")
        again.send(lambda e: e.add("taken"))
        with pytest.raises(ValueError, match="duplicate"):
            await again.result()
        again.cancel()
        await asyncio.sleep(0.05)  # an abort, had one been sent, would have run by now
        assert loop.engine.aborted == []
        loop.engine.gate.set()
        texts = [o.outputs[0].text async for o in stream.outputs()]
        assert texts == ["x", "xx", "xxx"]

    asyncio.run(main())
    assert loop.engine.aborted == []


class _TimedEngine(FakeEngine):
    """`FakeEngine` that records when each step began."""

    def __init__(self) -> None:
        super().__init__()
        self.step_ns: list[int] = []

    def step(self) -> list[RequestOutput]:
        self.step_ns.append(time.time_ns())
        return super().step()


def test_the_step_after_a_first_output_waits_until_it_is_taken() -> None:
    """The engine thread steps on only once the consumer dealt with the first output and
    asked for the next (the GIL left to the event loop meanwhile); later outputs are not
    waited for."""
    engine = _TimedEngine()
    lp = EngineLoop(engine, handback_wait_s=30.0)
    lp.start()

    async def main() -> int:
        _, stream = await lp.submit("h", lambda e: e.add("h"))
        outputs = stream.outputs()
        await outputs.__anext__()
        await asyncio.sleep(0.05)  # the consumer is busy: the engine must not step
        back = time.time_ns()
        async for _ in outputs:
            pass
        return back

    try:
        back = asyncio.run(main())
    finally:
        lp.stop()
    assert len(engine.step_ns) == 3 and engine.step_ns[1] >= back


def test_a_consumer_that_does_not_come_back_holds_the_engine_at_most_the_bound() -> None:
    """``handback_wait_s`` bounds the wait: the request runs to its end while its consumer
    sleeps on its first output."""
    engine = _TimedEngine()
    lp = EngineLoop(engine, handback_wait_s=0.02)
    lp.start()

    async def main() -> None:
        _, stream = await lp.submit("s", lambda e: e.add("s"))
        outputs = stream.outputs()
        await outputs.__anext__()
        await asyncio.to_thread(_until, lambda: not engine.requests)
        async for _ in outputs:
            pass

    try:
        asyncio.run(main())
    finally:
        lp.stop()
    gap = (engine.step_ns[1] - engine.step_ns[0]) / 1e9
    assert len(engine.step_ns) == 3 and gap >= 0.02


def test_timers_run_on_an_idle_loop_when_they_are_due() -> None:
    """No request, no command: the loop wakes for the engine's next timer by itself (a tool
    deadline on an idle server), within a few milliseconds of it."""
    engine = FakeEngine()
    lp = EngineLoop(engine)
    lp.start()
    try:
        start = time.monotonic()
        lp.call(lambda e: e.timers.extend([start + 0.2, start + 0.4])).result(5)
        time.sleep(0.6)
        assert len(engine.ticked) == 2
        for due, ran in zip([start + 0.2, start + 0.4], engine.ticked, strict=True):
            assert due <= ran < due + 0.1
        assert engine.reclaims >= 2  # what the timers freed is reclaimed right after
    finally:
        lp.stop()
