"""The HTTP replay against a peer: vLLM (with prefix caching, or with its offloading connector)
or any OpenAI-compatible URL, on the same trace, seed and client as EDMM's servers.

A vLLM peer starts through `edmm.bench.peers` from the same HF folder (random weights) with
what EDMM's server gets at the load point (`peer_options`): the KV memory of its pool (pages
less the CUDA graphs' pad page, times the page size; ``--kv-cache-memory-bytes``), its context
limit, running sequences and token budget, and for ``vllm-offload`` the host memory of EDMM's
offload at that load; `VLLMOptions` given on the command line override the KV and context
sizes, ``peer_offload_gib`` the host memory. Its chat requests are the same as EDMM's, tool
calls forced by name (vLLM's guided decoding), ``ignore_eos`` and ``min_tokens`` on content
turns; nothing EDMM-specific is sent. A launched peer warms up like EDMM's servers (the first
two jobs, other text, no tool time), its ``/metrics`` is read before and after the measured
run and sampled during it (`edmm.bench.agents.http_metrics`: prefix-cache queries and hits,
KV usage); a URL peer without ``/metrics`` leaves those cells empty.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Any

from edmm.bench.agents.http import (
    HttpBenchError,
    HttpReplayConfig,
    HttpRun,
    chat_tokenizer,
    live_config,
    server_engine,
    summarize_http,
    untimed,
)
from edmm.bench.agents.http_metrics import (
    Probe,
    Sampler,
    parse_vllm_metrics,
    vllm_counters,
    vllm_states,
)
from edmm.bench.agents.matrix import Matrix, page_size
from edmm.bench.agents.policies import POLICIES
from edmm.bench.agents.trace import Job
from edmm.bench.peers import VLLMOptions, parse_peer, served

SERVED_NAME = "edmm-agents"  # the model name vLLM peers serve under


def peer_options(cfg: HttpReplayConfig, matrix: Matrix, jobs: list[Job],
                 tokenizer: Any) -> VLLMOptions:
    """How a vLLM peer starts at this load point: EDMM's KV memory, context limit, running
    sequences, token budget and offload memory, unless ``cfg.vllm`` (or
    ``cfg.peer_offload_gib``) says otherwise."""
    if cfg.vllm is None:
        raise HttpBenchError("a vLLM peer needs its options (--peer-model-dir)")
    base = cfg.vllm
    engine = server_engine(matrix.engine_config(False), matrix.cfg, jobs, tokenizer)
    assert engine.num_pages is not None and engine.max_model_len is not None
    kv = base.kv_cache_bytes or (engine.num_pages - 1) * page_size(matrix.cfg)
    offload = cfg.peer_offload_gib
    if offload is None:
        offload = matrix.engine_config(True).kv_offload_bytes / 2**30
    extra = (*base.extra_args, "--max-num-seqs", str(engine.max_num_seqs),
             "--max-num-batched-tokens", str(engine.max_num_batched_tokens))
    return dataclasses.replace(base, kv_cache_bytes=kv, offload_gib=offload,
                               max_model_len=base.max_model_len or engine.max_model_len,
                               extra_args=extra)


def replay_peer(cfg: HttpReplayConfig, peer: str, log_dir: Path | None = None) -> HttpRun:
    """The measured run of ``peer`` (`edmm.bench.peers.parse_peer` names it) at ``cfg.load``;
    a launched server's log goes to ``log_dir``."""
    matrix = Matrix(cfg.matrix_config())
    jobs = matrix.mixes["long"]
    live = live_config(cfg)
    tok = chat_tokenizer(live)
    folder = live.tokenizer or live.model
    opts = peer_options(cfg, matrix, jobs, tok) if not peer.startswith("http") else None
    spec = parse_peer(peer, opts, SERVED_NAME)
    run = HttpRun(POLICIES.create("lru"), cfg, engine=spec.kind, label=peer)
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(served(spec, log_dir))
        start_s = time.perf_counter() - t0
        probe = Probe(url, cfg.request_timeout_s)
        stack.callback(probe.close)
        if matrix.cfg.warmup and spec.url is None:
            run.replay(url, folder, untimed(jobs), "warm", load=2)
        before = _metrics(probe)
        sampler = Sampler(probe, cfg.sample_s, lambda text: vllm_states(parse_vllm_metrics(text)))
        try:
            run.replay(url, folder, jobs, on_ready=sampler.restart)
        finally:
            run.samples = sampler.stop()
        after = _metrics(probe)
    assert run.clients is not None
    pages = server_engine(matrix.engine_config(False), matrix.cfg, jobs, tok).num_pages
    assert pages is not None
    run.summary = {**summarize_http(run, matrix.cfg, pages - 1, run.clients.makespan_s,
                                    start_s), **vllm_counters(before, after)}
    return run


def _metrics(probe: Probe) -> dict[str, Any]:
    """The peer's vLLM counters ({} where it has no ``/metrics``)."""
    try:
        return parse_vllm_metrics(probe.text())
    except Exception:  # a URL peer without /metrics: its cells stay empty
        return {}


__all__ = ["SERVED_NAME", "peer_options", "replay_peer"]
