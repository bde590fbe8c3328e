"""`StepCostModel`: what one more token costs a step, fitted online from the engine's steps.

Each step's host-measured seconds (`Engine.step`: the runner's launch to its tokens on the host)
are fitted against the step's scheduled tokens by least squares, with exponential forgetting so
the fit follows the current load: ``seconds ~ fixed + per_token * tokens``. The slope is the
marginal cost of a token in a step on this machine, model and batch mix (CUDA-graph steps are
padded, so it is the cost of the padded size growing with the tokens); the speculation gate
(`edmm.agent.gate`) weighs a branch's saving with it instead of a number measured elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepCostModel:
    """Online least-squares fit of step seconds against tokens (see the module docstring).

    ``decay``: weight kept by past steps at each new one; ``min_steps``: steps seen before a
    slope is given.
    """

    decay: float = 0.99
    min_steps: int = 16
    steps: int = 0
    _w: float = 0.0
    _sx: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _sxy: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")

    def observe(self, tokens: int, seconds: float) -> None:
        """Add one step of ``tokens`` scheduled tokens that took ``seconds``."""
        d = self.decay
        self._w = self._w * d + 1.0
        self._sx = self._sx * d + tokens
        self._sy = self._sy * d + seconds
        self._sxx = self._sxx * d + tokens * tokens
        self._sxy = self._sxy * d + tokens * seconds
        self.steps += 1

    def per_token_s(self) -> float | None:
        """Seconds one more token adds to a step; None before ``min_steps`` steps, while the
        steps' token counts do not vary, or if the fit is not positive."""
        if self.steps < self.min_steps:
            return None
        var = self._w * self._sxx - self._sx * self._sx
        if var <= 1e-9 * max(self._w * self._sxx, 1.0):
            return None
        slope = (self._w * self._sxy - self._sx * self._sy) / var
        return slope if slope > 0 else None


@dataclass(frozen=True)
class StepShape:
    """What one engine step computed: per scheduled sequence, the tokens it computed
    (``query_lens``) and the tokens with KV after the step (``context_lens``); the tokens'
    worth of host KV seen copied back while it was scheduled (``restored_tokens``: with
    synchronous copies, the restores its admissions waited for) and the seconds it took
    (measured, or modelled by `StepTimeModel`); of the tokens, those of speculative prefills
    (``speculative_tokens``)."""

    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    restored_tokens: float = 0.0
    seconds: float = 0.0
    speculative_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens computed in the step."""
        return sum(self.query_lens)


@dataclass(frozen=True)
class StepTimeModel:
    """Modelled seconds of an engine step on a GPU, for replaying workloads on a machine
    without that GPU (`edmm bench agents --clock model`): the policies' decisions then play out
    at that GPU's speeds, deterministically, while the tiny model still computes every token.

    ``seconds = max(fixed_s, token_s * tokens) + pair_s * prefill (query, key) pairs
    + kv_token_s * context tokens of decode rows + restore_token_s * restored tokens``:
    a decode step streams the weights (``fixed_s``) until the matmuls' FLOPs take longer; a
    prefill row's attention is FLOP-bound (pairs of a causal chunk: ``q * (context - q / 2)``),
    a decode row's reads its KV. Not a measurement: what a modelled run reports shows how the
    policies behave at those speeds; every quoted result comes from a real clock.
    """

    fixed_s: float
    token_s: float
    pair_s: float
    kv_token_s: float
    restore_token_s: float

    def __call__(self, shape: StepShape) -> float:
        """The modelled seconds of ``shape``."""
        pairs = kv = 0.0
        for q, ctx in zip(shape.query_lens, shape.context_lens, strict=True):
            if q == 1:
                kv += ctx
            else:
                pairs += q * (ctx - q / 2)
        return (max(self.fixed_s, self.token_s * shape.num_tokens) + self.pair_s * pairs
                + self.kv_token_s * kv + self.restore_token_s * shape.restored_tokens)

    @classmethod
    def fit(cls, *, context: int, decode_s: float, kv_token_s: float, cached_new: int,
            cached_s: float, full_s: float, full_chunk: int, kv_bytes_per_token: int,
            restore_bytes_per_s: float) -> StepTimeModel:
        """Solve the coefficients from measured points at one ``context``: a batch-1 decode
        step (``decode_s``), the KV read time per context token of a batched decode row
        (``kv_token_s``), ``cached_new`` tokens on a cached prefix of ``context`` tokens
        (``cached_s``), a full prefill of ``context`` tokens in chunks of ``full_chunk``
        (``full_s``), restores' bandwidth for KV of ``kv_bytes_per_token``. Both prefill
        points must be FLOP-bound (their matmuls take longer than a decode step's weights)."""
        chunks = [(min(full_chunk, context - s), s) for s in range(0, context, full_chunk)]
        full_pairs = sum(q * (s + q - q / 2) for q, s in chunks)
        cached_pairs = cached_new * (context + cached_new - cached_new / 2)
        # cached_s = cached_new * T + cached_pairs * P;  full_s = context * T + full_pairs * P
        det = cached_new * full_pairs - context * cached_pairs
        token_s = (cached_s * full_pairs - full_s * cached_pairs) / det
        pair_s = (cached_new * full_s - context * cached_s) / det
        fixed_s = decode_s - kv_token_s * context
        if min(token_s, pair_s, fixed_s) <= 0 or token_s * min(cached_new, full_chunk) < fixed_s:
            raise ValueError("the measured points do not fit the model (a coefficient <= 0, "
                             "or a prefill point not FLOP-bound)")
        return cls(fixed_s=fixed_s, token_s=token_s, pair_s=pair_s, kv_token_s=kv_token_s,
                   restore_token_s=kv_bytes_per_token / restore_bytes_per_s)


H200_QWEN7B = StepTimeModel.fit(
    # `edmm bench ttft --only model` on an H200 (qwen2.5-7b, bf16, Triton): decode step
    # 4.874 ms, 512 tokens on a cached 16K prefix 19.12 ms, full prefill 464.0 ms in 2048-token
    # chunks; decode attention at batch 8 / 16K 66.3 us a layer x 28 layers; host restores
    # 50.6 GiB/s.
    context=16384, decode_s=4.874e-3, kv_token_s=28 * 66.3e-6 / (8 * 16384), cached_new=512,
    cached_s=19.12e-3, full_s=464.0e-3, full_chunk=2048,
    kv_bytes_per_token=28 * 2 * 4 * 128 * 2,  # layers x (K, V) x KV heads x head dim x bf16
    restore_bytes_per_s=50.6 * 2**30)
"""The H200 step-time model (qwen2.5-7b shapes) the agent bench's ``--clock model`` uses."""

STEP_TIME_MODELS = {"h200-qwen2.5-7b": H200_QWEN7B}
