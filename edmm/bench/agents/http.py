"""Replay a trace over HTTP at one load point: ``edmm serve`` + the ``openai`` SDK.

Each job is a chat conversation: a system message of about the job's ``system_tokens`` words'
worth of tokens, a user task, then per turn one ``chat.completions`` request with the session's
``X-Session-Id``. A turn that ends in a tool call is forced to call the bench's tool (random
weights would not emit one otherwise; its length is the grammar's, not the trace's); the client
sleeps the tool's duration (wall clock) and sends the result as the ``tool`` message of about
``result_tokens`` tokens; the last turn generates the trace's output length (EOS ignored).
``load`` jobs run at once (closed loop, one thread each). Policies map to server flags:
``lru`` is ``--no-execution-aware`` (EDMM off), ``edmm`` the default server (with
``--kv-offload-gib`` when given).

Measured per turn at the client: the non-streamed latency of each request (a resume's latency
stands for its TTFT when a turn is short, as in ``edmm bench live``), prompt and cached tokens.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edmm.bench.agents.trace import Job
from edmm.bench.live import TOOL, TOOL_NAME, LiveBenchConfig, launched_server, load_tokenizer
from edmm.bench.report import ResultWriter, collect_environment
from edmm.bench.stats import mean, percentile

SERVER_FLAGS: dict[str, tuple[str, ...]] = {"lru": ("--no-execution-aware",), "edmm": ()}
_WORDS = ("agent", "tool", "memory", "result", "page", "cache", "token", "prefix", "branch")


@dataclass(frozen=True)
class HttpReplayConfig:
    """One load point over HTTP (see the module docstring)."""

    load: int = 2
    policies: tuple[str, ...] = ("lru", "edmm")
    model: str | None = None
    device: str = "cpu"
    server_args: tuple[str, ...] = ()
    start_timeout_s: float = 300.0
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        unknown = [p for p in self.policies if p not in SERVER_FLAGS]
        if unknown:
            raise ValueError(f"over HTTP only {sorted(SERVER_FLAGS)} run, got {unknown}")
        if self.load < 1:
            raise ValueError(f"load must be >= 1, got {self.load}")


class _Client:
    def __init__(self, url: str, timeout: float, tokenizer: Any) -> None:
        import openai

        self.openai = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                    timeout=timeout)
        self.model = self.openai.models.list().data[0].id
        sample = " ".join(_WORDS * 20)
        self._per_word = len(tokenizer.encode(sample, add_special_tokens=False)) / (
            len(_WORDS) * 20)

    def text(self, rng: random.Random, tokens: int) -> str:
        n = max(1, round(tokens / self._per_word))
        return " ".join(rng.choice(_WORDS) for _ in range(n))

    def turn(self, sid: str, messages: list[dict[str, Any]], tool: bool,
             output_tokens: int) -> tuple[Any, float]:
        kw: dict[str, Any] = {"tool_choice": {"type": "function",
                                              "function": {"name": TOOL_NAME}}} if tool else {
            "tool_choice": "none",
            "extra_body": {"ignore_eos": True, "min_tokens": output_tokens}}
        create: Any = self.openai.chat.completions.create
        t0 = time.perf_counter()
        reply = create(model=self.model, messages=messages, tools=[TOOL], temperature=0,
                       max_tokens=128 if tool else output_tokens,
                       extra_headers={"X-Session-Id": sid}, **kw)
        return reply, time.perf_counter() - t0


def _run_job(client: _Client, job: Job, policy: str, turns: list[dict[str, Any]],
             jobs: list[dict[str, Any]]) -> None:
    rng = random.Random(job.job_id)
    sid = f"{policy}-{job.job_id}"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": client.text(rng, job.system_tokens)},
        {"role": "user", "content": "Work on the task; use the tool."}]
    start, tool_s = time.perf_counter(), 0.0
    for i, turn in enumerate(job.turns):
        reply, latency = client.turn(sid, messages, turn.tool is not None, turn.output_tokens)
        usage = reply.usage
        details = usage.prompt_tokens_details if usage is not None else None
        turns.append({"policy": policy, "job": job.job_id, "turn": i, "latency_s": latency,
                      "prompt_tokens": usage.prompt_tokens if usage is not None else None,
                      "cached_tokens": (details.cached_tokens or 0) if details else 0})
        if turn.tool is None:
            break
        msg = reply.choices[0].message
        if not msg.tool_calls:
            raise RuntimeError(f"job {job.job_id} turn {i}: the forced tool call did not come")
        messages.append(msg.model_dump(exclude_none=True))
        time.sleep(turn.tool_s)
        tool_s += turn.tool_s
        messages.append({"role": "tool", "tool_call_id": msg.tool_calls[0].id,
                         "content": client.text(rng, turn.result_tokens)})
    jct = time.perf_counter() - start
    jobs.append({"policy": policy, "job": job.job_id, "jct_s": jct, "tool_s": tool_s,
                 "engine_wait_s": jct - tool_s})


def replay_http(jobs: list[Job], cfg: HttpReplayConfig) -> tuple[list[dict[str, Any]],
                                                                  list[dict[str, Any]]]:
    """Every policy's replay; ``(turn rows, job rows)``."""
    tok = load_tokenizer(cfg.model)
    longest = max(j.final_context for j in jobs)
    turn_rows: list[dict[str, Any]] = []
    job_rows: list[dict[str, Any]] = []
    for policy in cfg.policies:
        live = LiveBenchConfig(model=cfg.model, device=cfg.device,
                               contexts=(max(4096, 2 * longest),),
                               server_args=(*SERVER_FLAGS[policy], *cfg.server_args),
                               start_timeout_s=cfg.start_timeout_s,
                               request_timeout_s=cfg.request_timeout_s)
        with launched_server(live) as url:
            client = _Client(url, cfg.request_timeout_s, tok)
            todo: queue.Queue[Job] = queue.Queue()
            for job in jobs:
                todo.put(job)
            errors: list[BaseException] = []

            def worker(policy: str = policy, client: _Client = client,
                       todo: queue.Queue[Job] = todo, errors: list[BaseException] = errors,
                       ) -> None:
                while not errors:
                    try:
                        job = todo.get_nowait()
                    except queue.Empty:
                        return
                    try:
                        _run_job(client, job, policy, turn_rows, job_rows)
                    except BaseException as e:  # reported after the join
                        errors.append(e)

            threads = [threading.Thread(target=worker) for _ in range(cfg.load)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            client.openai.close()
            if errors:
                raise errors[0]
    return turn_rows, job_rows


def summarize_http(turns: list[dict[str, Any]], jobs: list[dict[str, Any]],
                   load: int) -> list[dict[str, Any]]:
    """One row per policy."""
    out = []
    for policy in dict.fromkeys(r["policy"] for r in jobs):
        js = [j for j in jobs if j["policy"] == policy]
        res = [t for t in turns if t["policy"] == policy and t["turn"] > 0]
        lat = [t["latency_s"] * 1e3 for t in res]
        prompt = sum(t["prompt_tokens"] or 0 for t in res)
        cached = sum(t["cached_tokens"] for t in res)
        out.append({"policy": policy, "load": load, "jobs": len(js),
                    "jct_mean_s": mean(j["jct_s"] for j in js),
                    "jct_p90_s": percentile([j["jct_s"] for j in js], 90),
                    "wait_mean_s": mean(j["engine_wait_s"] for j in js),
                    "resume_latency_p50_ms": percentile(lat, 50) if lat else None,
                    "resume_latency_p90_ms": percentile(lat, 90) if lat else None,
                    "resume_latency_p99_ms": percentile(lat, 99) if lat else None,
                    "prefix_hit_rate": cached / prompt if prompt else None})
    return out


def run_http_bench(jobs: list[Job], cfg: HttpReplayConfig, out_dir: Path) -> dict[str, Path]:
    """Replay over HTTP and write ``agents-http.{csv,json,md}``."""
    turns, job_rows = replay_http(jobs, cfg)
    writer = ResultWriter(out_dir, "agents-http", collect_environment(cfg.device))
    writer.add_rows([{"kind": "job", **j} for j in job_rows])
    writer.add_rows([{"kind": "turn", **t} for t in turns])
    notes = ["edmm serve + the openai SDK, closed loop, wall clock; lru = --no-execution-aware",
             "tool-call turns are forced (their length is the grammar's); the last turn "
             "generates the trace's output length; latency = non-streamed request time"]
    return writer.write(summarize_http(turns, job_rows, cfg.load),
                        "Agent workloads over HTTP", notes)
