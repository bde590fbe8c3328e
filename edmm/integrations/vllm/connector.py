"""``EDMMConnector``: a vLLM V1 KV connector for paused agent sessions (imports vLLM).

A request takes part when its ``kv_transfer_params`` (``SamplingParams.extra_args
["kv_transfer_params"]`` offline, the ``kv_transfer_params`` field of an OpenAI request on
the API server) name a session::

    {"edmm_session": "agent-7",      # the session id, the same on every turn
     "edmm_tool_s": 2.0,             # expected tool duration (s) after this turn
     "edmm_awaiting_tool": true,     # optional (default true): keep the KV after this turn
     "edmm_tool_call_token_ids": [4]}  # optional: keep only if the output holds one of them

While the request runs, the worker copies each KV block that becomes full into the store's
pending area (synchronously, after the step's forward). When it finishes and the turn ends in
a tool call, the scheduler moves those blocks into the session, keyed by the chained hash of
their tokens, to expire ``ttl_factor * edmm_tool_s + grace_s`` seconds later. vLLM's own prefix
cache may evict or reset them meanwhile: on the session's next request the connector reports
the session's leading blocks (checksums verified) as matched and the worker loads them back
before the forward, so only the new tokens are computed. A missing, expired, full or corrupted
store is a miss: vLLM recomputes; a block that fails its checksum between match and load is
reported through ``get_block_ids_with_load_errors`` (set ``kv_load_failure_policy`` to
``"recompute"``).

Extra config (``kv_connector_extra_config``): ``edmm_store_path`` (a directory shared by the
scheduler and worker processes; default ``$TMPDIR/edmm-vllm-kv``), ``edmm_store_max_bytes``
(default 1 GiB), ``edmm_ttl_factor`` (default 2.0), ``edmm_grace_s`` (default 30.0).
Supports one KV cache group of full attention (plain decoder models).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from edmm.integrations.vllm.store import SessionKVStore

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

SESSION_KEY = "edmm_session"
SWEEP_INTERVAL_S = 1.0


@dataclass
class SessionTag:
    session: str
    tool_s: float
    awaiting_tool: bool
    tool_call_token_ids: frozenset[int]


def parse_tag(params: dict[str, Any] | None) -> SessionTag | None:
    """The session tag of a request's ``kv_transfer_params``, or None (not an agent session)."""
    if not params or not params.get(SESSION_KEY):
        return None
    try:
        return SessionTag(
            session=str(params[SESSION_KEY]),
            tool_s=max(0.0, float(params.get("edmm_tool_s", 0.0))),
            awaiting_tool=bool(params.get("edmm_awaiting_tool", True)),
            tool_call_token_ids=frozenset(
                int(t) for t in params.get("edmm_tool_call_token_ids") or ()
            ),
        )
    except (TypeError, ValueError):
        logger.warning("EDMMConnector: ignoring malformed kv_transfer_params %r", params)
        return None


@dataclass
class EDMMConnectorMetadata(KVConnectorMetadata):
    # (request id, block index in the request, block id): copy out after this step's forward
    saves: list[tuple[str, int, int]] = field(default_factory=list)
    # (session, block hash, block id): copy in before this step's forward
    loads: list[tuple[str, str, int]] = field(default_factory=list)


class EDMMConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        default_path = os.path.join(tempfile.gettempdir(), "edmm-vllm-kv")
        self.store = SessionKVStore(
            cfg.get_from_extra_config("edmm_store_path", default_path),
            int(cfg.get_from_extra_config("edmm_store_max_bytes", 1 << 30)),
        )
        self.ttl_factor = float(cfg.get_from_extra_config("edmm_ttl_factor", 2.0))
        self.grace_s = float(cfg.get_from_extra_config("edmm_grace_s", 30.0))
        self.block_size = int(vllm_config.cache_config.block_size)
        groups = getattr(kv_cache_config, "kv_cache_groups", None)
        self.enabled = groups is None or len(groups) == 1
        if not self.enabled:
            logger.warning("EDMMConnector: %d KV cache groups; disabled", len(groups or ()))
        self.num_blocks = getattr(kv_cache_config, "num_blocks", None)
        # scheduler side
        self._tags: dict[str, SessionTag] = {}
        self._requests: dict[str, Request] = {}
        self._saved_upto: dict[str, int] = {}  # request id -> blocks already sent for saving
        self._matched: dict[str, list[str]] = {}  # request id -> session block hashes matched
        self._pending_loads: dict[str, tuple[int, int]] = {}  # req -> (first, end) block index
        self._local_hit: dict[str, int] = {}  # req -> tokens vLLM's own prefix cache had
        self._last_sweep = 0.0
        # worker side
        self._layers: list[tuple[str, torch.Tensor, int]] = []  # name, cache, block dim
        self._payload_len: int | None = None
        self._load_errors: set[int] = set()

    # ====================================================================================
    # Scheduler side
    # ====================================================================================
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        tag = parse_tag(request.kv_transfer_params)
        if tag is None or not self.enabled:
            return 0, False
        self._tags[request.request_id] = tag
        self._requests[request.request_id] = request
        prompt = list(request.prompt_token_ids or [])
        # at least one prompt token must be computed by vLLM itself
        usable = (len(prompt) - 1) // self.block_size
        try:
            hashes = self.store.match(
                tag.session, prompt[: usable * self.block_size], self.block_size
            )
        except OSError as e:
            logger.warning("EDMMConnector: store unreadable (%s); recomputing", e)
            return 0, False
        self._matched[request.request_id] = hashes
        self._local_hit[request.request_id] = num_computed_tokens
        # the session already holds these blocks under the same keys: no need to save them again
        self._saved_upto[request.request_id] = len(hashes)
        n_ext = len(hashes) * self.block_size - num_computed_tokens
        return max(0, n_ext), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            return
        # request.num_computed_tokens is not updated yet: the local hit is the one vLLM gave
        # get_num_new_matched_tokens (block-aligned); the external tokens follow it
        local = self._local_hit.get(request.request_id, 0)
        first = local // self.block_size
        end = (local + num_external_tokens) // self.block_size
        self._pending_loads[request.request_id] = (first, end)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = EDMMConnectorMetadata()
        mgr = self._kv_cache_manager
        new_block_ids = {r.req_id: r.block_ids[0] for r in scheduler_output.scheduled_new_reqs}
        # Every request given external tokens is scheduled in this very step: a new request,
        # or one resumed after preemption (listed among the cached requests).
        for req_id, (first, end) in self._pending_loads.items():
            if mgr is not None:
                block_ids = list(mgr.get_block_ids(req_id)[0])
            else:
                block_ids = list(new_block_ids.get(req_id, []))
            hashes = self._matched.get(req_id, [])
            tag = self._tags[req_id]
            if len(block_ids) < end or len(hashes) < end:
                raise RuntimeError(f"EDMMConnector: no blocks to load {req_id} into")
            for i in range(first, end):
                meta.loads.append((tag.session, hashes[i], block_ids[i]))
        self._pending_loads.clear()
        for req_id, n_sched in scheduler_output.num_scheduled_tokens.items():
            req = self._requests.get(req_id)
            if req is None or mgr is None:
                continue
            end_blocks = (req.num_computed_tokens + n_sched) // self.block_size
            start = self._saved_upto.get(req_id, 0)
            if end_blocks <= start:
                continue
            block_ids = mgr.get_block_ids(req_id)[0]
            for i in range(start, min(end_blocks, len(block_ids))):
                meta.saves.append((req_id, i, block_ids[i]))
            self._saved_upto[req_id] = end_blocks
        now = time.monotonic()
        if now - self._last_sweep > SWEEP_INTERVAL_S:
            self._last_sweep = now
            active = {t.session for t in self._tags.values()}
            with contextlib.suppress(OSError):
                self.store.drop_expired(keep=active)
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        tag = self._tags.pop(req_id, None)
        self._requests.pop(req_id, None)
        self._saved_upto.pop(req_id, None)
        self._matched.pop(req_id, None)
        self._pending_loads.pop(req_id, None)
        self._local_hit.pop(req_id, None)
        if tag is None:
            return False, None
        outputs = set(request.output_token_ids)
        keep = tag.awaiting_tool and (
            not tag.tool_call_token_ids or bool(outputs & tag.tool_call_token_ids)
        )
        kept = 0
        try:
            if keep:
                # the KV of the last sampled token was never computed
                tokens = list(request.all_token_ids)[: request.num_computed_tokens]
                ttl = self.ttl_factor * tag.tool_s + self.grace_s
                kept = self.store.commit(req_id, tag.session, tokens, self.block_size, ttl)
            else:
                self.store.discard_pending(req_id)
        except OSError as e:
            logger.warning("EDMMConnector: could not keep session %s (%s)", tag.session, e)
        return False, {"edmm_session": tag.session, "edmm_kept_tokens": kept * self.block_size}

    # ====================================================================================
    # Worker side
    # ====================================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = []
        for name in sorted(kv_caches):
            t = kv_caches[name]
            dims = [d for d, s in enumerate(t.shape) if s == self.num_blocks]
            if not dims:
                logger.warning("EDMMConnector: no block dim in %s %s; disabled", name, t.shape)
                self.enabled = False
                return
            layers.append((name, t, dims[0]))
        self._layers = layers
        self._payload_len = sum(t.select(d, 0).numel() * t.element_size() for _, t, d in layers)

    def _read_block(self, block_id: int) -> bytes:
        parts = [
            t.select(d, block_id).contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
            for _, t, d in self._layers
        ]
        return b"".join(parts)

    def _write_block(self, block_id: int, payload: bytes) -> None:
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        off = 0
        for _, t, d in self._layers:
            dst = t.select(d, block_id)
            n = dst.numel() * t.element_size()
            src = buf[off : off + n].view(t.dtype).reshape(dst.shape)
            dst.copy_(src.to(dst.device))
            off += n

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, EDMMConnectorMetadata)
        for session, block_hash, block_id in meta.loads:
            payload = None
            if self.enabled and self._payload_len is not None:
                payload = self.store.load(session, block_hash, self._payload_len)
            if payload is None:
                logger.warning("EDMMConnector: block %s of %s unreadable", block_hash, session)
                self._load_errors.add(block_id)
                continue
            self._write_block(block_id, payload)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # whole blocks are copied in wait_for_save, after the forward

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata() or not self.enabled or not self._layers:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, EDMMConnectorMetadata)
        for req_id, index, block_id in meta.saves:
            try:
                if not self.store.save_pending(req_id, index, self._read_block(block_id)):
                    logger.info("EDMMConnector: store full; %s block %d not kept", req_id, index)
            except OSError as e:
                logger.warning("EDMMConnector: save failed (%s)", e)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
