"""Prometheus metrics: one registry per app, filled from a snapshot taken on the engine thread.

Engine-side values (KV pages, session states, speculation outcomes, prefix hits, what each
client holds) are read when ``/metrics`` is scraped, in one call on the engine thread, so they
are consistent with each other; request counters kept by the HTTP layer live in
`RequestCounters`, its latency histograms in `edmm.server.latency`. Per-client series carry a
``key`` label: the owner's name (`edmm.server.sessions.owner_of`, a hash of its API key, or
``anonymous``), for the clients that hold sessions. With ``vllm_names`` the page also carries
vLLM's names of the same values (``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``,
``vllm:prefix_cache_hits_total`` ..., labels ``model_name`` and ``engine``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from edmm.agent import AgentStats, OwnerStats, SessionState
from edmm.engine import EngineStats
from edmm.server.latency import VLLM_ENGINE, LatencyMetrics
from edmm.server.sessions import ServerSessions

SPECULATION_OUTCOMES = ("hit", "partial", "miss")
# vLLM's finish reasons of vllm:request_success (a reply with tool calls stopped).
VLLM_REASONS = {"stop": "stop", "length": "length", "tool_calls": "stop", "abort": "abort"}


@dataclass
class RequestCounters:
    """Counters of the HTTP layer (event-loop thread only); ``latency``: its histograms."""

    finished: Counter[str] = field(default_factory=Counter)  # by finish reason
    generation_tokens: int = 0
    latency: LatencyMetrics | None = None


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine-side values at one instant (built on the engine thread)."""

    engine: EngineStats
    sessions: AgentStats
    num_steps: int
    num_running: int  # requests with a listener, not finished
    owners: dict[str | None, OwnerStats] = field(default_factory=dict)

    @classmethod
    def take(cls, sessions: ServerSessions, num_steps: int, num_running: int) -> EngineSnapshot:
        """The engine's and the agent layer's snapshots (call on the engine thread)."""
        agent = sessions.agent
        return cls(sessions.engine.stats(), agent.stats(), num_steps, num_running,
                   agent.owner_stats())


class ServerMetrics(Collector):
    """The app's registry and the collector that renders a snapshot into it."""

    def __init__(self, model_name: str, vllm_names: bool = False) -> None:
        self.model_name = model_name
        self.vllm_names = vllm_names
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self.requests = RequestCounters(
            latency=LatencyMetrics(self.registry, model_name, vllm_names))
        self._snapshot: EngineSnapshot | None = None

    def render(self, snapshot: EngineSnapshot) -> bytes:
        """The Prometheus text exposition of ``snapshot`` and the request counters."""
        self._snapshot = snapshot
        return generate_latest(self.registry)

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        snap = self._snapshot
        if snap is None:
            return
        yield from self._token_metrics(snap.engine, snap.sessions)
        yield from self._session_metrics(snap.sessions)
        yield from self._engine_metrics(snap)
        yield from self._request_metrics(snap)
        yield from self._key_metrics(snap.owners)
        if self.vllm_names:
            yield from self._vllm_metrics(snap)

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric([self.model_name], value)
        return c

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric([self.model_name], value)
        return g

    def _token_metrics(self, e: EngineStats, s: AgentStats) -> Iterator[CounterMetricFamily]:
        yield self._counter("edmm_prompt_tokens", "Prompt tokens of finished requests.",
                            e.prompt_tokens)
        yield self._counter("edmm_prefix_hit_tokens",
                            "Prompt tokens whose KV was reused (prefix cache, retained or "
                            "speculated KV) instead of computed.", e.prompt_tokens_reused)
        yield self._counter("edmm_recomputed_tokens",
                            "Tokens a session had already computed in an earlier turn and "
                            "that were computed again.", s.context_tokens_recomputed)
        yield self._counter("edmm_speculated_tokens",
                            "Tokens prefilled speculatively during tool windows.",
                            e.speculation_tokens_computed)

    def _session_metrics(self, s: AgentStats,
                         ) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        spec = CounterMetricFamily("edmm_speculation_outcomes",
                                   "Resumes by speculation outcome.",
                                   labels=["model_name", "outcome"])
        counts = {"hit": s.spec_hits, "partial": s.spec_partial, "miss": s.spec_misses}
        for outcome in SPECULATION_OUTCOMES:
            spec.add_metric([self.model_name, outcome], counts[outcome])
        yield spec
        yield self._counter("edmm_speculation_gated", "Speculations not started: the gate "
                            "expected them not to pay for their prefill and mapping.",
                            s.spec_gated)
        yield self._counter("edmm_speculation_in_place", "Speculations prefilled in the "
                            "session's own slot (no branch).", s.spec_in_place)
        yield self._counter("edmm_session_resumes", "Turns that resumed a session awaiting "
                            "tool results.", s.resumes)
        states = GaugeMetricFamily("edmm_sessions", "Sessions known to the server, by state.",
                                   labels=["model_name", "state"])
        for state in SessionState:
            name = state.name.lower()
            states.add_metric([self.model_name, name], s.sessions.get(name, 0))
        yield states

    def _engine_metrics(self, snap: EngineSnapshot) -> Iterator[CounterMetricFamily |
                                                                GaugeMetricFamily]:
        kv = snap.engine.kv
        yield self._gauge("edmm_kv_pages_in_use", "Physical KV pages mapped.", kv.pages_in_use)
        yield self._gauge("edmm_kv_pages_total", "Physical KV pages in the pool.",
                          kv.pages_total)
        yield self._gauge("edmm_kv_cached_pages", "KV pages held by prefix-cache entries.",
                          kv.cached_pages)
        yield self._gauge("edmm_kv_pages_shared", "KV pages mapped by more than one slot "
                          "(a shared prefix).", kv.pages_shared)
        yield self._gauge("edmm_kv_pages_private", "KV pages mapped by one slot only.",
                          kv.pages_private)
        yield self._counter("edmm_kv_offloads", "Paused sessions' KV copied to host memory.",
                            kv.offloads)
        yield self._counter("edmm_kv_restores", "Host copies of KV brought back.",
                            kv.restores)
        yield self._gauge("edmm_kv_host_bytes", "Host memory held by offloaded KV.",
                          kv.offload_bytes)
        yield self._counter("edmm_prefix_spares_made", "Spare branches of a prefix that "
                            "requests kept branching from, mapped during a step.",
                            kv.spares_made)
        yield self._counter("edmm_prefix_spares_used", "Admissions that adopted a spare (no "
                            "page mapped for the prefix then).", kv.spares_used)
        yield self._counter("edmm_engine_steps", "Engine steps run.", snap.num_steps)
        yield self._counter("edmm_preemptions", "Sequences preempted for memory.",
                            snap.engine.num_preemptions)
        yield self._counter("edmm_admission_memory_waits",
                            "Engine steps in which a waiting request could not be admitted "
                            "for lack of KV memory.", snap.engine.memory_wait_steps)

    def _request_metrics(self, snap: EngineSnapshot,
                         ) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        r = self.requests
        yield self._gauge("edmm_requests_running", "Requests queued or running.",
                          snap.num_running)
        yield self._counter("edmm_generation_tokens", "Tokens generated.", r.generation_tokens)
        finished = CounterMetricFamily("edmm_requests_finished", "Finished requests by reason.",
                                       labels=["model_name", "finish_reason"])
        for reason in ("stop", "length", "tool_calls", "abort"):
            finished.add_metric([self.model_name, reason], r.finished.get(reason, 0))
        yield finished

    def _vllm_metrics(self, snap: EngineSnapshot,
                      ) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """The snapshot under vLLM's names (its histograms: `LatencyMetrics`)."""
        labels, values = ["model_name", "engine"], [self.model_name, VLLM_ENGINE]
        e, kv = snap.engine, snap.engine.kv

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge("vllm:num_requests_running", "Requests in the engine's batches.",
                    e.requests_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting for admission.",
                    e.requests_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    kv.pages_in_use / kv.pages_total if kv.pages_total else 0.0)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in prompt tokens.",
                      e.prompt_tokens)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in cached tokens.",
                      e.prompt_tokens_reused)
        yield counter("vllm:num_preemptions", "Preemptions by the engine.", e.num_preemptions)
        yield counter("vllm:prompt_tokens", "Prompt tokens of finished requests.",
                      e.prompt_tokens)
        yield counter("vllm:generation_tokens", "Generated tokens.",
                      self.requests.generation_tokens)
        success = CounterMetricFamily("vllm:request_success", "Finished requests by reason.",
                                      labels=[*labels, "finished_reason"])
        reasons: Counter[str] = Counter()
        for reason, count in self.requests.finished.items():
            reasons[VLLM_REASONS.get(reason, reason)] += count
        for reason in ("stop", "length", "abort"):
            success.add_metric([*values, reason], reasons.get(reason, 0))
        yield success

    def _key_metrics(self, owners: dict[str | None, OwnerStats],
                     ) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        labels = ["model_name", "key"]
        sessions = GaugeMetricFamily("edmm_key_sessions", "Live sessions of a client.",
                                     labels=labels)
        awaiting = GaugeMetricFamily("edmm_key_awaiting_sessions",
                                     "Sessions of a client awaiting tool results.",
                                     labels=labels)
        pages = GaugeMetricFamily("edmm_key_kv_pages", "KV pages a client holds: retained "
                                  "by its paused sessions and its running turns' prompts.",
                                  labels=labels)
        refused = CounterMetricFamily("edmm_key_quota_refusals",
                                      "Turns of a client refused (429) by a quota.",
                                      labels=[*labels, "quota"])
        for owner, stats in owners.items():
            key = [self.model_name, "none" if owner is None else owner]
            sessions.add_metric(key, stats.sessions)
            awaiting.add_metric(key, stats.awaiting)
            pages.add_metric(key, stats.kv_pages)
            for quota, count in stats.refused.items():
                refused.add_metric([*key, quota], count)
        yield from (sessions, awaiting, pages, refused)
