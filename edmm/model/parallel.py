"""Tensor parallelism of a `CausalLM` over the ranks of one process group (Megatron-style).

One rank holds a shard of every large weight; the small ones (norms, rotary caches, q/k norms)
are replicated:

- **column-parallel** projections (``qkv_proj``, ``gate_up_proj``) keep the output rows of this
  rank's heads / intermediate columns; they are plain `Projection` modules (their outputs stay
  sharded, no communication);
- **row-parallel** projections (`RowParallelLinear`: ``o_proj``, ``down_proj``) keep the matching
  input columns, sum the partial products over the ranks (one all-reduce) and add the bias once;
- the **embedding** and the **LM head** are vocab-parallel (`VocabParallelEmbedding`,
  `TensorParallelCausalLM.compute_logits`): each rank holds ``ceil(vocab / world)`` rows, zero-
  padded on the last rank; lookups are masked and all-reduced, logits all-gathered.

Attention heads split evenly. KV heads split when ``world`` divides them; when ``world`` is a
multiple of the KV heads instead (more ranks than KV heads), every rank keeps the one KV head its
query heads read, so ``world / kv_heads`` ranks hold copies of each. Either way every rank's KV
per token has the same size, so every rank's arena has the same page arithmetic
(`local_config`).

The sharded model is a `CausalLM` over a *local* `ModelConfig` (this rank's head, KV-head,
intermediate and vocab counts), so the KV cache it reads and writes holds this rank's KV heads
only. Every rank must run the same forward passes in the same order (the collectives pair up).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from edmm.model.config import ModelConfig
from edmm.model.errors import ShardingError
from edmm.model.layers import Projection
from edmm.model.transformer import CausalLM, DecoderLayer


@dataclass(frozen=True)
class Shard:
    """This process's place in a tensor-parallel group.

    ``group`` is the process group whose collectives the model runs (NCCL on CUDA, gloo on the
    CPU); None only with ``world_size == 1``.
    """

    rank: int
    world_size: int
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ShardingError(f"rank {self.rank} outside a group of {self.world_size}")
        if self.world_size > 1 and self.group is None:
            raise ShardingError("a group of more than one rank needs a process group")


@dataclass(frozen=True)
class HeadLayout:
    """The query heads and KV heads (global indices) one rank computes."""

    q_heads: range
    kv_heads: range


def head_layout(cfg: ModelConfig, rank: int, world_size: int) -> HeadLayout:
    """Rank ``rank``'s heads; raises `ShardingError` when the heads do not split evenly."""
    hq, hkv = cfg.num_heads, cfg.num_kv_heads
    if hq % world_size:
        raise ShardingError(f"{hq} attention heads do not split over {world_size} ranks")
    per_rank = hq // world_size
    q = range(rank * per_rank, (rank + 1) * per_rank)
    if hkv % world_size == 0:
        kv_per_rank = hkv // world_size
        return HeadLayout(q, range(rank * kv_per_rank, (rank + 1) * kv_per_rank))
    if world_size % hkv:
        raise ShardingError(
            f"{hkv} KV heads neither split over {world_size} ranks nor replicate evenly "
            "(the ranks must be a multiple of the KV heads)")
    kv = q.start // (hq // hkv)  # this rank's query heads all read one KV head
    return HeadLayout(q, range(kv, kv + 1))


def vocab_shard_size(vocab_size: int, world_size: int) -> int:
    """Rows of the embedding / LM head per rank (the last rank's tail is zero padding)."""
    return -(-vocab_size // world_size)


def local_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """The shape one rank computes: its heads, KV heads, intermediate columns, vocab rows."""
    if cfg.intermediate_size % world_size:
        raise ShardingError(
            f"intermediate size {cfg.intermediate_size} does not split over {world_size} ranks")
    layout = head_layout(cfg, 0, world_size)  # the same counts on every rank
    return cfg.replace(num_heads=len(layout.q_heads), num_kv_heads=len(layout.kv_heads),
                       intermediate_size=cfg.intermediate_size // world_size,
                       vocab_size=vocab_shard_size(cfg.vocab_size, world_size))


class RowParallelLinear(Projection):
    """``y = sum over ranks of x_r @ W_r^T, + bias``: the input columns are sharded; the
    partial products are all-reduced, then the (replicated) bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, shard: Shard) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.shard = shard

    def forward(self, x: Tensor) -> Tensor:
        """x [T, in_features / world] -> [T, out_features]."""
        y = self.matmul(x, self.weight, None)  # [T, out], this rank's partial sum
        if self.shard.world_size > 1:
            dist.all_reduce(y, group=self.shard.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """An embedding holding vocab rows ``[rank * rows, (rank + 1) * rows)``; ids outside them
    look up zeros and the ranks' rows are all-reduced."""

    def __init__(self, rows: int, dim: int, shard: Shard) -> None:
        super().__init__(rows, dim)
        self.shard = shard
        self.start = shard.rank * rows

    def forward(self, input_ids: Tensor) -> Tensor:
        """input_ids [T] -> [T, dim]."""
        local = input_ids - self.start  # [T]
        inside = (local >= 0) & (local < self.num_embeddings)  # [T]
        h = F.embedding(local * inside, self.weight)  # [T, dim]; row 0 where outside
        h = h * inside.unsqueeze(-1).to(h.dtype)
        if self.shard.world_size > 1:
            dist.all_reduce(h, group=self.shard.group)
        return h


class TensorParallelCausalLM(CausalLM):
    """A `CausalLM` over one rank's `local_config`; see the module docstring.

    Build it with `shard_model`. ``full_cfg`` is the unsharded model's config.
    """

    def __init__(self, full_cfg: ModelConfig, shard: Shard, max_positions: int) -> None:
        super().__init__(local_config(full_cfg, shard.world_size), max_positions=max_positions)
        self.full_cfg = full_cfg
        self.shard = shard
        cfg = self.cfg
        self.model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, shard)
        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)
            attn, mlp = layer.self_attn, layer.mlp
            attn.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size,
                                            cfg.o_proj_bias, shard)
            mlp.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size,
                                              cfg.mlp_bias, shard)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab] (every rank gets all of them)."""
        weight = self.lm_head.weight if self.lm_head is not None else self.model.embed_tokens.weight
        local = F.linear(hidden, weight)  # [N, rows]
        world = self.shard.world_size
        if world > 1:
            n, rows = local.shape
            out = local.new_empty(world * n, rows)  # [world * N, rows], rank-major
            _all_gather_single(out, local.contiguous(), group=self.shard.group)
            local = out.view(world, n, rows).transpose(0, 1).reshape(n, world * rows)
        return local[:, : self.full_cfg.vocab_size].float()  # [N, vocab]


# torch >= 2.13 renames all_gather_into_tensor (kept, deprecated) to all_gather_single.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


@torch.no_grad()
def shard_model(full: CausalLM, shard: Shard) -> TensorParallelCausalLM:
    """This rank's shard of a loaded model, on the same device and dtype as ``full``.

    The caller drops ``full`` afterwards. Raises `ShardingError` for shapes that do not split.
    """
    weight = full.model.embed_tokens.weight
    with torch.device("meta"):
        local = TensorParallelCausalLM(full.cfg, shard, full.rotary.max_positions)
    local = local.to(dtype=weight.dtype).to_empty(device=weight.device)
    local.reset_buffers()
    local.set_backend(full.backend)
    rows = _row_plan(full.cfg, shard)
    full_params = dict(full.named_parameters())
    for name, param in local.named_parameters():
        param.copy_(_shard_tensor(name, full_params[name], rows, shard, full.cfg))
    return local.eval().requires_grad_(False)


def _row_plan(cfg: ModelConfig, shard: Shard) -> dict[str, list[int]]:
    """Global row indices this rank keeps of the fused column-parallel weights."""
    d, inter = cfg.head_dim, cfg.intermediate_size
    layout = head_layout(cfg, shard.rank, shard.world_size)
    q_size, kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
    q = [h * d + i for h in layout.q_heads for i in range(d)]
    kv = [h * d + i for h in layout.kv_heads for i in range(d)]
    per = inter // shard.world_size
    cols = list(range(shard.rank * per, (shard.rank + 1) * per))
    return {"qkv": q + [q_size + i for i in kv] + [q_size + kv_size + i for i in kv],
            "o_in": q, "gate_up": cols + [inter + i for i in cols], "down_in": cols}


def _shard_tensor(name: str, full: Tensor, rows: dict[str, list[int]], shard: Shard,
                  cfg: ModelConfig) -> Tensor:
    """The part of parameter ``name`` (of the full model) that this rank holds."""
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        n = vocab_shard_size(cfg.vocab_size, shard.world_size)
        part = full[shard.rank * n: (shard.rank + 1) * n]  # [<= n, hidden]
        return torch.cat([part, part.new_zeros(n - part.shape[0], part.shape[1])])
    picks = {"qkv_proj.": ("qkv", 0), "o_proj.weight": ("o_in", 1),
             "gate_up_proj.": ("gate_up", 0), "down_proj.weight": ("down_in", 1)}
    for key, (plan, dim) in picks.items():
        if key in name:
            index = torch.tensor(rows[plan], device=full.device)
            return full.index_select(dim, index)
    return full  # norms, row-parallel biases: replicated

