"""`EngineConfig`: the model, the device, the KV memory and the scheduler limits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edmm.engine.errors import EngineConfigError
from edmm.engine.kv_policy import CACHE_POLICIES
from edmm.engine.scheduler import SchedulerConfig
from edmm.memory.backends import BACKEND_NAMES
from edmm.memory.host import DEFAULT_HOST_PAGE_SIZE
from edmm.model.attention_choice import ATTENTION_CHOICES
from edmm.model.kv_quant import KV_CACHE_DTYPES
from edmm.model.loader import LOAD_FORMATS

HOST_POOL_BYTES = 4 << 30  # default cap of the host pool (memfd pages are committed on touch)
# Running sequences by default, by device (vLLM's serving defaults: 1024 on GPUs of >= 70 GiB,
# 256 below; EDMM captures a decode graph per batch size up to this, so it stays at 256 there
# and 128 below: past ~128 sequences a 7B decode step is bound by the KV it reads, not by the
# weights, and more sequences add latency, not throughput). The CPU keeps a small batch.
DEFAULT_MAX_NUM_SEQS = {"cuda-large": 256, "cuda": 128, "cpu": 16}
LARGE_GPU_BYTES = 70 << 30


# Steps of 32 tokens up to 512, of 64 up to 1024, then of 256: padding costs at most ~12%.
DEFAULT_GRAPH_TOKEN_SIZES = (*range(32, 513, 32), *range(576, 1025, 64),
                             *range(1280, 2049, 256))
DEFAULT_MIXED_SEQ_BUCKETS = (16, 64)  # sequence bounds of the mixed graphs below their largest


@dataclass
class EngineConfig:
    """Everything an `Engine` is built from.

    Attributes:
        model: a local HF folder or a preset name (random weights, no tokenizer); None: the
            embedded tool model (`edmm.model.tiny.default_model`).
        tokenizer: a local tokenizer folder; None: the model folder, if it holds one.
        load_format: how weights load (`edmm.model.loader.LOAD_FORMATS`, vLLM's names):
            ``auto``/``safetensors`` read the folder's weights (a preset: random ones);
            ``dummy``: random weights for any model (a folder's config.json suffices).
        device: ``"cpu"`` or ``"cuda"`` (``"cuda:N"``).
        dtype: weights dtype (and the KV's with ``kv_cache_dtype="auto"``); None: the model
            config's.
        kv_cache_dtype: how the KV cache stores K and V, one of `KV_CACHE_DTYPES`: ``auto``
            (the weights' dtype), ``bf16``, or ``fp8`` (e4m3 with per-layer, per-KV-head
            scales calibrated at start-up: half of BF16's bytes per token, so twice the tokens
            in the same pages; `edmm.model.kv_quant`).
        backend: VMM backend of the KV arena: ``"auto"`` (CUDA on a CUDA device, else the host
            twin), ``"cuda"`` or ``"host"``.
        host_page_size: page size of the host twin in bytes.
        num_pages: physical KV pages; None: ``gpu_memory_utilization`` of the GPU's memory
            less what is in use, or on the host enough for every slot at ``max_model_len``
            (at most `HOST_POOL_BYTES`).
        gpu_memory_utilization: fraction of the GPU's total memory the process may fill.
        num_slots: arena slots: running sequences plus prefix-cache entries (each slot
            reserves ``max_model_len`` tokens of virtual address space; physical pages are
            mapped only as far as its tokens reach); 0: twice ``max_num_seqs``.
        max_model_len: most tokens (prompt + output) of a sequence; None: the model's context.
        max_num_batched_tokens: token budget of one step.
        max_num_seqs: most running sequences; 0: `DEFAULT_MAX_NUM_SEQS` of the device (on
            CUDA by its memory, as vLLM sizes its own), at most ``num_slots`` when that is set.
        enable_prefix_caching: reuse KV of finished and running sequences' prefixes.
        prefix_block_size: tokens per hashed block of the prefix index.
        seed: seed of the sampler's shared stream (requests without their own seed).
        enforce_eager: on CUDA, run every step eagerly instead of replaying CUDA graphs, and
            keep the reference SDPA attention instead of the Triton kernels.
        attention: the attention backend of CUDA-graph steps, one of `ATTENTION_CHOICES`:
            ``auto`` (FlashAttention-4 for prefill where it runs, else Triton), ``fa4``,
            ``triton``, ``sdpa`` (`edmm.model.attention_choice`).
        cuda_graph_token_sizes: token counts at which batches with a prefill (chunks, resumes,
            decodes with speculation riding along) replay captured graphs (the graph of ``T``
            tokens takes up to ``T - 1`` sequences); sizes above ``max_num_batched_tokens``
            are skipped. Empty: such batches run eagerly (decode batches still replay graphs,
            one per batch size up to ``max_num_seqs``).
        cuda_graph_mixed_seq_buckets: smaller sequence bounds of those graphs: for each ``T``
            one graph per bound below its most sequences, and one for the most, so that a
            prefill with few sequences beside it replays a graph padded to the next bound, not
            to hundreds of sequences (`edmm.engine.cuda_graph.mixed_buckets`). Each bound
            adds a graph per token count: its capture at start-up and its output rows
            (~125 MB for the default token counts on a 7B model).
        speculative_tokens_when_busy: most tokens of speculative prefill (agent sessions' tool
            windows) added to a step that runs requests; None: `busy_speculation_tokens`.
        speculation_fills_padding: with CUDA graphs, speculative prefill may also fill the
            padding of a busy step that prefills (up to its mixed graph's token count: tokens
            computed anyway), so speculation runs under sustained load too.
        speculative_tokens_when_idle: most tokens of speculative prefill in a step with no
            requests: a resume that arrives meanwhile waits for that step on the device.
        max_speculative_pages: most KV pages speculation may hold; None: a quarter of the pool.
        kv_offload_bytes: host memory (pinned on CUDA) for the KV of paused agent sessions
            that memory pressure evicts: copied there instead of dropped, copied back before
            or at resume. 0: off (evicted sessions are recomputed). Allocated whole when the
            engine starts (pinning runs at ~1.4 GiB/s on the H200's host: ~0.7 s per GiB).
        kv_cache_policy: how prefix-cache entries are evicted and what the host tier takes
            (`edmm.engine.kv_policy.CACHE_POLICIES`): ``sessions`` (entries evicted whole;
            paused sessions' KV to the host and back by session), ``apc`` (tail-first,
            page-granular eviction: vLLM's automatic prefix caching), ``blocks`` (``apc``,
            and every block written through to the host as computed and loaded back by any
            admission that lacks it: LMCache, vLLM's offloading connector), ``tiered``
            (paused sessions as ``sessions``; everything else as ``apc`` with what an eviction
            takes copied to the host and loaded back by the admission that lacks it: a
            session waiting for its user's next message, a preempted turn).
        kv_copy_stream: on CUDA, offload and restore copies run on a side stream beside the
            steps (ordered by CUDA events; paused sessions near eviction are written behind);
            False: synchronous copies. No effect on the CPU.
        async_scheduling: schedule and launch each step while the device still computes the
            previous one, whose sampled tokens are processed meanwhile (the host's work per
            step hides behind the device's, as in vLLM's async scheduling; outputs come one
            step later). None: on where steps replay CUDA graphs (one process), off elsewhere.
        prefix_spares: when plain requests keep branching from one cached prefix (a shared
            system prompt), map a spare branch of it during a step, beside the device's work,
            which the next such request adopts whole: its page maps (~31 us each on an H100,
            ~5 ms for a 6K-token prefix of a 7B model) leave the admission's critical path
            (`PrefixCache.make_spare`). Needs prefix caching and async scheduling (in step the
            host's time would only move); a spare is an ordinary entry.
        tensor_parallel_size: ranks (one process per GPU, or per CPU process with gloo) the
            model's heads, KV heads and vocabulary are split over; build such an engine with
            `edmm.engine.tp.build_engine`. Each rank's arena holds its KV heads only.
    """

    model: str | None = None
    tokenizer: str | None = None
    load_format: str = "auto"
    device: str = "cpu"
    dtype: str | torch.dtype | None = None
    kv_cache_dtype: str = "auto"
    backend: str = "auto"
    host_page_size: int = DEFAULT_HOST_PAGE_SIZE
    num_pages: int | None = None
    gpu_memory_utilization: float = 0.9
    num_slots: int = 0
    max_model_len: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 0
    enable_prefix_caching: bool = True
    prefix_block_size: int = 16
    seed: int | None = 0
    enforce_eager: bool = False
    attention: str = "auto"
    cuda_graph_token_sizes: tuple[int, ...] = DEFAULT_GRAPH_TOKEN_SIZES
    cuda_graph_mixed_seq_buckets: tuple[int, ...] = DEFAULT_MIXED_SEQ_BUCKETS
    speculative_tokens_when_busy: int | None = None
    speculation_fills_padding: bool = True
    speculative_tokens_when_idle: int = 2048
    max_speculative_pages: int | None = None
    kv_offload_bytes: int = 0
    kv_cache_policy: str = "sessions"
    kv_copy_stream: bool = True
    async_scheduling: bool | None = None
    prefix_spares: bool = True
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        device = torch.device(self.device)
        if device.type not in ("cpu", "cuda"):
            raise EngineConfigError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.backend not in BACKEND_NAMES:
            raise EngineConfigError(f"backend must be one of {BACKEND_NAMES}, got {self.backend!r}")
        if self.backend_kind == "cuda" and device.type != "cuda":
            raise EngineConfigError("the cuda backend needs device='cuda'")
        if self.backend_kind == "host" and device.type != "cpu":
            raise EngineConfigError("the host backend needs device='cpu'")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise EngineConfigError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise EngineConfigError(
                f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.attention not in ATTENTION_CHOICES:
            raise EngineConfigError(
                f"attention must be one of {ATTENTION_CHOICES}, got {self.attention!r}")
        if self.kv_offload_bytes < 0:
            raise EngineConfigError(f"kv_offload_bytes must be >= 0, got {self.kv_offload_bytes}")
        if self.kv_cache_policy not in CACHE_POLICIES:
            raise EngineConfigError(f"kv_cache_policy must be one of {sorted(CACHE_POLICIES)}, "
                                    f"got {self.kv_cache_policy!r}")
        if any(b < 1 for b in self.cuda_graph_mixed_seq_buckets):
            raise EngineConfigError("cuda_graph_mixed_seq_buckets must be positive, got "
                                    f"{self.cuda_graph_mixed_seq_buckets}")
        if self.tensor_parallel_size < 1:
            raise EngineConfigError(
                f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.async_scheduling:
            raise EngineConfigError("async_scheduling is not supported with "
                                    "tensor_parallel_size > 1")
        if self.tensor_parallel_size > 1 and self.kv_offload_bytes > 0:
            raise EngineConfigError("KV offload is not supported with tensor_parallel_size > 1")
        self._size_batch()
        for name in ("max_num_seqs", "num_slots", "max_num_batched_tokens", "prefix_block_size"):
            if getattr(self, name) < 1:
                raise EngineConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_seqs > self.num_slots:
            raise EngineConfigError(
                f"max_num_seqs={self.max_num_seqs} exceeds num_slots={self.num_slots}")
        if self.num_pages is not None and self.num_pages < 1:
            raise EngineConfigError(f"num_pages must be >= 1, got {self.num_pages}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise EngineConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise EngineConfigError("gpu_memory_utilization must be in (0, 1]")
        self.scheduler_config()  # validates the scheduler limits

    def _size_batch(self) -> None:
        """Fill ``max_num_seqs`` and ``num_slots`` left 0 from the device (see their docs);
        explicit values are kept as given (negative ones are refused after)."""
        if self.max_num_seqs == 0:
            seqs = DEFAULT_MAX_NUM_SEQS[_device_class(torch.device(self.device))]
            self.max_num_seqs = min(seqs, self.num_slots) if self.num_slots > 0 else seqs
        if self.num_slots == 0 and self.max_num_seqs > 0:
            self.num_slots = 2 * self.max_num_seqs

    @property
    def uses_async_scheduling(self) -> bool:
        """``async_scheduling``, or its default (see its doc; never with several ranks)."""
        if self.tensor_parallel_size > 1:
            return False
        return self.uses_cuda_graphs if self.async_scheduling is None else self.async_scheduling

    @property
    def uses_cuda_graphs(self) -> bool:
        """Steps replay CUDA graphs (a CUDA device, not ``enforce_eager``)."""
        return torch.device(self.device).type == "cuda" and not self.enforce_eager

    @property
    def busy_speculation_tokens(self) -> int:
        """``speculative_tokens_when_busy``, or its default: 64 eagerly, 0 with CUDA graphs.

        Measured on an H200 (docs/limits.md, 'Resume latency'): a 7B
        decode step at 16K takes 5.5 ms alone, 6.8 ms with 32 speculative tokens riding along
        and 9.4 ms with 128 (mixed batches replay CUDA graphs). On CUDA speculation therefore
        waits for steps with no request by default: decode latency first; set this to trade
        some of it for speculation under sustained load.
        """
        if self.speculative_tokens_when_busy is not None:
            return self.speculative_tokens_when_busy
        return 0 if self.uses_cuda_graphs else 64

    def scheduler_config(self, num_pages: int | None = None) -> SchedulerConfig:
        """The per-step limits of the scheduler (the speculation page cap defaults to a
        quarter of ``num_pages``, the pool's size)."""
        cap = self.max_speculative_pages
        if cap is None and num_pages is not None:
            cap = num_pages // 4
        return SchedulerConfig(self.max_num_batched_tokens, self.max_num_seqs,
                               self.busy_speculation_tokens,
                               self.speculative_tokens_when_idle, cap)

    @property
    def backend_kind(self) -> str:
        """``cuda`` or ``host``: the backend ``"auto"`` resolves to on this device."""
        if self.backend != "auto":
            return self.backend
        return "cuda" if torch.device(self.device).type == "cuda" else "host"


def _device_class(device: torch.device) -> str:
    """``cpu``, ``cuda`` or ``cuda-large`` (a GPU of at least `LARGE_GPU_BYTES`)."""
    if device.type != "cuda":
        return "cpu"
    if not torch.cuda.is_available():
        return "cuda"  # the engine reports the missing GPU when it starts
    total = torch.cuda.get_device_properties(device.index or 0).total_memory
    return "cuda-large" if total >= LARGE_GPU_BYTES else "cuda"
