"""A load curve at the client: streamed TTFT, inter-token latency and output tokens/s at rising
concurrency, for EDMM and its peers side by side (``edmm bench load``).

Each *workload* is a prompt length, an output length and a prefix mode:

- ``fresh``: every request's prompt is its own random token ids (nothing to reuse);
- ``shared``: every prompt starts with the same ``shared_fraction`` of its tokens (a common
  system prompt), then its own random ids: prefix caching serves the shared part.

At each concurrency ``c`` a closed loop keeps ``c`` requests in flight until ``requests(c)``
have completed: ``POST /v1/completions`` with the prompt as token ids (both engines see the
same ids whatever their tokenizers), ``max_tokens`` = ``min_tokens`` = the output length and
``ignore_eos`` (random weights would stop anywhere), greedy, streamed with
``stream_options.include_usage``. Per request: TTFT (send to the first token's chunk), the
gaps between later chunks (inter-token latency, ITL), end-to-end time and the tokens the
server counted. Per level: output tokens/s over the level's wall time (first send to last
byte), and p50/p90/p99 of TTFT and ITL. Every level starts with fresh prompts (new random
ids), so no level reuses another's KV but the ``shared`` prefix.

One warm-up request per server and workload runs before the levels (compilation, graph
capture and allocator growth stay out of the numbers); errors are counted, never dropped.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from edmm.bench.peers import (
    PeerError,
    ServerSpec,
    measure_each,
    served,
    served_model,
)
from edmm.bench.results import Environment, ResultWriter, collect_environment
from edmm.bench.stages import StageLogReader, stage_summary
from edmm.bench.stats import percentile
from edmm.server.stages import ENV as STAGE_ENV

PREFIX_MODES = ("fresh", "shared")


class LoadBenchError(RuntimeError):
    """A level could not be measured (every request of it failed)."""


@dataclass(frozen=True)
class LoadConfig:
    """What one ``edmm bench load`` run measures (the same for every server).

    Attributes:
        prompt_tokens: prompt lengths, one workload each (with each prefix mode).
        output_tokens: tokens every request generates.
        concurrency: levels of requests in flight.
        prefixes: prefix modes (`PREFIX_MODES`).
        shared_fraction: share of a ``shared`` prompt that all requests have in common.
        min_requests: fewest requests a level completes.
        rounds: a level completes ``max(min_requests, rounds * c)`` requests.
        token_range: ``[low, high)`` of the random prompt token ids (ordinary tokens of the
            vocabulary: no special ids).
        seed: seed of the prompts.
        device: where the servers run (recorded with the results).
        timeout_s: one request's limit.
    """

    prompt_tokens: tuple[int, ...] = (2048,)
    output_tokens: int = 256
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    prefixes: tuple[str, ...] = ("fresh",)
    shared_fraction: float = 0.75
    min_requests: int = 8
    rounds: float = 2.0
    token_range: tuple[int, int] = (1000, 100_000)
    seed: int = 0
    device: str = "cuda"
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        bad = [p for p in self.prefixes if p not in PREFIX_MODES]
        if bad:
            raise ValueError(f"prefix modes are {PREFIX_MODES}, got {bad}")
        if not self.prompt_tokens or min(self.prompt_tokens) < 2:
            raise ValueError("prompt lengths must be at least 2 tokens")
        if self.output_tokens < 1 or not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("output tokens and concurrency levels must be positive")
        if not 0 < self.shared_fraction < 1:
            raise ValueError("shared_fraction must be in (0, 1)")
        low, high = self.token_range
        if not 0 <= low < high:
            raise ValueError(f"token_range must be [low, high) with 0 <= low < high, "
                             f"got {self.token_range}")

    def requests(self, concurrency: int) -> int:
        """Requests a level of ``concurrency`` completes."""
        return max(self.min_requests, round(self.rounds * concurrency))


@dataclass
class RequestRecord:
    """One request as the client saw it (seconds)."""

    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between content chunks
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    error: str | None = None


class Prompts:
    """Random prompts of one workload; ``shared`` ones start with one common prefix."""

    def __init__(self, cfg: LoadConfig, length: int, prefix: str) -> None:
        self.cfg, self.length, self.prefix = cfg, length, prefix
        self.rng = random.Random(f"{cfg.seed}-{length}-{prefix}")
        shared = int(length * cfg.shared_fraction) if prefix == "shared" else 0
        self.common = self._ids(shared)

    def _ids(self, n: int) -> list[int]:
        low, high = self.cfg.token_range
        return [self.rng.randrange(low, high) for _ in range(n)]

    def take(self, n: int) -> list[list[int]]:
        """``n`` new prompts (never returned before)."""
        return [self.common + self._ids(self.length - len(self.common)) for _ in range(n)]


async def _one(client: Any, url: str, body: dict[str, Any], timeout_s: float) -> RequestRecord:
    """Send one streamed completion and time its chunks."""
    rec = RequestRecord(prompt_tokens=len(body["prompt"]))
    start = time.perf_counter()
    last: float | None = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body,
                                 timeout=timeout_s) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {text[:200]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec.error = str(chunk["error"])[:200]
                    continue
                if _is_token_chunk(chunk):
                    if last is None:
                        rec.ttft_s = now - start
                    else:
                        rec.itl_s.append(now - last)
                    last = now
                usage = chunk.get("usage")
                if usage:
                    rec.output_tokens = int(usage.get("completion_tokens") or 0)
                    rec.prompt_tokens = int(usage.get("prompt_tokens") or rec.prompt_tokens)
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        rec.cached_tokens = int(details["cached_tokens"])
    except Exception as e:  # a failed request is a row of its own, never a crash of the level
        rec.error = f"{type(e).__name__}: {e}"[:200]
    rec.e2e_s = time.perf_counter() - start
    if rec.error is None and rec.ttft_s is None:
        rec.error = "no content chunk"
    return rec


def _is_token_chunk(chunk: dict[str, Any]) -> bool:
    """A chunk that carries generated text (servers may send an empty text for a token whose
    bytes do not end a character; a last chunk with only the finish reason carries none)."""
    choices = chunk.get("choices")
    if not choices:
        return False
    text = choices[0].get("text")
    return bool(text) or (text is not None and choices[0].get("finish_reason") is None)


async def run_level(url: str, model: str, prompts: Sequence[list[int]], concurrency: int,
                    output_tokens: int, timeout_s: float) -> tuple[list[RequestRecord], float]:
    """Complete every prompt with at most ``concurrency`` in flight; the records and the
    level's wall time in seconds."""
    import httpx

    queue = list(reversed(prompts))
    records: list[RequestRecord] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            body = {"model": model, "prompt": queue.pop(), "max_tokens": output_tokens,
                    "min_tokens": output_tokens, "ignore_eos": True, "temperature": 0.0,
                    "stream": True, "stream_options": {"include_usage": True}}
            records.append(await _one(client, url, body, timeout_s))

    async with httpx.AsyncClient(limits=limits, timeout=timeout_s) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return records, wall


def summarize_level(server: str, length: int, prefix: str, concurrency: int,
                    records: Sequence[RequestRecord], wall_s: float) -> dict[str, Any]:
    """One row of the load table (latencies in ms)."""
    ok = [r for r in records if r.error is None]
    if not ok:
        raise LoadBenchError(f"{server}: every request at concurrency {concurrency} failed: "
                             f"{records[0].error if records else 'none sent'}")
    ttft = [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]
    itl = [g * 1e3 for r in ok for g in r.itl_s]
    tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e_s - r.ttft_s) * 1e3 / (r.output_tokens - 1) for r in ok
            if r.e2e_s is not None and r.ttft_s is not None and r.output_tokens > 1]

    def pct(xs: list[float], q: float) -> float | None:
        return percentile(xs, q) if xs else None

    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    return {
        "server": server, "prompt_tokens": length, "prefix": prefix,
        "concurrency": concurrency, "requests": len(records), "errors": len(records) - len(ok),
        "output_tok_s": tokens / wall_s, "wall_s": wall_s,
        # the shortest TTFT too: when it is near the p50, every request of the level waited
        # alike (one stall as the level began), not a queue growing behind the first
        "ttft_min_ms": min(ttft) if ttft else None,
        "ttft_p50_ms": pct(ttft, 50), "ttft_p90_ms": pct(ttft, 90), "ttft_p99_ms": pct(ttft, 99),
        "itl_p50_ms": pct(itl, 50), "itl_p90_ms": pct(itl, 90), "itl_p99_ms": pct(itl, 99),
        "tpot_p50_ms": pct(tpot, 50),
        "cached_frac": (sum(cached) / sum(r.prompt_tokens for r in ok)) if cached else None,
    }


def measure_server(spec: ServerSpec, cfg: LoadConfig, log_dir: Path | None,
                   progress: Any = print,
                   on_row: Callable[[dict[str, Any]], None] = lambda row: None,
                   stages: StageRows | None = None) -> list[dict[str, Any]]:
    """Every workload and level of ``cfg`` against one server (started if ``spec`` says
    how); its summary rows, each also given to ``on_row`` as it is measured. ``stages``: the
    server writes a stage log there, summarised per level."""
    rows: list[dict[str, Any]] = []
    if stages is not None:
        spec = replace(spec, env={**spec.env, STAGE_ENV: str(stages.reader.path)})
    with served(spec, log_dir) as url:
        model = served_model(url)
        for length in cfg.prompt_tokens:
            for prefix in cfg.prefixes:
                prompts = Prompts(cfg, length, prefix)
                asyncio.run(run_level(url, model, prompts.take(1), 1, cfg.output_tokens,
                                      cfg.timeout_s))  # warm-up
                if stages is not None:
                    stages.reader.take()  # the warm-up's records
                for c in cfg.concurrency:
                    records, wall = asyncio.run(run_level(
                        url, model, prompts.take(cfg.requests(c)), c, cfg.output_tokens,
                        cfg.timeout_s))
                    if stages is not None:
                        stages.level(spec.name, length, prefix, c)
                    row = summarize_level(spec.name, length, prefix, c, records, wall)
                    rows.append(row)
                    on_row(row)
                    progress(f"{spec.name} {length} {prefix} c={c}: "
                             f"{row['output_tok_s']:.0f} tok/s, TTFT p50 "
                             f"{row['ttft_p50_ms']:.1f} ms, ITL p50 {row['itl_p50_ms'] or 0:.2f} ms"
                             + (f", {row['errors']} errors" if row["errors"] else ""))
    return rows


def ratio_rows(rows: Sequence[dict[str, Any]], base: str) -> list[dict[str, Any]]:
    """Each server's throughput and latencies over ``base``'s at the same point (> 1: more
    throughput, or more latency)."""
    key = ("prompt_tokens", "prefix", "concurrency")
    ref = {tuple(r[k] for k in key): r for r in rows if r["server"] == base}
    out = []
    for r in rows:
        b = ref.get(tuple(r[k] for k in key))
        if r["server"] == base or b is None:
            continue
        out.append({"server": r["server"], "vs": base,
                    **{k: r[k] for k in key},
                    **{f"{m}_ratio": (r[m] / b[m]) if r[m] and b[m] else None
                       for m in ("output_tok_s", "ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms",
                                 "itl_p90_ms")}})
    return out


@dataclass
class StageRows:
    """The stage spans of an EDMM server's requests, level by level: the server appends to
    ``reader``'s log, `level` summarises what a level added."""

    reader: StageLogReader
    rows: list[dict[str, Any]] = field(default_factory=list)

    def level(self, server: str, length: int, prefix: str, concurrency: int) -> None:
        """Summarise the records the level just measured added."""
        self.rows += stage_summary(self.reader.take(), {
            "server": server, "prompt_tokens": length, "prefix": prefix,
            "concurrency": concurrency})


def run_load_bench(cfg: LoadConfig, specs: Sequence[ServerSpec], out_dir: Path,
                   name: str = "load", stages: bool = False) -> dict[str, Path]:
    """Measure every server in turn (one at a time on the device), write
    ``<name>.{csv,json,md}`` and ``<name>.png``; return the paths. Each row is also appended
    to ``<name>-rows.jsonl`` as it is measured, so a run stopped early (SIGTERM unwinds it,
    stopping the server it started) keeps what it measured. ``stages``: every EDMM server
    this run starts logs its requests' stages (`edmm.server.stages`), summarised per level
    in ``<name>-stages.{csv,json,md}``."""
    if not specs:
        raise LoadBenchError("no server to measure")
    staged: list[StageRows] = []

    def measure(spec: ServerSpec, logs: Path, on_row: Callable[[dict[str, Any]], None]
                ) -> list[dict[str, Any]]:
        rows = None
        if stages and spec.kind == "edmm" and spec.launch:
            log = out_dir / f"{name}-stages-{len(staged)}.jsonl"
            log.unlink(missing_ok=True)
            staged.append(rows := StageRows(StageLogReader(log)))
        return measure_server(spec, cfg, logs, on_row=on_row, stages=rows)

    measured = measure_each(specs, out_dir, name, measure, errors=(PeerError, LoadBenchError))
    rows = measured.rows
    env = collect_environment(cfg.device)
    writer = ResultWriter(out_dir, name, env)
    writer.add_rows(rows)
    ratios = ratio_rows(rows, specs[0].name)
    notes = [
        f"Closed loop per level: c requests in flight until max({cfg.min_requests}, "
        f"{cfg.rounds:g} x c) completed; /v1/completions with token-id prompts, "
        f"{cfg.output_tokens} output tokens each (min_tokens = max_tokens, ignore_eos), "
        "greedy, streamed. TTFT: send to the first token's chunk; ITL: gaps between later "
        "chunks; output tok/s: tokens the server counted over the level's wall time.",
        f"shared: the first {cfg.shared_fraction:.0%} of every prompt is common to all "
        "requests of the workload; fresh: nothing in common.",
    ]
    if ratios:
        notes.append("Ratios (each server over " + specs[0].name + "):\n\n"
                     + _ratio_table(ratios))
    notes += measured.failure_notes()
    paths = writer.write(rows, f"Load curve: {', '.join(s.name for s in specs)}", notes,
                         meta={"config": asdict(cfg)})
    png = plot_load(rows, out_dir / f"{name}.png", cfg.device)
    if png is not None:
        paths["png"] = png
    if staged:
        paths.update({f"stages_{k}": v for k, v in _write_stages(
            [r for s in staged for r in s.rows], env, out_dir, name).items()})
    return paths


def _write_stages(rows: list[dict[str, Any]], env: Environment, out_dir: Path,
                  name: str) -> dict[str, Path]:
    """``<name>-stages.{csv,json,md}``: the EDMM servers' stage spans per level."""
    notes = ["every measured request's record in the server's stage log "
             "(`EDMM_STAGE_LOG`, edmm.server.stages: a completion's stages are received, "
             "arrive, parsed, request_made, then the engine's step_start, scheduled, "
             "output_put, and first_output, first_event on the event loop); p50 / p90 / max "
             "in milliseconds from one stage to the next",
             "arrive -> parsed: the body parsed and validated in one pass (`parse_body`); "
             "step_start -> output_put: from the engine's first step after the request was "
             "queued to its first output, split at the scheduler's admission "
             "((step_start->scheduled): waiting for memory, the token budget or a place)"]
    return ResultWriter(out_dir, f"{name}-stages", env).write(
        rows, "Load curve: where each EDMM request's time to first token goes", notes)


def _ratio_table(ratios: Sequence[dict[str, Any]]) -> str:
    from edmm.bench.results import markdown_table

    return markdown_table(ratios)


def plot_load(rows: Sequence[dict[str, Any]], path: Path, device: str) -> Path | None:
    """Output tokens/s, TTFT and ITL against concurrency: one row of panels per workload,
    one line per server (p50 solid, p90 dashed). None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return None
    workloads = sorted({(r["prompt_tokens"], r["prefix"]) for r in rows})
    servers = list(dict.fromkeys(r["server"] for r in rows))
    fig, axes = plt.subplots(len(workloads), 3, figsize=(15, 4 * len(workloads)), squeeze=False)
    for i, (length, prefix) in enumerate(workloads):
        for j, server in enumerate(servers):
            pts = sorted((r for r in rows if r["server"] == server
                          and (r["prompt_tokens"], r["prefix"]) == (length, prefix)),
                         key=lambda r: r["concurrency"])
            if not pts:
                continue
            xs = [r["concurrency"] for r in pts]
            color = f"C{j}"
            axes[i][0].plot(xs, [r["output_tok_s"] for r in pts], "o-", color=color,
                            label=server)
            for k, metric in ((1, "ttft"), (2, "itl")):
                axes[i][k].plot(xs, [r[f"{metric}_p50_ms"] for r in pts], "o-", color=color,
                                label=f"{server} p50")
                axes[i][k].plot(xs, [r[f"{metric}_p90_ms"] for r in pts], "s--", color=color,
                                alpha=0.6, label=f"{server} p90")
        titles = ("output tokens/s (higher is better)", "time to first token, ms (lower is "
                  "better)", "inter-token latency, ms (lower is better)")
        levels = sorted({r["concurrency"] for r in rows})
        for k, title in enumerate(titles):
            ax = axes[i][k]
            ax.set_xscale("log", base=2)
            ax.set_xticks(levels, [str(c) for c in levels])
            ax.set_xlabel("concurrent requests")
            ax.set_title(f"{length}-token prompts, {prefix}: {title}", fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        axes[i][1].set_yscale("log")
        axes[i][1].yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    fig.suptitle(f"Streaming load curve on {device}: each server alone on the device, same "
                 "client and prompts")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

