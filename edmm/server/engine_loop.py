"""One engine thread behind the asyncio server.

The engine is not thread-safe, so exactly one thread touches it: `EngineLoop` runs that thread.
It executes commands (submit, abort, any call into the engine) between steps, steps while any
request is unfinished, and sleeps on its command queue when idle, at most until the engine's
next timer (`SteppableEngine.next_timer_s`: a tool deadline), which it then runs
(`SteppableEngine.tick`) without waiting for a request. Before it sleeps it runs the timers
due and lets the engine reclaim memory (`SteppableEngine.reclaim`: slots retired by zero-copy
commits, sessions abandoned by a timer), so an idle server holds no more pages than its cache
entries, within one pass of the loop after the last request finishes, the last command (e.g.
a session's DELETE) runs or a timer comes up; then it runs its ``on_idle`` hook (the
server's: a young garbage collection, `edmm.server.collector`). Each
request's
outputs go to an `asyncio.Queue` on the event loop that asked for them (``call_soon_threadsafe``).

A step that gives some request its first output waits (up to ``handback_wait_s``) until that
request's consumer on the event loop took it and came back for the next one (a streamed
response: its first event written) before the thread steps on: the next step's Python would
otherwise hold the GIL against the event loop at each of its wake-ups, a switch interval each
(`edmm.server.cli.SWITCH_INTERVAL_S`), on the way of the request's first token. The requests
in flight wait that long once per new request.

An exception out of `step` fails the requests in flight (each gets an `EngineStepError` and is
aborted) and the loop carries on serving; it never takes the server down.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Generic, Protocol, TypeVar

from edmm.engine import RequestOutput
from edmm.server.errors import EngineStepError, ServiceUnavailableError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class SteppableEngine(Protocol):
    """What the loop needs of an engine (`edmm.engine.Engine` provides it)."""

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished(self) -> bool: ...

    def abort(self, request_id: str) -> bool: ...

    def reclaim(self) -> int:
        """Release memory held for no request (called when idle); return how much."""
        ...

    def tick(self) -> int:
        """Run the timers that are due (called when idle; a step runs its own)."""
        ...

    def next_timer_s(self) -> float | None:
        """Seconds until the next timer is due (None: none)."""
        ...


E = TypeVar("E", bound=SteppableEngine)
_Item = RequestOutput | BaseException
HANDBACK_WAIT_S = 0.001  # `EngineLoop`'s default bound on waiting for first outputs taken
TIMER_RETRY_S = 1.0  # after the engine's timers failed, when the idle loop tries them again


class _Stream:
    """The outputs of one request, handed from the engine thread to its event loop.

    ``step_ns``: the wall clock (``time.time_ns``) when the engine thread began its first step
    after the request was queued; ``put_ns``: when it handed over the first output (both set
    on the engine thread, for `edmm.server.stages`). ``taken``: set on the event loop once
    the consumer took the first item and asked for the next (or left)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.created_ns = time.time_ns()
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[_Item] = asyncio.Queue()
        self.step_ns: int | None = None
        self.put_ns: int | None = None
        self.taken = threading.Event()


def _hand_over(items: list[tuple[_Stream, _Item]]) -> list[bool]:
    """Hand items to their streams from the engine thread: one wake-up of each event loop
    for all of its items (a step's outputs cost one cross-thread call, not one per request);
    a closed event loop drops its items. Whether each item was its stream's first."""
    now = time.time_ns()
    firsts = []
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, _Item]]] = {}
    for stream, item in items:
        firsts.append(stream.put_ns is None)
        if stream.put_ns is None:
            stream.put_ns = now
        by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, batch)
        except RuntimeError:
            for stream, _ in batch:
                stream.taken.set()  # nobody will take it
    return firsts


def _deliver(batch: list[tuple[_Stream, _Item]]) -> None:
    """On the event loop: queue each item on its stream."""
    for stream, item in batch:
        stream.queue.put_nowait(item)


class OutputStream:
    """The outputs of one submitted request."""

    def __init__(self, loop: EngineLoop[Any], stream: _Stream) -> None:
        self._loop = loop
        self._stream = stream
        self.finished = False
        self.aborted = False  # left before the request finished

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self._stream.request_id

    @property
    def created_ns(self) -> int:
        """Wall-clock nanoseconds when the request's submission was made (the server took it
        up: `edmm.server.latency`)."""
        return self._stream.created_ns

    @property
    def engine_ns(self) -> tuple[int | None, int | None]:
        """Wall-clock nanoseconds on the engine thread: the start of its first step after the
        request was queued, and the hand-over of the first output (None until then)."""
        return self._stream.step_ns, self._stream.put_ns

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes; an engine error is raised here.

        Leaving early (the client disconnected, the consumer was cancelled) aborts the request
        and frees its memory.
        """
        taken = self._stream.taken
        try:
            while not self.finished:
                item = await self._stream.queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.finished = item.finished
                yield item
                if not taken.is_set():  # the first item is dealt with: the engine steps on
                    taken.set()
        finally:
            taken.set()
            if not self.finished:
                self.abort()

    def abort(self) -> None:
        """Abort the request (no-op once it finished)."""
        if not self.finished:
            self.finished = self.aborted = True
            with contextlib.suppress(ServiceUnavailableError):
                self._loop.abort(self.request_id)


class EngineLoop(Generic[E]):
    """Runs ``engine`` on its own thread; see the module docstring. ``on_idle``: called on
    that thread whenever it is about to sleep for want of work (errors are logged);
    ``handback_wait_s``: the most a step waits for its first outputs to be taken (0: never
    waits)."""

    def __init__(self, engine: E, name: str = "edmm-engine",
                 on_idle: Callable[[], object] | None = None,
                 handback_wait_s: float = HANDBACK_WAIT_S) -> None:
        self.engine = engine
        self._handback_wait_s = handback_wait_s
        self._on_idle = on_idle
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._unstepped: list[_Stream] = []  # queued since the last step (engine thread)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._stopping = False
        self._refusing: BaseException | None = None  # set by `end_all`: new requests fail
        self.error: BaseException | None = None  # set if the thread died
        self.num_steps = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the engine thread."""
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Fail pending requests, stop the thread and wait for it."""
        if not self._thread.is_alive():
            return
        self._commands.put(None)
        self._thread.join(timeout)

    @property
    def num_streams(self) -> int:
        """Requests with a listener that have not finished (read it on the engine thread)."""
        return len(self._streams)

    @property
    def is_alive(self) -> bool:
        """True while the engine thread runs."""
        return self._thread.is_alive() and not self._stopping

    # ------------------------------------------------------------------ calls
    def call(self, fn: Callable[[E], T]) -> concurrent.futures.Future[T]:
        """Run ``fn(engine)`` on the engine thread between steps."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(self.engine))
            except BaseException as e:  # handed to the caller
                future.set_exception(e)

        self._put(run)
        return future

    async def run(self, fn: Callable[[E], T]) -> T:
        """`call` from a coroutine."""
        return await asyncio.wrap_future(self.call(fn))

    async def submit(self, request_id: str,
                     submit: Callable[[E], T]) -> tuple[T, OutputStream]:
        """Run ``submit(engine)`` on the engine thread to queue a request; return its result
        and the stream of the request's outputs (read it with `OutputStream.outputs`).

        An error of ``submit`` is raised here, and nothing was queued.
        """
        submission: Submission[E, T] = Submission(self, request_id)
        submission.send(submit)
        return await submission.result()

    def _submission(self, stream: _Stream, submit: Callable[[E], T],
                    future: concurrent.futures.Future[T]) -> None:
        self._put(lambda: self._submit(stream, submit, future))

    def abort(self, request_id: str) -> None:
        """Abort a request (from any thread)."""
        self._put(lambda: self._abort(request_id))

    def end_all(self, error: BaseException) -> None:
        """End every request in flight with ``error`` (each is aborted; its consumer gets the
        error) and fail every request submitted from now on with it; any thread (a no-op
        once the loop stopped)."""
        def end() -> None:
            self._refusing = error
            self._fail_all(error)

        with contextlib.suppress(ServiceUnavailableError):
            self._put(end)

    # ------------------------------------------------------------------ engine thread
    def _put(self, command: Callable[[], None]) -> None:
        if self._stopping or not self._thread.is_alive():
            raise ServiceUnavailableError("the engine is not running")
        self._commands.put(command)

    def _run(self) -> None:
        try:
            while not self._stopping:
                idle = not self.engine.has_unfinished()
                wake = self._idle() if idle else None
                self._run_commands(block=idle, timeout=wake)
                if not self._stopping and self.engine.has_unfinished():
                    self._step()
        except BaseException as e:  # a bug: report it on /health, fail every request
            logger.exception("engine loop died")
            self.error = e
        finally:
            self._stopping = True
            self._fail_all(ServiceUnavailableError("the engine stopped"))

    def _idle(self) -> float | None:
        """Run the due timers, reclaim memory, run the idle hook; the seconds until the next
        timer (None: none)."""
        wake = None
        try:
            self.engine.tick()
            wake = self.engine.next_timer_s()
        except Exception:  # a bug: the timers run again at the next step or wake-up
            logger.exception("the engine's timers failed")
            wake = TIMER_RETRY_S
        try:
            self.engine.reclaim()
        except Exception:  # memory stays held until the next try; serving carries on
            logger.exception("reclaiming idle memory failed")
        if self._on_idle is not None:
            try:
                self._on_idle()
            except Exception:
                logger.exception("the idle hook failed")
        return wake

    def _run_commands(self, block: bool, timeout: float | None = None) -> None:
        """Run the queued commands; with ``block``, wait for one first (at most ``timeout``
        seconds; None: as long as it takes)."""
        try:
            command = self._commands.get(block=block, timeout=timeout if block else None)
            while True:
                if command is None:
                    self._stopping = True
                    return
                try:
                    command()
                except Exception:  # commands report their own errors; this is a bug
                    logger.exception("engine command failed")
                command = self._commands.get_nowait()
        except queue.Empty:
            return

    def _step(self) -> None:
        if self._unstepped:
            now = time.time_ns()
            for waiting in self._unstepped:
                waiting.step_ns = now
            self._unstepped.clear()
        try:
            outputs = self.engine.step()
        except Exception as e:
            logger.exception("engine step failed; aborting the requests in flight")
            self._fail_all(EngineStepError(f"the engine failed: {e}"))
            return
        self.num_steps += 1
        items: list[tuple[_Stream, _Item]] = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # a request nobody listens to (e.g. speculation)
            if out.finished:
                del self._streams[out.request_id]
            items.append((stream, out))
        firsts = [s for (s, _), first in zip(items, _hand_over(items), strict=True) if first]
        if firsts and self._handback_wait_s > 0:
            _await_taken(firsts, self._handback_wait_s)

    def _submit(self, stream: _Stream, submit: Callable[[E], T],
                future: concurrent.futures.Future[T]) -> None:
        if not future.set_running_or_notify_cancel():
            return  # the caller left before its request was queued
        if self._refusing is not None:
            future.set_exception(self._refusing)
            return
        try:
            result = submit(self.engine)
        except Exception as e:
            future.set_exception(e)
            return
        self._streams[stream.request_id] = stream
        self._unstepped.append(stream)
        future.set_result(result)

    def _abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._unstepped = [s for s in self._unstepped if s.request_id != request_id]
        self.engine.abort(request_id)

    def _fail_all(self, error: BaseException) -> None:
        self._unstepped.clear()
        items: list[tuple[_Stream, _Item]] = []
        for request_id, stream in list(self._streams.items()):
            try:
                self.engine.abort(request_id)
            except Exception:
                logger.exception("abort of %s failed", request_id)
            items.append((stream, error))
        _hand_over(items)
        self._streams.clear()


def _await_taken(streams: list[_Stream], bound_s: float) -> None:
    """Wait until the consumers took the first outputs of ``streams`` (the GIL is free for
    the event loop meanwhile), at most ``bound_s`` in all."""
    deadline = time.monotonic() + bound_s
    for stream in streams:
        left = deadline - time.monotonic()
        if left <= 0 or not stream.taken.wait(left):
            return


class Submission(Generic[E, T]):
    """One request's submission in two halves: made on an event loop (whose queue gets the
    outputs), `send` from any thread (e.g. the tokenizing thread, straight to the engine
    thread), `result` awaited on that event loop; `cancel` if `result` will not be awaited."""

    def __init__(self, loop: EngineLoop[E], request_id: str) -> None:
        self._loop = loop
        self._stream = _Stream(request_id)
        self._future: concurrent.futures.Future[T] = concurrent.futures.Future()

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self._stream.request_id

    def send(self, submit: Callable[[E], T]) -> None:
        """Queue ``submit(engine)`` for the engine thread (`ServiceUnavailableError` when the
        loop is not running); any thread."""
        self._loop._submission(self._stream, submit, self._future)

    async def result(self) -> tuple[T, OutputStream]:
        """``submit``'s result and the request's output stream (its error raised here, and
        nothing was queued); leaving (cancelled) aborts the request."""
        try:
            result = await asyncio.wrap_future(self._future)
        except asyncio.CancelledError:  # the caller left: the request may be queued already
            self.cancel()
            raise
        return result, OutputStream(self._loop, self._stream)

    def cancel(self) -> None:
        """Nothing is queued if ``submit`` has not run yet (or failed); else the request is
        aborted."""
        future = self._future
        if future.cancel() or (future.done() and future.exception() is not None):
            return
        with contextlib.suppress(ServiceUnavailableError):
            self._loop.abort(self._stream.request_id)
