"""`SpeculationGate`: speculate a branch only where its expected saving exceeds its cost.

A speculation branch of a paused session saves, if the resume adopts it, the prefill of the
tokens it computed beyond the session's KV; it costs engine time whether or not it is used:

- the driver calls of the branch itself: mapping the session's full prefix pages into the
  branch's slot (`KVArena.branch`) and unmapping them when the branch is freed or committed
  away (per page: `AdoptionCost`'s measured map and unmap times); a speculation in place
  (the session's own slot extended, `KVCacheManager.lend`) maps none of them;
- the pages its new tokens map, wasted when it is not used (mapped, then unmapped by the
  truncation or eviction of a miss): counted at P(not used);
- the prefill of its tokens, unless they ride in the padding of CUDA-graph steps that compute
  that many tokens anyway (``padding_free``) or the engine has nothing else to run.

Expected saving = P(used) x new tokens x the cost of a token in a step. P(used) is estimated
per (speculation source, tool) (`edmm.agent.learning.UsageStats`), as a shrunk (hierarchical)
estimate: the other sessions' branches of that source for that tool give a pooled rate, with a
Beta prior of one use in two (``prior_hits`` in ``prior_resumes``), and that rate is the prior
of the session's own branches of the source for the tool, worth ``session_weight`` of them
(partials count half)::

    pooled = (others.used + prior_hits) / (others.total + prior_resumes)
    P(used) = (own.used + session_weight * pooled) / (own.total + session_weight)

Pooled because a session has too few resumes to move a prior (2-3 in a short job): what one
source guessed for one tool on the other sessions of an agent says more about the next branch
than the session's own count; per source and per tool because sources and tools differ (a
template prefix is almost always used, a predicted result of a flaky tool seldom), and a hit of
one must not lift another. Refined by the session's own because clients differ (one predicts
results well, another never): after ``session_weight`` resumes the session's own history
counts as much as the pool. With the defaults, with no history or only the session's own, this
is the per-session estimate with a prior of one hit in two resumes.
The gate is the one owner of this decision; the agent layer asks it before each branch
(`AgentEngine`), with the costs measured on this engine (`BranchPlan`): the seconds per token
of its steps (`edmm.engine.step_cost.StepCostModel`) and per page of its arena's maps and
unmaps (`KVArena.driver`). Until the engine has measured them the gate falls back to numbers
measured on an H200: ``PREFILL_TOKEN_S`` = 31 us (docs/design.md, qwen2.5-7b shapes, 16K cached
prefix: 512 new tokens 39 ms, 1 new token 23 ms: 16 ms / 511 tokens) and `AdoptionCost`'s
driver times (``edmm bench vmm``). The compute of a speculative token in a graph's padding is
counted as free: its attention over the session's context is not (not measured separately:
the ``edmm-no-gate`` policy measures the gate whole).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edmm.agent.learning import Outcomes
from edmm.engine.kv_policy import AdoptionCost

PREFILL_TOKEN_S = 16e-3 / 511  # docs/design.md, H200: (39 ms - 23 ms) / 511 tokens


@dataclass(frozen=True)
class BranchPlan:
    """What a speculation branch would do: ``new_tokens`` computed beyond the session's KV,
    on a branch mapping ``shared_pages`` pages of the session's prefix (0 in place) and
    ``new_pages`` pages of its own for the new tokens; and how the branches of its source for
    its tool fared before (``others``: on the other sessions; ``own``: on this one)."""

    new_tokens: int
    shared_pages: int
    others: Outcomes
    own: Outcomes
    engine_idle: bool  # no request waits or runs now: the prefill costs nothing else
    padding_free: bool  # the engine fills CUDA-graph padding with speculation
    token_s: float | None = None  # measured seconds per token of a step (None: not yet)
    page_s: tuple[float, float] | None = None  # measured map, unmap seconds per page
    new_pages: int = 0  # pages mapped for the new tokens (the boundary page's copy included)


@dataclass(frozen=True)
class SpeculationGate:
    """Expected saving against cost of a branch (module docstring); seconds of engine time."""

    prefill_token_s: float = PREFILL_TOKEN_S
    driver: AdoptionCost = field(default_factory=AdoptionCost)
    prior_hits: float = 1.0
    prior_resumes: float = 2.0
    session_weight: float = 2.0
    pool_sessions: bool = True  # False: the session's own history alone (``others`` ignored)

    def p_used(self, plan: BranchPlan) -> float:
        """The estimated probability that the branch is adopted (module docstring)."""
        others = plan.others if self.pool_sessions else Outcomes()
        own = plan.own
        pooled = (others.used + self.prior_hits) / (others.total + self.prior_resumes)
        return (own.used + self.session_weight * pooled) / (own.total + self.session_weight)

    def saving_s(self, plan: BranchPlan) -> float:
        """Expected prefill time saved at the resume."""
        return self.p_used(plan) * plan.new_tokens * self._token_s(plan)

    def cost_s(self, plan: BranchPlan) -> float:
        """Engine time the branch costs, used or not."""
        map_s, unmap_s = plan.page_s if plan.page_s is not None else (
            self.driver.map_page_us * 1e-6, self.driver.unmap_page_us * 1e-6)
        wasted = (1.0 - self.p_used(plan)) * plan.new_pages
        driver = (plan.shared_pages + wasted) * (map_s + unmap_s)
        free = plan.engine_idle or plan.padding_free
        return driver + (0.0 if free else plan.new_tokens * self._token_s(plan))

    def _token_s(self, plan: BranchPlan) -> float:
        return plan.token_s if plan.token_s is not None else self.prefill_token_s

    def pays(self, plan: BranchPlan) -> bool:
        """True when the expected saving exceeds the cost."""
        return plan.new_tokens > 0 and self.saving_s(plan) > self.cost_s(plan)
