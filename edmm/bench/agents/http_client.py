"""The load generator of the HTTP replay: agent sessions in client processes.

Each client process holds one ``openai`` SDK client and runs its share of the closed loop's
sessions, one thread each; every thread of every process takes the next job from one shared
queue, so the loop keeps ``load`` jobs running, whichever process runs them. Processes rather
than threads of one process: an agent framework's own work per request and per streamed chunk
(the SDK's is ~15 ms a request at 16K in ``edmm bench live``) holds one interpreter's GIL, and
32 sessions in one process made the load generator, not the server, set the pace (on an H200
the server's Python threads were busy ~17% of such a run while resumes waited ~0.9 s).
Real agents are separate processes or machines. Each process reports its CPU time over its
wall time, so a run shows whether its busiest client was saturated (`ClientStats.cpu_max`).

A job replays as `edmm.bench.agents.http` describes (the module docstring there): per turn
one streamed ``chat.completions`` request with the session's ``X-Session-Id``, the tool's
duration slept out, the result sent as the ``tool`` message; a user message after the user's
time; a subagent's job replayed in the same thread when its parent's call is made (the call
returns when it ends). The messages and what each prompt adds are `edmm.bench.agents.chat`'s.
Against a server other than EDMM (``ClientSpec.engine``) nothing EDMM-specific is sent
(predicted results, streamed tool output, session deletion).
"""

from __future__ import annotations

import hashlib
import math
import multiprocessing
import queue
import random
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from edmm.bench.agents.chat import ChatTexts, Conversation, agent_tools, job_chat
from edmm.bench.agents.policies import POLICIES, Policy
from edmm.bench.agents.trace import Job, Turn
from edmm.bench.live import TOOL, load_tokenizer

CALL_MAX_TOKENS = 128  # a forced tool call's token limit
SESSIONS_PER_CLIENT = 4  # the default split of the closed loop over client processes
TASK = "Work on the task; use the tool."
_WORDS = ("agent", "tool", "memory", "result", "page", "cache", "token", "prefix", "branch")
_CTX = multiprocessing.get_context("spawn")  # no fork of a process holding threads
_POLL_S = 1.0  # how often the parent checks that its client processes are alive


class HttpBenchError(RuntimeError):
    """A policy that cannot run over HTTP, or a turn that did not go as the replay needs."""


def new_event() -> Any:
    """An event the client processes can read (of their start method's context)."""
    return _CTX.Event()


def client_processes(load: int, clients: int) -> int:
    """Client processes for ``load`` sessions: ``clients``, or (0) one per
    `SESSIONS_PER_CLIENT` sessions; never more than the sessions."""
    want = clients if clients > 0 else math.ceil(load / SESSIONS_PER_CLIENT)
    return max(1, min(load, want))


# ---------------------------------------------------------------- one client


@dataclass
class _Reply:
    """One streamed turn as the client saw it."""

    ttft_s: float
    total_s: float
    content: str
    tool_calls: list[dict[str, Any]]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int

    @property
    def digest(self) -> str:
        """The output's greedy identity (content and calls, not the server's call ids)."""
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in self.tool_calls]
        return hashlib.sha1(repr((self.content, calls)).encode()).hexdigest()[:16]

    def message(self) -> dict[str, Any]:
        """The assistant message of the next request."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


class _Client:
    """The ``openai`` SDK (streamed turns) and httpx (tool output, closing) on one server."""

    API_KEY = "unused"  # sessions belong to the key: the SDK's calls and httpx's share it

    def __init__(self, url: str, timeout: float, tokenizer: Any) -> None:
        import httpx
        import openai

        self.url = url
        self.openai = openai.OpenAI(base_url=f"{url}/v1", api_key=self.API_KEY, max_retries=0,
                                    timeout=timeout)
        self.http = httpx.Client(timeout=timeout,
                                 headers={"Authorization": f"Bearer {self.API_KEY}"})
        self.model = self.openai.models.list().data[0].id
        self.texts = ChatTexts(tokenizer, _WORDS)

    def close(self) -> None:
        self.openai.close()
        self.http.close()

    def text(self, rng: random.Random, tokens: int) -> str:
        """Random words of about ``tokens`` tokens."""
        return self.texts.text(rng, tokens)

    def close_session(self, sid: str) -> None:
        """Delete a finished job's session (``DELETE /v1/edmm/sessions/{id}``)."""
        for _ in range(100):  # 409 while the engine thread has not yet seen the turn end
            r = self.http.delete(f"{self.url}/v1/edmm/sessions/{sid}")
            if r.status_code != 409:
                break
            time.sleep(0.01)
        if r.status_code != 200:
            raise HttpBenchError(f"closing {sid} got HTTP {r.status_code}: {r.text[:300]}")

    def feed(self, sid: str, call_id: str, chunk: str) -> None:
        """Post part of a running tool's output (speculated as it arrives)."""
        r = self.http.post(f"{self.url}/v1/edmm/sessions/{sid}/tool_output",
                           json={"tool_call_id": call_id, "content": chunk, "final": False})
        if r.status_code != 200:
            raise HttpBenchError(f"tool_output of {sid} got HTTP {r.status_code}: "
                                 f"{r.text[:300]}")

    def turn(self, sid: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
             tool: str | None, output_tokens: int, predicted: str | None) -> _Reply:
        """One streamed turn: forced to call ``tool``, or (None) ``output_tokens`` of
        content."""
        kw: dict[str, Any] = {
            "tool_choice": {"type": "function", "function": {"name": tool}},
            "max_tokens": CALL_MAX_TOKENS} if tool is not None else {
            "tool_choice": "none", "max_tokens": output_tokens,
            "extra_body": {"ignore_eos": True, "min_tokens": output_tokens}}
        if predicted is not None and tool is not None:
            kw["extra_body"] = {"edmm": {"predicted_tool_results": {tool: predicted}}}
        create: Any = self.openai.chat.completions.create  # messages are plain dicts
        t0 = time.perf_counter()
        ttft: float | None = None
        content: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        usage = None
        for chunk in create(model=self.model, messages=messages, tools=tools, temperature=0,
                            stream=True, stream_options={"include_usage": True},
                            extra_headers={"X-Session-Id": sid}, **kw):
            if chunk.usage is not None:
                usage = chunk.usage
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            if ttft is None and (delta.content or delta.tool_calls):
                ttft = time.perf_counter() - t0
            if delta.content:
                content.append(delta.content)
            for tc in delta.tool_calls or ():
                _merge_call(calls.setdefault(tc.index, {}), tc)
        total = time.perf_counter() - t0
        if usage is None or ttft is None:
            raise HttpBenchError(f"session {sid}: the stream sent no usage or no output")
        details = usage.prompt_tokens_details
        return _Reply(ttft, total, "".join(content), [calls[i] for i in sorted(calls)],
                      usage.prompt_tokens, (details.cached_tokens or 0) if details else 0,
                      usage.completion_tokens)


def template_tokens(tokenizer: Any) -> int:
    """Prompt tokens of an empty conversation with the tool: what the chat template adds."""
    bare = [{"role": "system", "content": ""}, {"role": "user", "content": TASK}]
    return ChatTexts(tokenizer, _WORDS).count(bare, [TOOL], generation=True)


def prefix_excess(tokenizer: Any, jobs: Sequence[Job], tags: Sequence[str] = ("warm", "run")
                  ) -> int:
    """Most tokens by which an agent type's shared prefix, as the client renders it (its
    system message and tool schemas, under each run ``tags``), exceeds the trace's
    ``prefix_tokens``: the schemas' JSON is a floor a small ``--token-scale`` goes below."""
    texts, tools = ChatTexts(tokenizer, _WORDS), agent_tools(jobs)
    return max((texts.agent(j.agent, tools[j.agent], j.prefix_tokens, tag).prefix_tokens
                - j.prefix_tokens for j in jobs if j.agent for tag in tags), default=0)


def _merge_call(into: dict[str, Any], delta: Any) -> None:
    """Accumulate one streamed tool-call delta into an OpenAI ``tool_calls`` entry."""
    fn = into.setdefault("function", {"name": "", "arguments": ""})
    into["type"] = "function"
    if delta.id:
        into["id"] = delta.id
    if delta.function is not None:
        fn["name"] += delta.function.name or ""
        fn["arguments"] += delta.function.arguments or ""


# ---------------------------------------------------------------- one job


ENGINES = ("edmm", "vllm", "url")  # what a server is: EDMM's, vLLM's, any other


@dataclass(frozen=True)
class ClientSpec:
    """What a client process needs to replay jobs (picklable): the server, the tokenizer
    folder, the policy's name, the request timeout, the run's ``tag`` (it salts session ids
    and text), the forced call's length (0: measured on the first call), what the server is
    (`ENGINES`: against a peer nothing EDMM-specific is sent) and its name in the rows, the
    subagent jobs by id and each agent type's tool names (`chat.agent_tools`)."""

    url: str
    tokenizer: str | None  # a folder; None: the embedded tiny model's
    policy: str
    timeout_s: float
    tag: str
    call_tokens: int = 0
    engine: str = "edmm"
    label: str = ""  # the rows' name of the server (default: the policy's)
    subagents: Mapping[str, Job] = field(default_factory=dict)
    tools: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The rows' ``policy``: the label, or the policy's name."""
        return self.label or self.policy


@dataclass
class JobResult:
    """One replayed job: its row, its turns' rows (its subagents' too), the forced call's
    length seen, its subagents' job rows."""

    job: dict[str, Any]
    turns: list[dict[str, Any]]
    call_tokens: int
    subagent_jobs: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class _Session:
    """A job being replayed: its conversation and what it waited."""

    job: Job
    sid: str
    chat: Conversation
    tools: list[dict[str, Any]]
    waited_s: float = 0.0  # tools, users and subagents' waits
    user_s: float = 0.0
    out_tokens: int = 0
    rows: list[dict[str, Any]] = field(default_factory=list)
    children: list[JobResult] = field(default_factory=list)


class _Agent:
    """Replays jobs on one client: the conversation, the forced calls, the tools' time."""

    def __init__(self, spec: ClientSpec, client: _Client, overlapped: Any) -> None:
        self.spec, self.client, self.overlapped = spec, client, overlapped
        self.policy: Policy = POLICIES.create(spec.policy)
        self.call_tokens = spec.call_tokens
        self._lock = threading.Lock()

    def job(self, job: Job, parent: str | None = None) -> JobResult:
        """Replay one job (a subagent's: ``parent`` names its parent's session); its session
        is closed at the end (its KV released)."""
        client, tag = self.client, self.spec.tag
        sid = f"{self.spec.name}-{tag}-{job.job_id}"
        head, first = job_chat(client.texts, job, self.spec.tools, tag, TASK)
        chat = Conversation([{"role": "system", "content": head.system},
                             {"role": "user", "content": first}], head.prefix_tokens)
        run = _Session(job, sid, chat, head.tools)
        start = time.perf_counter()
        kind = "first"
        for i, turn in enumerate(job.turns):
            reply = self._turn(run, i, turn, kind, parent, start)
            if not turn.continues:
                break
            if turn.tool is not None:
                self._after_call(run, turn, reply)
                kind = "tool"
            else:
                self._after_answer(run, i, turn, reply)
                kind = "user"
        jct = time.perf_counter() - start
        if self.spec.engine == "edmm":
            client.close_session(sid)
        row = {"kind": "job", "policy": self.spec.name, "job": job.job_id,
               "turns": len(job.turns), "jct_s": jct, "tool_s": run.waited_s,
               "engine_wait_s": jct - run.waited_s, "output_tokens": run.out_tokens,
               "user_s": run.user_s, "agent": job.agent, "subagent": parent is not None}
        subs = [j for c in run.children for j in (c.job, *c.subagent_jobs)]
        return JobResult(row, run.rows, self.call_tokens, subs)

    def _turn(self, run: _Session, i: int, turn: Turn, kind: str, parent: str | None,
              start: float) -> _Reply:
        """Send turn ``i`` and record its row."""
        result = self._result(run.job, turn) if turn.tool is not None else ""
        predicted = result if (self.spec.engine == "edmm" and self.policy.predicted
                               and turn.predictable and result) else None
        reply = self.client.turn(run.sid, run.chat.messages, run.tools,
                                 self._tool_name(run, turn), turn.output_tokens, predicted)
        run.out_tokens += reply.completion_tokens
        kept = run.chat.kept if i else run.chat.shared_tokens
        run.rows.append({
            "kind": "turn", "policy": self.spec.name, "job": run.job.job_id, "turn": i,
            "resume": i > 0, "turn_kind": kind, "ends_in_call": turn.tool is not None,
            "ttft_s": reply.ttft_s, "total_s": reply.total_s,
            "prompt_tokens": reply.prompt_tokens, "cached_tokens": reply.cached_tokens,
            "completion_tokens": reply.completion_tokens, "output": reply.digest,
            "new_tokens": max(reply.prompt_tokens - kept, 0),
            "shared_tokens": run.chat.shared_tokens if i == 0 else 0,
            "agent": run.job.agent, "subagent": parent is not None,
            "started_s": time.monotonic() - (time.perf_counter() - start) if i == 0 else None,
            "overlapped": self.overlapped.is_set()})
        if turn.tool is not None and not reply.tool_calls:
            raise HttpBenchError(f"job {run.job.job_id} turn {i}: the forced tool call did "
                                 "not come")
        if turn.tool is not None:
            with self._lock:
                self.call_tokens = self.call_tokens or reply.completion_tokens
        run.chat.replied(reply.prompt_tokens, reply.completion_tokens, reply.message())
        return reply

    def _tool_name(self, run: _Session, turn: Turn) -> str | None:
        """The tool a call turn is forced to: the trace's, where the session declares it."""
        if turn.tool is None:
            return None
        names = [t["function"]["name"] for t in run.tools]
        return turn.tool if turn.tool in names else names[0]

    def _after_call(self, run: _Session, turn: Turn, reply: _Reply) -> None:
        """The tool runs (a subagent's job, or its time slept out); its result is sent next,
        after the kept context (a compaction keeps the shared prefix and a summary)."""
        call_id = reply.tool_calls[0]["id"]
        result = self._result(run.job, turn)
        if turn.subagent is not None:
            child = self.job(self.spec.subagents[turn.subagent], parent=run.sid)
            run.children.append(child)
            run.rows += child.turns
            run.waited_s += child.job["tool_s"]
        else:
            run.waited_s += self._tool(run.sid, call_id, turn, result)
        if turn.keep_tokens is not None:
            run.chat.keep(turn.keep_tokens)
            run.chat.add({"role": "user", "content": result}, reply.message(),
                         {"role": "tool", "tool_call_id": call_id, "content": "done"})
        else:
            run.chat.add({"role": "tool", "tool_call_id": call_id, "content": result})

    def _after_answer(self, run: _Session, i: int, turn: Turn, reply: _Reply) -> None:
        """The turn answered without a call: the user replies after their time."""
        time.sleep(turn.user_s)
        run.waited_s += turn.user_s
        run.user_s += turn.user_s
        if turn.keep_tokens is not None:
            run.chat.keep(turn.keep_tokens)
        rng = random.Random(f"{self.spec.tag}/{run.job.job_id}/user{i}")
        run.chat.add({"role": "user", "content": self.client.text(rng, turn.user_tokens)})

    def _result(self, job: Job, turn: Turn) -> str:
        """The tool's result text: the trace's tokens plus the turn's output beyond the forced
        call's (a cacheable call's text is the same in every job, as in process)."""
        salt = "cacheable" if turn.cacheable else f"{self.spec.tag}/{job.job_id}"
        rng = random.Random(f"{turn.tool}{turn.arguments}|{salt}")
        pad = max(0, turn.output_tokens - self.call_tokens)
        return self.client.text(rng, turn.result_tokens + pad)

    def _tool(self, sid: str, call_id: str, turn: Turn, result: str) -> float:
        """Wait the tool's duration out (feeding half its output half-way if streamed)."""
        t0 = time.perf_counter()
        if self.spec.engine == "edmm" and self.policy.streamed and turn.streamed:
            time.sleep(turn.tool_s / 2)
            words = result.split(" ")
            self.client.feed(sid, call_id, " ".join(words[: len(words) // 2]))
            time.sleep(max(0.0, turn.tool_s - (time.perf_counter() - t0)))
        else:
            time.sleep(turn.tool_s)
        return time.perf_counter() - t0


# ---------------------------------------------------------------- the processes


def _client_main(spec: ClientSpec, threads: int, jobs: Any, events: Any, overlapped: Any,
                 stop: Any) -> None:
    """A client process: ``threads`` sessions taking jobs from ``jobs`` (None: no more),
    posting ``ready``, ``start``, ``done``, ``error`` and last ``exit`` (its CPU and wall
    seconds from ready) to ``events``."""
    try:
        client = _Client(spec.url, spec.timeout_s, load_tokenizer(spec.tokenizer))
    except BaseException:
        events.put(("error", traceback.format_exc()))
        events.put(("exit", (0.0, 0.0)))
        return
    agent = _Agent(spec, client, overlapped)
    events.put(("ready", None))
    c0, t0 = time.process_time(), time.perf_counter()

    def worker() -> None:
        while not stop.is_set():
            job = jobs.get()
            if job is None:
                return
            events.put(("start", job.job_id))
            try:
                events.put(("done", agent.job(job)))
            except BaseException:
                events.put(("error", traceback.format_exc()))
                stop.set()

    pool = [threading.Thread(target=worker, name=f"session-{i}") for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    client.close()
    events.put(("exit", (time.process_time() - c0, time.perf_counter() - t0)))


@dataclass
class ClientStats:
    """A replay's client side: processes, makespan (from all ready to all done), and each
    process's CPU seconds over its wall seconds (1.0: one core busy; a process whose threads
    share one GIL cannot do much more, so near 1.0 its sessions waited on the client)."""

    processes: int
    makespan_s: float
    cpu_share: list[float] = field(default_factory=list)

    @property
    def cpu_max(self) -> float:
        """The busiest process's share."""
        return max(self.cpu_share, default=0.0)

    def add_exit(self, cpu_s: float, wall_s: float) -> None:
        """A process's goodbye: its CPU and wall seconds from ready (0, 0: it never was)."""
        if wall_s > 0:
            self.cpu_share.append(cpu_s / wall_s)


def replay_clients(spec: ClientSpec, jobs: Sequence[Job], load: int, processes: int,
                   overlapped: Any, on_start: Callable[[str], None],
                   on_done: Callable[[JobResult], None],
                   on_ready: Callable[[], None] = lambda: None) -> ClientStats:
    """Replay ``jobs``, ``load`` at a time, in ``processes`` client processes (the sessions
    split as evenly as they go). The jobs are queued once every process is ready (then
    ``on_ready`` runs), so process start-up is outside the makespan. ``on_start`` /
    ``on_done`` run in this thread per job. ``overlapped``: an event of the spawn context the
    turns' rows read."""
    processes = client_processes(load, processes)
    shares = [load // processes + (1 if i < load % processes else 0) for i in range(processes)]
    todo, events, stop = _CTX.Queue(), _CTX.Queue(), _CTX.Event()
    procs = [_CTX.Process(target=_client_main, name=f"edmm-client-{i}", daemon=True,
                          args=(spec, n, todo, events, overlapped, stop))
             for i, n in enumerate(shares)]
    for p in procs:
        p.start()
    watch = _Watch(procs, events, stop, ClientStats(processes, 0.0))
    try:
        _wait_ready(watch)
        on_ready()
        t0 = time.perf_counter()
        if not watch.errors:
            for job in jobs:
                todo.put(job)
        for _ in range(load):
            todo.put(None)
        while watch.exits < len(procs):
            kind, payload = watch.next()
            if kind == "start":
                on_start(payload)
            elif kind == "done":
                on_done(payload)
        watch.stats.makespan_s = time.perf_counter() - t0
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        todo.cancel_join_thread()
    if watch.errors:
        raise HttpBenchError(f"a client process failed:\n{watch.errors[0]}")
    return watch.stats


@dataclass
class _Watch:
    """The parent's view of its client processes: their events, errors and goodbyes."""

    procs: Sequence[Any]
    events: Any
    stop: Any
    stats: ClientStats
    errors: list[str] = field(default_factory=list)
    exits: int = 0

    def next(self) -> tuple[str, Any]:
        """The next event; an ``error`` is kept and stops every process, an ``exit`` counted
        (its CPU and wall seconds into `stats`)."""
        kind, payload = _next_event(self.procs, self.events, self.exits)
        if kind == "error":
            self.errors.append(payload)
            self.stop.set()
        elif kind == "exit":
            self.exits += 1
            self.stats.add_exit(*payload)
        return kind, payload


def _wait_ready(watch: _Watch) -> None:
    """Block until every process posted ``ready`` or exited (one that failed to start)."""
    ready = 0
    while ready + watch.exits < len(watch.procs):
        if watch.next()[0] == "ready":
            ready += 1


def _next_event(procs: Sequence[Any], events: Any, exits: int) -> tuple[str, Any]:
    """The next event; a typed error if the processes died without saying goodbye."""
    while True:
        try:
            event: tuple[str, Any] = events.get(timeout=_POLL_S)
            return event
        except queue.Empty:
            alive = sum(p.is_alive() for p in procs)
            if alive == 0 and exits < len(procs):
                codes = [p.exitcode for p in procs]
                raise HttpBenchError(f"client processes ended without a result (exit codes "
                                     f"{codes})") from None
