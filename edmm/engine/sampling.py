"""Sampling parameters, stop logic and the batched next-token sampler.

Names follow vLLM's ``SamplingParams``. Each request keeps its own
:class:`RequestRng`, so a seeded request draws the same tokens whatever other
requests share its batch and wherever it sits in that batch.

Sampling uses the exponential race: ``argmax(probs / q)`` with
``q ~ Exp(1)`` i.i.d. picks token ``i`` with probability ``probs[i]``. It is
exact, needs no ``torch.multinomial`` (no host sync) and draws exactly ``V``
random numbers per sampled row and step, whatever the filters keep.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

# Temperatures below this are treated as greedy (as in vLLM): dividing by a
# tiny temperature overflows float32 logits.
GREEDY_EPS = 1e-5

# torch.Generator.manual_seed accepts exactly this range.
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1


class InvalidSamplingParams(ValueError):
    """A :class:`SamplingParams` field holds a value that is out of range or unsupported."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


class SamplerError(ValueError):
    """The sampler was called with inconsistent inputs (shapes, counts, devices, seeds)."""


LogitsProcessor = Callable[[Sequence[int], torch.Tensor], torch.Tensor]
"""``(output_token_ids, logits) -> logits``: a per-request hook run before each sampled token.

``output_token_ids`` are the tokens generated so far (empty before the first); ``logits`` is the
float32 ``[V]`` row of the token about to be sampled. The processor returns that row changed (it
may change it in place), e.g. with disallowed tokens set to ``-inf`` (grammar-constrained
decoding). A stateful processor belongs to one request: do not share it between requests.
"""


class FinishReason(str, enum.Enum):
    """Why a request stopped generating (OpenAI / vLLM wording)."""

    STOP = "stop"  # EOS or a stop token / stop string
    LENGTH = "length"  # max_tokens reached


@dataclass
class SamplingParams:
    """Per-request sampling settings (vLLM names).

    ``temperature == 0`` (below :data:`GREEDY_EPS`) means greedy; greedy
    requests ignore ``top_p``, ``top_k`` and ``seed``. ``top_k`` of ``-1`` or
    ``0`` disables top-k. ``stop`` strings are only carried here: the
    detokenizing layer applies them with :func:`truncate_at_stop`.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logits_processors: list[LogitsProcessor] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.stop_token_ids = list(self.stop_token_ids)
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        self.logits_processors = list(self.logits_processors)
        self._check_counts()
        self._check_filters()
        self._check_stops()

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax of the logits."""
        return self.temperature < GREEDY_EPS

    @property
    def top_k_enabled(self) -> bool:
        """True when top-k filtering applies (``top_k >= 1``)."""
        return self.top_k > 0

    def _check_counts(self) -> None:
        if _not_int(self.n) or self.n < 1:
            raise InvalidSamplingParams("n", f"must be an integer >= 1, got {self.n!r}")
        if self.n != 1:
            raise InvalidSamplingParams("n", f"only n=1 is supported, got {self.n}")
        if _not_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidSamplingParams(
                "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}"
            )
        if _not_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidSamplingParams(
                "min_tokens",
                f"must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}",
            )
        seed = self.seed
        if seed is not None and (_not_int(seed) or not _SEED_MIN <= seed <= _SEED_MAX):
            raise InvalidSamplingParams(
                "seed", f"must be None or an integer in [-2**63, 2**64), got {self.seed!r}"
            )

    def _check_filters(self) -> None:
        if not _is_real(self.temperature) or self.temperature < 0:
            raise InvalidSamplingParams(
                "temperature", f"must be a finite number >= 0, got {self.temperature!r}"
            )
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidSamplingParams("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if _not_int(self.top_k) or self.top_k < -1:
            raise InvalidSamplingParams(
                "top_k", f"must be -1 or 0 (disabled) or an integer >= 1, got {self.top_k!r}"
            )

    def _check_stops(self) -> None:
        for tok in self.stop_token_ids:
            if _not_int(tok) or tok < 0:
                raise InvalidSamplingParams(
                    "stop_token_ids", f"must hold integers >= 0, got {tok!r}"
                )
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidSamplingParams("stop", f"must hold non-empty strings, got {s!r}")
        for proc in self.logits_processors:
            if not callable(proc):
                raise InvalidSamplingParams(
                    "logits_processors", f"must hold callables, got {proc!r}")


def _not_int(x: object) -> bool:
    return isinstance(x, bool) or not isinstance(x, int)


def _is_real(x: object) -> bool:
    if isinstance(x, bool):
        return False
    return isinstance(x, int) or (isinstance(x, float) and math.isfinite(x))


def truncate_at_stop(
    text: str, stop: Sequence[str], search_from: int = 0
) -> tuple[str, str | None]:
    """Cut ``text`` before the earliest occurrence of any stop string.

    Returns ``(text[:start], matched)`` for the occurrence with the smallest
    start index (ties go to the first string in ``stop``), or ``(text, None)``
    when none occurs. The stop string is not part of the returned text.
    ``search_from`` skips the head of ``text`` already checked by an earlier
    call; pass ``len(old_text) - max(map(len, stop)) + 1`` when streaming.
    """
    best: tuple[int, str] | None = None
    start_at = max(0, search_from)
    for s in stop:
        if not s:
            continue
        i = text.find(s, start_at)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    if best is None:
        return text, None
    return text[: best[0]], best[1]


def is_stop(
    token_id: int,
    num_generated: int,
    params: SamplingParams,
    eos_ids: Collection[int],
) -> FinishReason | None:
    """Decide whether a request finishes after emitting ``token_id``.

    ``num_generated`` counts the output tokens including ``token_id``.
    EOS (unless ``ignore_eos``) and ``stop_token_ids`` give ``STOP`` once
    ``min_tokens`` tokens exist; otherwise ``LENGTH`` at ``max_tokens``. When
    both apply to the same token, ``STOP`` wins: the model chose to end.
    """
    if num_generated >= params.min_tokens:
        if token_id in params.stop_token_ids:
            return FinishReason.STOP
        if not params.ignore_eos and token_id in eos_ids:
            return FinishReason.STOP
    if num_generated >= params.max_tokens:
        return FinishReason.LENGTH
    return None


class LogitsBatch(Protocol):
    """Applies several rows' logits processors of one kind in one pass: a processor offers
    one as its ``batch`` attribute, and the processors of one step that share it are applied
    together (e.g. grammar masks: one host-to-device copy for all rows instead of one each)."""

    def apply(self, procs: Sequence[Any], outputs: Sequence[Sequence[int]],
              logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ``[k, V]`` of ``procs``' rows processed (``outputs``: each row's
        generated tokens)."""
        ...


def apply_logits_processors(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Run each row's ``logits_processors`` on it, in their order; at each place in that
    order the processors that share a ``batch`` (`LogitsBatch`) run in one call.

    Args:
        logits: ``[B, V]`` float32 logits (changed in place for rows with processors).
        params: ``B`` sampling params.
        output_token_ids: ``B`` lists of the tokens each row's request generated so far.

    Returns:
        ``logits`` ``[B, V]``.
    """
    depth = max((len(p.logits_processors) for p in params), default=0)
    for j in range(depth):
        groups: dict[int, tuple[LogitsBatch, list[int]]] = {}
        for i, p in enumerate(params):
            if j >= len(p.logits_processors):
                continue
            proc = p.logits_processors[j]
            batch = getattr(proc, "batch", None)
            if batch is None:
                logits[i] = proc(output_token_ids[i], logits[i])  # [V]
            else:
                groups.setdefault(id(batch), (batch, []))[1].append(i)
        for batch, rows in groups.values():
            procs = [params[i].logits_processors[j] for i in rows]
            outputs = [output_token_ids[i] for i in rows]
            if rows == list(range(rows[0], rows[0] + len(rows))):  # a slice: no copies
                sl = slice(rows[0], rows[0] + len(rows))
                logits[sl] = batch.apply(procs, outputs, logits[sl])
            else:
                idx = torch.tensor(rows, device=logits.device)  # [k]
                logits[idx] = batch.apply(procs, outputs, logits[idx])
    return logits


class RequestRng:
    """Random state of one request; the caller keeps it for the request's lifetime.

    A seeded request owns a ``torch.Generator`` seeded with ``seed``, created
    on the logits' device at the first sampled step. An unseeded request
    (``seed is None``) draws from the :class:`Sampler`'s shared stream.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed
        self._generator: torch.Generator | None = None

    @classmethod
    def for_params(cls, params: SamplingParams) -> RequestRng:
        """Create the random state matching ``params.seed``."""
        return cls(params.seed)

    def generator(self, device: torch.device) -> torch.Generator:
        """Return this request's generator, creating it on ``device`` on first use."""
        if self.seed is None:
            raise SamplerError("unseeded RequestRng has no generator of its own")
        if self._generator is None:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
        elif self._generator.device != device:
            raise SamplerError(
                f"seeded request moved from {self._generator.device} to {device}; "
                "its random stream cannot follow"
            )
        return self._generator


class Sampler:
    """Batched next-token sampler: greedy, temperature, top-k, top-p.

    Holds one generator (per device) for unseeded requests; ``seed`` makes
    that shared stream reproducible (tests, benchmarks).
    """

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        rngs: Sequence[RequestRng],
    ) -> torch.Tensor:
        """Alias of :meth:`sample`."""
        return self.sample(logits, params, rngs)

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        rngs: Sequence[RequestRng],
    ) -> torch.Tensor:
        """Pick the next token of each row.

        Args:
            logits: ``[B, V]`` last-position logits (upcast to float32).
            params: ``B`` sampling params, one per row.
            rngs: ``B`` per-request random states, ``rngs[i].seed == params[i].seed``.

        Returns:
            ``[B]`` int64 token ids on ``logits.device``.
        """
        _check_inputs(logits, params, rngs)
        logits = logits.float()  # [B, V]
        tokens = logits.argmax(dim=-1)  # [B] int64; first max on ties
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return tokens
        sub_params = [params[i] for i in rows]
        probs = _filtered_probs(logits[rows], sub_params)  # [b, V]
        q = self._exponentials(probs, [rngs[i] for i in rows])  # [b, V]
        tokens[rows] = (probs / q).argmax(dim=-1)  # [b]
        return tokens

    def _exponentials(self, probs: torch.Tensor, rngs: Sequence[RequestRng]) -> torch.Tensor:
        """Draw ``Exp(1)`` noise ``[b, V]``: one row per request from its own stream."""
        device = probs.device
        q = torch.empty_like(probs)  # [b, V]
        if any(r.seed is None for r in rngs):
            q.exponential_(generator=self._shared_generator(device))
        for i, r in enumerate(rngs):
            if r.seed is not None:
                q[i].exponential_(generator=r.generator(device))
        # exponential_ may return 0 on some backends; keep probs / q finite.
        return q.clamp_min_(torch.finfo(q.dtype).tiny)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        gen = self._shared.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._shared[device] = gen
        return gen


def _check_inputs(
    logits: torch.Tensor, params: Sequence[SamplingParams], rngs: Sequence[RequestRng]
) -> None:
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise SamplerError(f"logits must be [B, V] with V >= 1, got {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise SamplerError(f"logits must be floating point, got {logits.dtype}")
    if not len(params) == len(rngs) == logits.shape[0]:
        raise SamplerError(
            f"batch mismatch: logits {logits.shape[0]} rows, {len(params)} params, {len(rngs)} rngs"
        )
    for i, (p, r) in enumerate(zip(params, rngs, strict=True)):
        if p.seed != r.seed:
            raise SamplerError(f"row {i}: params.seed={p.seed} but rng.seed={r.seed}")


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Apply temperature, then top-k, then top-p; return probabilities.

    Args:
        logits: ``[b, V]`` float32 logits of the non-greedy rows.
        params: ``b`` params.

    Returns:
        ``[b, V]`` float32 probabilities in vocabulary order. Rows without
        filters get exactly ``softmax(logits / temperature)`` whatever the other
        rows ask for, which keeps seeded draws independent of the batch.
    """
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], device=device)  # [b]
    x = logits / temps[:, None]  # [b, V]
    vocab = x.shape[1]
    need_k = any(p.top_k_enabled and p.top_k < vocab for p in params)
    need_p = any(p.top_p < 1.0 for p in params)
    if need_k or need_p:
        # Stable: ties keep vocabulary order, so top_k=1 keeps argmax's token.
        sorted_x, order = x.sort(dim=-1, descending=True, stable=True)  # [b, V], [b, V]
        drop = torch.zeros_like(sorted_x, dtype=torch.bool)  # [b, V] in sorted order
        if need_k:
            drop |= _top_k_drop(sorted_x, params)
            sorted_x = sorted_x.masked_fill(drop, -math.inf)
        if need_p:
            drop |= _top_p_drop(sorted_x, params)
        vocab_drop = torch.empty_like(drop).scatter_(1, order, drop)  # [b, V] vocab order
        x = x.masked_fill(vocab_drop, -math.inf)
    return x.softmax(dim=-1)


def _top_k_drop(sorted_x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Mask ``[b, V]`` of the columns of descending-sorted logits beyond ``top_k``."""
    vocab = sorted_x.shape[1]
    ks = [min(p.top_k, vocab) if p.top_k_enabled else vocab for p in params]
    k = torch.tensor(ks, device=sorted_x.device)  # [b]
    rank = torch.arange(vocab, device=sorted_x.device)  # [V]
    return rank[None, :] >= k[:, None]


def _top_p_drop(sorted_x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Mask ``[b, V]`` outside the shortest sorted prefix with mass >= ``top_p``.

    A token stays while the mass of the tokens before it is below ``top_p``,
    so the first token (mass before it exactly 0) always stays. Rows with
    ``top_p == 1`` drop nothing: over a 150k vocabulary the float32 prefix
    sums pass 1.0 and would otherwise cut their tail.
    """
    ps = [p.top_p if p.top_p < 1.0 else math.inf for p in params]
    top_p = torch.tensor(ps, device=sorted_x.device)  # [b]
    probs = sorted_x.softmax(dim=-1)  # [b, V]
    mass_before = probs.cumsum(dim=-1) - probs  # [b, V] exclusive prefix sums
    return mass_before >= top_p[:, None]
