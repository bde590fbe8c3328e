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
