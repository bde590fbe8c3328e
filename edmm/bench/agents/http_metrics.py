"""What a server's ``/metrics`` tells the HTTP replay: EDMM's counters and KV pages by state,
vLLM's prefix-cache counters and KV usage, sampled over a run.

EDMM (`parse_metrics`): the ``edmm_*`` samples; pages by state from ``edmm_kv_pages_total``,
``edmm_kv_pages_in_use``, ``edmm_kv_cached_pages`` and ``edmm_kv_host_bytes``
(`edmm.bench.agents.engine_io.pages_by_state`). vLLM (`parse_vllm_metrics`): the ``vllm:*``
samples summed over their label sets (one per engine), ``_total`` dropped; its prefix cache's
queries and hits (tokens; the connector's as ``external_prefix_cache_*`` where it reports
them), preemptions, prompt tokens, and its KV usage (``kv_cache_usage_perc``, older versions
``gpu_cache_usage_perc``: the blocks requests hold, cached free blocks not counted). vLLM says
nothing of paused KV nor of host copies: those cells stay empty for it.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from edmm.bench.agents.engine_io import pages_by_state

_METRIC_RE = re.compile(r'^(edmm_\w+?)(?:_total)?(?:\{([^}]*)\})?\s+(\S+)$')
_OUTCOME_RE = re.compile(r'outcome="(\w+)"')
_VLLM_RE = re.compile(r'^vllm:(\w+?)(?:_total)?(?:\{([^}]*)\})?\s+(\S+)$')
# /metrics counters kept per run (the change over the run) and the summary's names for them.
COUNTERS = {"edmm_recomputed_tokens": "lost_context_tokens", "edmm_kv_restores": "restores",
            "edmm_kv_offloads": "offloads", "edmm_preemptions": "preemptions",
            "edmm_speculated_tokens": "spec_tokens", "edmm_speculation_outcomes:hit": "spec_hit",
            "edmm_speculation_outcomes:partial": "spec_partial",
            "edmm_speculation_outcomes:miss": "spec_miss",
            "edmm_speculation_gated": "spec_gated", "edmm_speculation_in_place": "spec_in_place",
            "edmm_session_resumes": "server_resumes", "edmm_engine_steps": "engine_steps",
            "edmm_admission_memory_waits": "memory_wait_steps"}
VLLM_COUNTERS = {"prefix_cache_queries": "server_prefix_queries",
                 "prefix_cache_hits": "server_prefix_hits",
                 "external_prefix_cache_queries": "external_prefix_queries",
                 "external_prefix_cache_hits": "external_prefix_hits",
                 "num_preemptions": "preemptions", "prompt_tokens": "server_prompt_tokens"}


def parse_metrics(text: str) -> dict[str, float]:
    """``edmm_*`` samples of a Prometheus text page: ``name`` (``_total`` dropped), with
    ``:outcome`` for the speculation outcomes."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC_RE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        outcome = _OUTCOME_RE.search(labels)
        out[f"{name}:{outcome.group(1)}" if outcome else name] = float(value)
    return out


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """``vllm:*`` samples (counters and gauges; histograms' ``_sum`` / ``_count`` as named),
    each summed over its label sets, ``_total`` dropped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _VLLM_RE.match(line)
        if m:
            try:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
            except ValueError:
                continue
    return out


def edmm_states(m: Mapping[str, float], page_bytes: int) -> dict[str, float]:
    """EDMM's KV pages by state from its parsed ``/metrics``."""
    total = int(m.get("edmm_kv_pages_total", 0))
    return {"pages_used": m.get("edmm_kv_pages_in_use", 0.0),
            **pages_by_state(total, int(m.get("edmm_kv_pages_in_use", 0)),
                             int(m.get("edmm_kv_cached_pages", 0)),
                             m.get("edmm_kv_host_bytes", 0.0), page_bytes)}


def vllm_states(m: Mapping[str, float]) -> dict[str, float]:
    """vLLM's KV usage (0-1) and its running and waiting requests."""
    usage = m.get("kv_cache_usage_perc", m.get("gpu_cache_usage_perc"))
    return {k: v for k, v in (("kv_usage", usage),
                              ("requests_running", m.get("num_requests_running")),
                              ("requests_waiting", m.get("num_requests_waiting")))
            if v is not None}


def edmm_counters(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, int]:
    """The change of EDMM's counters over a run, by the summary's names."""
    return {v: int(after.get(k, 0.0) - before.get(k, 0.0)) for k, v in COUNTERS.items()}


def vllm_counters(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, Any]:
    """The change of vLLM's counters over a run, and its prefix-cache hit rates (None where
    it reports no queries)."""
    out: dict[str, Any] = {v: after[k] - before.get(k, 0.0) for k, v in VLLM_COUNTERS.items()
                           if k in after}
    for pre in ("server_prefix", "external_prefix"):
        q = out.get(f"{pre}_queries")
        out[f"{pre}_hit_rate"] = out[f"{pre}_hits"] / q if q else None
    return out


class Probe:
    """A server's ``/metrics`` (httpx), from the bench's own process."""

    def __init__(self, url: str, timeout: float) -> None:
        import httpx

        self.url = url
        self.http = httpx.Client(timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def text(self) -> str:
        """The ``/metrics`` page."""
        return self.http.get(f"{self.url}/metrics").text

    def metrics(self) -> dict[str, float]:
        """EDMM's ``/metrics``, parsed."""
        return parse_metrics(self.text())


class Sampler:
    """Reads ``/metrics`` every ``every_s`` until stopped: each sample is ``read`` of the
    page's text with ``t_s`` (seconds from the start, or from the last `restart`)."""

    def __init__(self, probe: Probe, every_s: float,
                 read: Callable[[str], dict[str, float]]) -> None:
        self.samples: list[dict[str, float]] = []
        self._probe, self._every, self._read = probe, every_s, read
        self._t0 = time.perf_counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            try:
                sample = self._read(self._probe.text())
            except Exception:  # a sample lost to a busy server: the next one counts
                continue
            with self._lock:
                self.samples.append({"t_s": time.perf_counter() - self._t0, **sample})

    def restart(self) -> None:
        """Drop the samples so far and count ``t_s`` from now (the run's clients are ready:
        what came before was their start-up, not the run)."""
        with self._lock:
            self.samples = []
            self._t0 = time.perf_counter()

    def stop(self) -> list[dict[str, float]]:
        self._stop.set()
        self._thread.join()
        return self.samples


__all__ = ["COUNTERS", "Probe", "Sampler", "edmm_counters", "edmm_states", "parse_metrics",
           "parse_vllm_metrics", "vllm_counters", "vllm_states"]
