"""One request at a time against EDMM and its peers, through one client (``edmm bench single``).

Every server sees the same token ids on ``POST /v1/completions`` (streamed, greedy,
``ignore_eos``), so the numbers differ only by the engine behind the HTTP front. Per context
``n`` and tool result of ``r`` tokens, each repetition uses new random ids:

- **full**: a fresh prompt of ``n + r`` tokens, one output token: time to that token;
- **A** (appended to a cached prefix): ``n`` tokens sent first (one output token, untimed,
  so the server caches them), then the same ``n`` followed by ``r`` new ones, timed;
- **B** (inserted mid-prompt): ``n`` tokens sent first, then the ``r`` new tokens inserted at
  ``insert_fraction`` of them: a prefix cache reuses the part before the insertion only;
- **floor**: a prompt of 16 tokens, one output token: what HTTP, tokenization-free request
  handling and one tiny step cost (the overhead every request pays);
- **decode**: ``b`` streamed requests at once, short prompts, ``decode_tokens`` each: time per
  output token per request (median over requests of (end - first token) / (tokens - 1)) and
  the tokens/s that gives at batch ``b``.

Repetitions are summarized as the median and the trimmed mean (the lowest and highest dropped),
as the seed's vLLM 0.6.6 table was. The speculation hit (C) needs the chat API's prediction
of the next messages, which no peer has: ``edmm bench live`` measures it.
"""

from __future__ import annotations

import asyncio
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from edmm.bench.load import RequestRecord, run_level
from edmm.bench.peers import (
    PeerError,
    ServerSpec,
    measure_each,
    served,
    served_model,
)
from edmm.bench.results import ResultWriter, collect_environment
from edmm.bench.resume import SEED_VLLM_066

FLOOR_TOKENS = 16
DECODE_PROMPT_TOKENS = 128


class SingleBenchError(RuntimeError):
    """A measurement failed (the server answered with an error, or not at all)."""


@dataclass(frozen=True)
class SingleConfig:
    """What one ``edmm bench single`` run measures (the same for every server).

    Attributes:
        contexts: cached context lengths ``n`` of the A/B/full measurements.
        result_tokens: the tool result ``r`` appended (A) or inserted (B).
        insert_fraction: where B inserts it, as a fraction of ``n`` in (0, 1).
        repeats: timed repetitions of each measurement.
        decode_batches: concurrent requests of the decode measurement.
        decode_tokens: output tokens of each decode request.
        token_range: ``[low, high)`` of the random token ids.
        seed: seed of the ids.
        device: where the servers run (recorded with the results).
        timeout_s: one request's limit.
    """

    contexts: tuple[int, ...] = (16384,)
    result_tokens: int = 512
    insert_fraction: float = 0.5
    repeats: int = 8
    decode_batches: tuple[int, ...] = (1, 8, 32, 64)
    decode_tokens: int = 256
    token_range: tuple[int, int] = (1000, 100_000)
    seed: int = 0
    device: str = "cuda"
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.contexts or min(self.contexts) < 2 or self.result_tokens < 1:
            raise ValueError("contexts must be at least 2 tokens and result_tokens positive")
        if not 0 < self.insert_fraction < 1:
            raise ValueError("insert_fraction must be in (0, 1)")
        if self.repeats < 1 or self.decode_tokens < 2:
            raise ValueError("repeats must be positive and decode_tokens at least 2")
        if any(b < 1 for b in self.decode_batches):
            raise ValueError("decode batches must be positive")
        low, high = self.token_range
        if not 0 <= low < high:
            raise ValueError(f"token_range must be [low, high), got {self.token_range}")


def trimmed_mean(xs: Sequence[float]) -> float:
    """The mean without the lowest and highest value (of three or more; else the mean)."""
    s = sorted(xs)
    return statistics.fmean(s[1:-1] if len(s) >= 3 else s)


class _Client:
    """Timed one-token completions against one server."""

    def __init__(self, url: str, model: str, cfg: SingleConfig, rng: random.Random) -> None:
        self.url, self.model, self.cfg, self.rng = url, model, cfg, rng

    def ids(self, n: int) -> list[int]:
        low, high = self.cfg.token_range
        return [self.rng.randrange(low, high) for _ in range(n)]

    def ttft_ms(self, prompt: list[int]) -> float:
        """Send ``prompt`` for one output token; its time to that token in ms."""
        records, _ = asyncio.run(run_level(self.url, self.model, [prompt], 1, 1,
                                           self.cfg.timeout_s))
        rec = records[0]
        if rec.error is not None or rec.ttft_s is None:
            raise SingleBenchError(f"{self.url}: {rec.error or 'no token'}")
        return rec.ttft_s * 1e3

    def resume_ms(self, n: int, insert_at: int) -> float:
        """Cache ``n`` new tokens, then time them with a result of new tokens inserted before
        token ``insert_at`` (``n``: appended)."""
        base = self.ids(n)
        self.ttft_ms(base)
        result = self.ids(self.cfg.result_tokens)
        return self.ttft_ms(base[:insert_at] + result + base[insert_at:])


def _summary(server: str, what: str, context: int | None, ms: Sequence[float]) -> dict[str, Any]:
    return {"server": server, "measure": what, "context": context, "n": len(ms),
            "median_ms": statistics.median(ms), "trimmed_mean_ms": trimmed_mean(ms),
            "min_ms": min(ms), "max_ms": max(ms)}


def _decode_row(server: str, batch: int, records: Sequence[RequestRecord]) -> dict[str, Any]:
    bad = [r.error for r in records if r.error is not None]
    if bad:
        raise SingleBenchError(f"{server}: decode at batch {batch}: {bad[0]}")
    tpot = [(r.e2e_s - r.ttft_s) * 1e3 / (r.output_tokens - 1) for r in records
            if r.e2e_s is not None and r.ttft_s is not None and r.output_tokens > 1]
    if not tpot:
        raise SingleBenchError(f"{server}: decode at batch {batch}: no request streamed tokens")
    per_token = statistics.median(tpot)
    return {"server": server, "measure": f"decode b={batch}", "context": DECODE_PROMPT_TOKENS,
            "n": len(tpot), "median_ms": per_token, "trimmed_mean_ms": trimmed_mean(tpot),
            "min_ms": min(tpot), "max_ms": max(tpot), "tok_s": batch * 1e3 / per_token}


def measure_server(spec: ServerSpec, cfg: SingleConfig, log_dir: Path | None,
                   progress: Callable[[str], Any] = print,
                   on_row: Callable[[dict[str, Any]], None] = lambda row: None,
                   ) -> list[dict[str, Any]]:
    """Every measurement of ``cfg`` against one server; its summary rows, each also given to
    ``on_row`` once measured."""
    rows: list[dict[str, Any]] = []

    def add(*new: dict[str, Any]) -> None:
        for row in new:
            rows.append(row)
            on_row(row)

    with served(spec, log_dir) as url:
        client = _Client(url, served_model(url), cfg, random.Random(cfg.seed))
        client.ttft_ms(client.ids(512))  # warm-up
        floor = [client.ttft_ms(client.ids(FLOOR_TOKENS)) for _ in range(cfg.repeats)]
        add(_summary(spec.name, "floor", FLOOR_TOKENS, floor))
        for n in cfg.contexts:
            cut = int(n * cfg.insert_fraction)
            client.resume_ms(n, n)  # warm-up at this length
            full = [client.ttft_ms(client.ids(n + cfg.result_tokens))
                    for _ in range(cfg.repeats)]
            a = [client.resume_ms(n, n) for _ in range(cfg.repeats)]
            b = [client.resume_ms(n, cut) for _ in range(cfg.repeats)]
            add(_summary(spec.name, "full", n, full), _summary(spec.name, "A", n, a),
                _summary(spec.name, "B", n, b))
            progress(f"{spec.name} {n}: A {rows[-2]['trimmed_mean_ms']:.1f} ms, "
                     f"B {rows[-1]['trimmed_mean_ms']:.1f} ms, "
                     f"full {rows[-3]['trimmed_mean_ms']:.1f} ms")
        for batch in cfg.decode_batches:
            prompts = [client.ids(DECODE_PROMPT_TOKENS) for _ in range(batch)]
            records, _ = asyncio.run(run_level(url, client.model, prompts, batch,
                                               cfg.decode_tokens, cfg.timeout_s))
            add(_decode_row(spec.name, batch, records))
            progress(f"{spec.name} decode b={batch}: {rows[-1]['median_ms']:.2f} ms/token")
    return rows


def run_single_bench(cfg: SingleConfig, specs: Sequence[ServerSpec], out_dir: Path,
                     name: str = "single") -> dict[str, Path]:
    """Measure every server in turn, write ``<name>.{csv,json,md}``; return the paths. Each
    row is also appended to ``<name>-rows.jsonl`` once measured, so a run stopped early
    (SIGTERM unwinds it, stopping the server it started) keeps what it measured."""
    if not specs:
        raise SingleBenchError("no server to measure")
    measured = measure_each(specs, out_dir, name, lambda spec, logs, on_row: measure_server(
        spec, cfg, logs, on_row=on_row), errors=(PeerError, SingleBenchError))
    rows = measured.rows
    writer = ResultWriter(out_dir, name, collect_environment(cfg.device))
    writer.add_rows(rows)
    notes = [
        "One request at a time (decode: b at once), /v1/completions with token-id prompts, "
        "streamed, greedy. full: a fresh prompt of n + r tokens; A: n tokens cached by a first "
        f"request, then r = {cfg.result_tokens} new tokens appended; B: the same r inserted at "
        f"{cfg.insert_fraction:g} of n; floor: {FLOOR_TOKENS} tokens, one output token. Times "
        "to the first token in ms; decode: ms per output token per request "
        f"({cfg.decode_tokens} tokens, {DECODE_PROMPT_TOKENS}-token prompts) and the batch's "
        "tokens/s.",
        "Ratios to the first server:\n\n" + comparison_table(rows),
        seed_note(rows),
        *measured.failure_notes(),
    ]
    return writer.write(rows, f"Single requests: {', '.join(s.name for s in specs)}", notes,
                        meta={"config": asdict(cfg)})


def seed_note(rows: Sequence[dict[str, Any]]) -> str:
    """B/A of each server and context beside the seed's vLLM 0.6.6 live figures."""
    seed = SEED_VLLM_066
    parts = [f"the seed's vLLM 0.6.6 live engine (H100, quoted): A {seed['A']:.2f} ms, "
             f"B {seed['B']:.2f} ms, B/A {seed['B'] / seed['A']:.2f}x"]
    mean = {(r["server"], r["measure"], r["context"]): r["trimmed_mean_ms"] for r in rows}
    for (server, measure, ctx), a in mean.items():
        b = mean.get((server, "B", ctx))
        if measure == "A" and b is not None:
            parts.append(f"{server} at {ctx}: B/A {b / a:.2f}x")
    return "B/A: " + "; ".join(parts) + "."


def comparison_table(rows: Sequence[dict[str, Any]]) -> str:
    """One line per measurement, one column per server (trimmed mean ms; decode: median), and
    each server over the first."""
    servers = list(dict.fromkeys(r["server"] for r in rows))
    keys = list(dict.fromkeys((r["measure"], r["context"]) for r in rows))
    head = ["measure", "context", *servers, *(f"{s} / {servers[0]}" for s in servers[1:])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    for key in keys:
        val = {r["server"]: r["median_ms"] if r["measure"].startswith("decode")
               else r["trimmed_mean_ms"] for r in rows if (r["measure"], r["context"]) == key}
        cells = [f"{val[s]:.2f}" if s in val else "" for s in servers]
        ratios = [f"{val[s] / val[servers[0]]:.2f}" if s in val and servers[0] in val else ""
                  for s in servers[1:]]
        lines.append("| " + " | ".join([key[0], str(key[1]), *cells, *ratios]) + " |")
    return "\n".join(lines)
