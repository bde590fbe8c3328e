"""Tensor parallelism over the devices of one host: one process per rank, `torch.distributed`.

NCCL carries the model's collectives on CUDA (rank ``r`` on ``cuda:r``), gloo on the CPU; a gloo
group always carries the control messages. Every rank builds the same `Engine` around its own
shard of the model (`edmm.model.parallel`), its own page pool and its own arena holding its KV
heads. `build_engine` returns rank 0's engine in the calling process and spawns the others.

Who owns what (one owner per invariant):

- **rank 0** runs the scheduler, the prefix cache and the agent layer: it alone decides which
  slots exist, which pages they map, what is branched, committed, truncated or freed. Its arena
  is a `JournaledArena` (`edmm.memory.journal`): every top-level memory operation the scheduler
  and the prefix cache perform (``allocate``, ``grow``, ``branch``, ``commit``, ``truncate``,
  ``free``, ``reclaim``) is recorded with its arguments and result;
- each step, `LeaderRunner` broadcasts a `StepPlan`: the operations recorded since the last plan
  and the batch as plain `PlannedSeq`s (slot, tokens, start, sample). The other ranks
  (`serve_rank`) replay the operations on their arena (checking that each returns the same slot
  or count as on rank 0), then run the same forward pass; the model's all-reduces and all-gathers
  pair up. Branch / commit / truncate thus stay rank-local and in step: commit is a slot swap on
  every rank, and a branch copies only the boundary page of the rank's own KV heads.

Every rank's KV per token has the same size (`edmm.model.parallel.local_config`) and the ranks
agree on the pool size, so the arenas are identical in slots and page ids, only their bytes
differ. The alternative, every rank running the whole engine on the same inputs, was rejected: the
agent layer's decisions depend on the wall clock (tool windows, retention by predicted tool
duration), so replicated schedulers would drift; and the scheduler would no longer be the only
owner of its decisions. KV offload (host copies of a rank's bytes) is not supported yet.
"""

from __future__ import annotations

import contextlib
import enum
import multiprocessing as mp
import socket
from dataclasses import dataclass, field, replace
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

from edmm.engine.config import EngineConfig
from edmm.engine.cuda_graph import CudaGraphRunner
from edmm.engine.engine import Engine
from edmm.engine.errors import EngineError
from edmm.engine.runner import Launch, ModelRunner
from edmm.engine.sampling import RequestRng, SamplingParams
from edmm.engine.scheduler import ScheduledBatch, ScheduledSeq
from edmm.memory import KVArena, KVMemoryError, KVSpec, PagePool
from edmm.memory.arena import ArenaStats
from edmm.memory.journal import ArenaOp, JournaledArena, replay
from edmm.model import CausalLM
from edmm.model.parallel import Shard, shard_model

DEFAULT_TIMEOUT_S = 600.0  # a rank waiting longer on a collective raises (a peer died or hung)


class TensorParallelError(EngineError):
    """The ranks of a tensor-parallel engine disagree, or one of them failed."""


class PlanKind(enum.Enum):
    """What rank 0 asks of the other ranks."""

    STEP = "step"  # replay the memory operations, then run the batch
    CHECK = "check"  # replay, then report check_integrity() and occupancy
    STOP = "stop"  # close the engine and leave


@dataclass(frozen=True)
class PlannedSeq:
    """One sequence's part of a step, as the other ranks need it (no sampling state)."""

    slot: int
    token_ids: list[int]
    start: int
    sample: bool


@dataclass(frozen=True)
class StepPlan:
    """A message from rank 0: the memory operations since the last plan, then ``kind``."""

    kind: PlanKind
    ops: list[ArenaOp]
    seqs: list[PlannedSeq] = field(default_factory=list)


@dataclass(frozen=True)
class RankReport:
    """One rank's answer to `PlanKind.CHECK`: its integrity error (None: sound), occupancy
    and slot layout (`KVArena.layout`)."""

    rank: int
    error: str | None
    stats: ArenaStats
    layout: list[tuple[int, bool, int, tuple[int, ...]]]


@dataclass
class RankGroup:
    """This process's membership of the tensor-parallel group (owns the process group)."""

    rank: int
    world_size: int
    device: torch.device
    model_group: dist.ProcessGroup  # the model's collectives: NCCL on CUDA, gloo on the CPU
    control: dist.ProcessGroup  # gloo: plans, reports, the pool size

    @classmethod
    def join(cls, rank: int, world_size: int, port: int, device: torch.device,
             timeout_s: float = DEFAULT_TIMEOUT_S) -> RankGroup:
        """Join the group rendezvousing on ``127.0.0.1:port`` (blocks until all ranks do)."""
        if dist.is_initialized():
            raise TensorParallelError("this process already belongs to a process group")
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        world = dist.group.WORLD
        assert isinstance(world, dist.ProcessGroup)
        control = world if backend == "gloo" else dist.new_group(backend="gloo")
        assert isinstance(control, dist.ProcessGroup)
        if device.type == "cuda":  # create the NCCL communicator before any graph capture
            dist.all_reduce(torch.zeros(1, device=device), group=world)
            torch.cuda.synchronize(device)
        return cls(rank, world_size, device, world, control)

    def shard(self) -> Shard:
        """The model's view of the group."""
        return Shard(self.rank, self.world_size, self.model_group)

    def broadcast(self, plan: StepPlan | None) -> StepPlan:
        """Rank 0 sends ``plan``; every rank returns it."""
        box: list[Any] = [plan]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]  # type: ignore[no-any-return]

    def gather(self, report: RankReport) -> list[RankReport]:
        """Every rank's report on rank 0 (in rank order); an empty list elsewhere."""
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(report, out, dst=0, group=self.control)
        return list(out) if out is not None else []

    def least(self, value: int) -> int:
        """The smallest ``value`` over the ranks."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def close(self) -> None:
        """Leave the group (every rank does, after the last collective)."""
        if dist.is_initialized():
            dist.destroy_process_group()


class _RankHooks:
    """The `ParallelHooks` every rank shares: sharding and the agreed pool size."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group

    def shard(self, model: CausalLM) -> CausalLM:
        """This rank's shard; the full model's weights are released here."""
        local = shard_model(model, self.group.shard())
        model.to(device="meta")  # frees the full weights before the pool is sized
        if self.group.device.type == "cuda":
            torch.cuda.empty_cache()
        return local

    def agree_num_pages(self, num_pages: int) -> int:
        """The least pool size over the ranks (the arenas must match page for page)."""
        return self.group.least(num_pages)

    def make_arena(self, pool: PagePool, spec: KVSpec, num_slots: int,
                   max_tokens: int, read_align: int = 1) -> KVArena:
        """A plain arena (the other ranks replay rank 0's operations on it)."""
        return KVArena(pool, spec, num_slots, max_tokens, read_align)

    def wrap_runner(self, runner: ModelRunner) -> ModelRunner:
        """The runner itself: `serve_rank` drives it."""
        return runner

    def check_integrity(self) -> None:
        """Nothing: rank 0 asks the others."""

    def close(self) -> None:
        """Nothing: `serve_rank` returns on `PlanKind.STOP`."""


class FollowerHooks(_RankHooks):
    """A non-zero rank's hooks: they keep the rank's arena and runner for `serve_rank`."""

    def __init__(self, group: RankGroup) -> None:
        super().__init__(group)
        self.arena: KVArena | None = None
        self.runner: ModelRunner | None = None

    def make_arena(self, pool: PagePool, spec: KVSpec, num_slots: int,
                   max_tokens: int, read_align: int = 1) -> KVArena:
        """A plain arena, kept: rank 0's operations are replayed on it."""
        self.arena = super().make_arena(pool, spec, num_slots, max_tokens, read_align)
        return self.arena

    def wrap_runner(self, runner: ModelRunner) -> ModelRunner:
        """The runner itself, kept: `serve_rank` drives it."""
        self.runner = runner
        return runner


class LeaderHooks(_RankHooks):
    """Rank 0's hooks: a journaled arena, a broadcasting runner, the other ranks' lifetimes."""

    def __init__(self, group: RankGroup, processes: list[BaseProcess]) -> None:
        super().__init__(group)
        self.processes = processes
        self.arena: JournaledArena | None = None
        self.runner: LeaderRunner | None = None
        self._stopped = False

    def make_arena(self, pool: PagePool, spec: KVSpec, num_slots: int,
                   max_tokens: int, read_align: int = 1) -> KVArena:
        """A `JournaledArena` (journaling starts once the runner is built)."""
        self.arena = JournaledArena(pool, spec, num_slots, max_tokens, read_align)
        return self.arena

    def wrap_runner(self, runner: ModelRunner) -> ModelRunner:
        """A `LeaderRunner` around ``runner``; from here on the arena journals."""
        assert self.arena is not None
        self.runner = LeaderRunner(runner, self)
        self.arena.start_journal()  # every rank's runner has taken its own slots by now
        return self.runner

    def send(self, kind: PlanKind, seqs: list[PlannedSeq] | None = None) -> None:
        """Broadcast the operations journaled so far and ``kind`` to the other ranks."""
        if self._stopped:
            raise TensorParallelError("the other ranks were stopped")
        assert self.arena is not None
        self.group.broadcast(StepPlan(kind, self.arena.take_ops(), seqs or []))

    def reports(self) -> list[RankReport]:
        """Every rank's integrity and occupancy, rank 0 first (a collective: call between
        steps)."""
        assert self.arena is not None
        self.send(PlanKind.CHECK)
        return self.group.gather(rank_report(self.arena, 0))

    def check_integrity(self) -> None:
        """Raise `TensorParallelError` if another rank's arena or pool breaks an invariant, or
        its slots and pages differ from rank 0's."""
        leader, *others = self.reports()
        for report in others:
            if report.error is not None:
                raise TensorParallelError(f"rank {report.rank}: {report.error}")
            if report.layout != leader.layout:
                raise TensorParallelError(
                    f"rank {report.rank}'s arena is out of step with rank 0's: "
                    f"{report.layout} != {leader.layout}")

    def close(self) -> None:
        """Stop the other ranks, wait for them and leave the group."""
        if self._stopped:
            return
        try:
            self.send(PlanKind.STOP)
        finally:
            self._stopped = True
            if self.arena is not None:
                self.arena.stop_journal()
            if self.runner is not None:
                self.runner.close()
            _join(self.processes)
            self.group.close()


class LeaderRunner(ModelRunner):
    """Rank 0's runner: sends each batch (and the memory operations before it) to the other
    ranks, then runs it through the wrapped runner; the forward passes meet in the model's
    collectives."""

    def __init__(self, inner: ModelRunner, hooks: LeaderHooks) -> None:
        super().__init__(inner.model, inner.arena, inner.device, inner.sampler)
        self.inner = inner
        self.hooks = hooks

    @property
    def reserved_slots(self) -> int:
        """The wrapped runner's."""
        return self.inner.reserved_slots

    def launch(self, batch: ScheduledBatch, previous: Launch | None = None) -> Launch:
        """Broadcast the step, then launch it (rank 0 samples). Several ranks never schedule
        asynchronously, so no input is pending (``previous`` is unused)."""
        self.hooks.send(PlanKind.STEP, [PlannedSeq(s.slot, s.token_ids, s.start, s.sample)
                                        for s in batch.seqs])
        return self.inner.launch(batch)

    def close(self) -> None:
        """Release the wrapped runner's graphs and slot."""
        if isinstance(self.inner, CudaGraphRunner):
            self.inner.close()


def rank_report(arena: KVArena, rank: int) -> RankReport:
    """``arena``'s integrity check and occupancy as a `RankReport`."""
    try:
        arena.check_integrity()
        error = None
    except KVMemoryError as e:
        error = str(e)
    return RankReport(rank, error, arena.stats(), arena.layout())


_GREEDY = SamplingParams(temperature=0.0)


def planned_batch(seqs: list[PlannedSeq]) -> ScheduledBatch:
    """A batch the runner can execute from a plan (greedy sampling: rank 0's tokens count)."""
    return ScheduledBatch([ScheduledSeq(f"rank-seq-{i}", s.slot, s.token_ids, s.start,
                                        s.sample, _GREEDY, RequestRng(None))
                           for i, s in enumerate(seqs)])


def serve_rank(hooks: FollowerHooks, group: RankGroup) -> None:
    """A non-zero rank's loop, on the arena and runner of its engine's ``hooks``: replay and
    run rank 0's plans until `PlanKind.STOP`."""
    arena, runner = hooks.arena, hooks.runner
    if arena is None or runner is None:
        raise TensorParallelError("serve_rank needs the hooks of a built engine")
    while True:
        plan = group.broadcast(None)
        replay(arena, plan.ops)
        if plan.kind is PlanKind.STEP:
            runner.execute(planned_batch(plan.seqs))
        elif plan.kind is PlanKind.CHECK:
            group.gather(rank_report(arena, group.rank))
        else:
            return


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """Rank ``rank``'s config: on CUDA its own device, ``cuda:(base + rank)``."""
    device = torch.device(config.device)
    if device.type != "cuda":
        return config
    return replace(config, device=f"cuda:{(device.index or 0) + rank}")


def build_engine(config: EngineConfig, timeout_s: float = DEFAULT_TIMEOUT_S) -> Engine:
    """The engine of ``config``: a plain `Engine`, or with ``tensor_parallel_size > 1`` rank
    0's engine in this process, the other ranks spawned (closing the engine stops them)."""
    world = config.tensor_parallel_size
    if world == 1:
        return Engine(config)
    device = torch.device(config.device)
    if device.type == "cuda" and (device.index or 0) + world > torch.cuda.device_count():
        raise TensorParallelError(
            f"tensor_parallel_size={world} from {device} needs cuda:{(device.index or 0)}.."
            f"cuda:{(device.index or 0) + world - 1}; {torch.cuda.device_count()} GPU(s) seen")
    port = _free_port()
    ctx = mp.get_context("spawn")
    processes: list[BaseProcess] = [
        ctx.Process(target=_rank_main, daemon=True, name=f"edmm-tp-rank{rank}",
                    args=(config, rank, port, timeout_s, torch.get_num_threads()))
        for rank in range(1, world)]
    for p in processes:
        p.start()
    try:
        group = RankGroup.join(0, world, port, torch.device(rank_config(config, 0).device),
                               timeout_s)
    except BaseException:
        _join(processes, timeout_s=0)
        raise
    try:
        return Engine(rank_config(config, 0), parallel=LeaderHooks(group, processes))
    except BaseException:
        group.close()
        _join(processes, timeout_s=0)
        raise


def leader_hooks(engine: Engine) -> LeaderHooks:
    """Rank 0's hooks of a tensor-parallel engine (raises `TensorParallelError` otherwise)."""
    if not isinstance(engine.parallel, LeaderHooks):
        raise TensorParallelError("not rank 0 of a tensor-parallel engine")
    return engine.parallel


def _rank_main(config: EngineConfig, rank: int, port: int, timeout_s: float,
               threads: int) -> None:
    """Entry point of a spawned rank (on the CPU with as many threads as rank 0)."""
    cfg = rank_config(config, rank)
    if torch.device(cfg.device).type == "cpu":
        torch.set_num_threads(threads)
    group = RankGroup.join(rank, config.tensor_parallel_size, port, torch.device(cfg.device),
                           timeout_s)
    try:
        hooks = FollowerHooks(group)
        engine = Engine(cfg, parallel=hooks)
        try:
            serve_rank(hooks, group)
        finally:
            engine.close()
    finally:
        group.close()


def _join(processes: list[BaseProcess], timeout_s: float = 60.0) -> None:
    """Wait for the spawned ranks; terminate those still running after ``timeout_s``."""
    for p in processes:
        p.join(timeout_s)
        if p.is_alive():
            p.terminate()
            p.join(5.0)


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
