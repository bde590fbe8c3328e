"""The KV policies the agent-workload bench compares, as registry entries.

Each `Policy` is a set of mechanisms mapped onto the engine's own switches: a retention policy
(`edmm.agent.retention`), KV offload to host memory (`EngineConfig.kv_offload_bytes`), how cached
KV is evicted and what goes to the host (`EngineConfig.kv_cache_policy`), prefetch
of offloaded KV before the predicted return (`AgentConfig.prefetch`), speculation sources
(`edmm.agent.speculation`), the admission order of waiting turns (`AgentConfig.admission`),
and the client-side re-warm of the known history. Named after
what users run today:

- ``lru``: a paused session's KV is an ordinary prefix-cache entry, evicted tail-first, page by
  page, as many pages as a request lacks, so shared prefixes stay (vLLM's automatic prefix
  caching frees a finished request's blocks from the tail; SGLang's radix cache its leaves);
  no speculation. This is EDMM off.
- ``ttl``: kept for the tool's expected time, then ordinary, with program-level first come,
  first served admission (Continuum: a session's turns are admitted in the order the sessions
  started).
- ``offload``: LMCache / vLLM's offloading connector on ``lru``'s eviction: every block of
  KV is written through to host memory as it is computed, once (hash-deduplicated: a prefix
  that sessions share is held once), and kept there after it is loaded back; whatever an
  eviction removes (a preempted turn's KV too) is on the host, and every admission loads from
  it the blocks the GPU lacks (a resume, a preempted turn, a new session on a shared prefix)
  instead of recomputing them; paused sessions are kept like any entry; no prediction.
- ``rewarm``: shortly before the tool is expected back the known history is prefilled again as
  an ordinary 1-token request (Dynamo's speculative prefill); nothing more.
- ``edmm``: cost-based retention + offload + prefetch + template, streamed and predicted
  speculation, each branch gated on its expected saving (`edmm.agent.gate`), program-level
  first come, first served admission (+ the zero-copy commit the engine always does), over
  ``offload``'s host tier: paused sessions go to the host and come back by session (prefetched
  before the tool's expected return), everything else an eviction takes goes to the host by
  block and comes back at admission (a session waiting for its user, a preempted turn; the
  ``tiered`` cache policy).

``edmm-no-<mechanism>`` is ``edmm`` with one mechanism off (``retention``: LRU instead of the
cost policy; ``offload``, ``prefetch``, ``template``, ``streamed``, ``predicted``; ``gate``:
every branch a source offers; ``admission``: each turn admitted in its own arrival order;
``inplace``: every speculation in a branch, none in the session's own slot; ``learned``: no
tool durations learned, only declared ones; ``pooled``: the gate's P(used) from the session's
own branches alone, not pooled across sessions per source and tool).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from edmm.agent.gate import SpeculationGate
from edmm.agent.registry import Registry
from edmm.agent.types import AgentConfig

MECHANISMS = ("retention", "offload", "prefetch", "template", "streamed", "predicted", "gate",
              "admission", "inplace", "learned", "pooled")


@dataclass(frozen=True)
class Policy:
    """One policy's mechanisms (see the module docstring)."""

    name: str
    description: str
    retention: str = "lru"  # a name of edmm.agent.retention.RETENTION_POLICIES
    offload: bool = False  # evicted paused sessions go to host memory
    cache: str = "sessions"  # eviction and host tier (`edmm.engine.kv_policy.CACHE_POLICIES`)
    prefetch: bool = False  # offloaded KV comes back before the predicted return
    template: bool = False  # the known next prompt up to the tool result is speculated
    streamed: bool = False  # streamed tool output is prefilled as it arrives
    predicted: bool = False  # predicted and memoised results are speculated
    rewarm: bool = False  # the client re-sends the known history ahead of the resume
    gate: bool = False  # a branch only where its expected saving exceeds its cost
    admission: str = "arrival"  # order of waiting turns (`edmm.agent.types.ADMISSION_ORDERS`)
    inplace: bool = True  # a speculation continuing the session's KV extends its own slot
    learned: bool = True  # tool durations learned from the windows seen
    pooled: bool = True  # the gate pools branch outcomes across sessions per source and tool

    @property
    def speculation(self) -> tuple[str, ...]:
        """Speculation sources to run (``prompt`` carries the template's head when the
        template rewrites earlier tokens, and whole predicted prompts)."""
        names: list[str] = []
        if self.template:
            names.append("template")
        if self.streamed:
            names.append("streamed")
        if self.predicted:
            names.append("predicted")
        if self.template or self.predicted:
            names.append("prompt")
        return tuple(names)

    def agent_config(self, tool_timeout_s: float, prefetch_lead_s: float) -> AgentConfig:
        """The agent-layer config of this policy."""
        return AgentConfig(speculation=self.speculation, retention=self.retention,
                           tool_timeout_s=tool_timeout_s, prefetch_lead_s=prefetch_lead_s,
                           prefetch=self.prefetch,
                           speculation_gate=(SpeculationGate(pool_sessions=self.pooled)
                                             if self.gate else None),
                           speculate_in_place=self.inplace,
                           learn_tool_durations=self.learned, admission=self.admission)


POLICIES: Registry[Policy] = Registry("bench policy")

_BASE = {
    "lru": Policy("lru", "paused KV is a plain LRU cache entry, evicted tail-first "
                  "(vLLM APC; EDMM off)", cache="apc"),
    "ttl": Policy("ttl", "paused KV kept for the tool's expected time, then LRU; "
                  "turns in session order (Continuum)", retention="ttl", admission="program"),
    "offload": Policy("offload", "every block written through to host once, what the GPU "
                      "lacks loaded back at admission (LMCache, vLLM offloading connector)",
                      retention="keep", offload=True, cache="blocks"),
    "rewarm": Policy("rewarm", "known history prefilled again before the resume",
                     rewarm=True),
    "edmm": Policy("edmm", "cost retention + offload + prefetch + speculation; turns in "
                   "session order", retention="cost", offload=True, prefetch=True,
                   template=True, streamed=True, predicted=True, gate=True, admission="program",
                   cache="tiered"),
}


def _without(mechanism: str) -> Policy:
    """``edmm`` with one mechanism off (no offload: no prefetch either)."""
    edmm = _BASE["edmm"]
    name, what = f"edmm-no-{mechanism}", f"edmm without {mechanism}"
    if mechanism == "retention":
        return dataclasses.replace(edmm, name=name, description=what, retention="lru")
    if mechanism == "admission":
        return dataclasses.replace(edmm, name=name, description=what, admission="arrival")
    if mechanism == "offload":
        return dataclasses.replace(edmm, name=name, description=what, offload=False,
                                   prefetch=False)
    off: dict[str, bool] = {mechanism: False}
    return dataclasses.replace(edmm, name=name, description=what, **off)  # type: ignore[arg-type]


def _constant(policy: Policy) -> Callable[[], Policy]:
    return lambda: policy


for _policy in _BASE.values():
    POLICIES.register(_policy.name)(_constant(_policy))
for _mech in MECHANISMS:
    POLICIES.register(f"edmm-no-{_mech}")(_constant(_without(_mech)))

BASELINES = ("lru", "ttl", "offload", "rewarm")
