"""Latency histograms of the requests the server answers: time to first token, inter-token
latency, end-to-end latency and queue time, as Prometheus histograms with vLLM's buckets.

Every engine request a client waits for is timed from the moment the server takes it up
(`edmm.server.engine_loop.OutputStream.created_ns`: a chat before its prompt is rendered, a
text completion once tokenized) by the outputs its consumer receives on the event loop:

- time to first token: to the first output with a token;
- inter-token latency: between outputs, divided among the tokens the later one adds (one
  observation per token, as vLLM counts them);
- end-to-end latency: to the last output;
- queue time: to the engine's first admission of the request (`RequestTiming`).

With ``vllm_names`` the same observations also go to vLLM's histograms
(``vllm:time_to_first_token_seconds`` ...; labels ``model_name`` and ``engine``), so that
dashboards made for vLLM read them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram

from edmm.engine import RequestOutput

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# (suffix of the name, description, buckets) of each histogram.
HISTOGRAMS = {
    "ttft": ("time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS),
    "itl": ("inter_token_latency_seconds", "Inter-token latency in seconds.", ITL_BUCKETS),
    "e2e": ("e2e_request_latency_seconds", "End-to-end request latency in seconds.",
            REQUEST_BUCKETS),
    "queue": ("request_queue_time_seconds", "Time from a request's start to its first "
              "admission by the engine, in seconds.", REQUEST_BUCKETS),
}
VLLM_ENGINE = "0"  # vLLM's ``engine`` label of a single engine


@dataclass
class RequestClock:
    """What one request's timing needs between its outputs (event loop only)."""

    start_ns: int
    seen: int = 0  # output tokens seen so far
    last_ns: int = 0  # when the previous output with tokens came


class LatencyMetrics:
    """The latency histograms of one server, in its ``registry`` (see the module
    docstring)."""

    def __init__(self, registry: CollectorRegistry, model_name: str,
                 vllm_names: bool = False) -> None:
        self._observers: dict[str, list[Histogram]] = {}
        for key, (suffix, doc, buckets) in HISTOGRAMS.items():
            edmm = Histogram(f"edmm_{suffix}", doc, ["model_name"], registry=registry,
                             buckets=buckets).labels(model_name)
            self._observers[key] = [edmm]
            if vllm_names:
                self._observers[key].append(
                    Histogram(f"vllm:{suffix}", doc, ["model_name", "engine"],
                              registry=registry, buckets=buckets).labels(model_name,
                                                                         VLLM_ENGINE))

    def _observe(self, key: str, seconds: float) -> None:
        for histogram in self._observers[key]:
            histogram.observe(seconds)

    def observe(self, clock: RequestClock, out: RequestOutput) -> None:
        """Account for ``out``, the request's latest output, arriving now."""
        now = time.time_ns()
        tokens = len(out.outputs[0].token_ids)
        new = tokens - clock.seen
        if new > 0:
            if clock.seen == 0:
                self._observe("ttft", (now - clock.start_ns) / 1e9)
                scheduled = out.timing.first_scheduled_ns if out.timing is not None else None
                if scheduled is not None:
                    self._observe("queue", max(scheduled - clock.start_ns, 0) / 1e9)
            else:
                gap = (now - clock.last_ns) / 1e9 / new
                for _ in range(new):
                    self._observe("itl", gap)
            clock.seen, clock.last_ns = tokens, now
        if out.finished:
            self._observe("e2e", (now - clock.start_ns) / 1e9)
