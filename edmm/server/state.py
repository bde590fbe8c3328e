"""`ServerConfig` and `ServerState`: the engine, its thread, and what the routes use."""

from __future__ import annotations

import copy
import dataclasses
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edmm.agent import AgentConfig, AgentEngine, KeyQuota
from edmm.engine import Engine, EngineConfig
from edmm.engine.tp import build_engine
from edmm.server.children import forget_semaphores
from edmm.server.collector import collect_young
from edmm.server.engine_loop import EngineLoop
from edmm.server.errors import ServiceUnavailableError
from edmm.server.guided import FORCED_STRING_CHARS, GrammarBudget, GuidedDecoding
from edmm.server.http_guard import DEFAULT_MAX_BODY_BYTES, default_allowed_hosts
from edmm.server.metrics import ServerMetrics
from edmm.server.read_timeouts import BODY_TIMEOUT_S, HEADER_TIMEOUT_S
from edmm.server.serving import OpenAIServing
from edmm.server.sessions import ServerSessions
from edmm.server.shutdown import DEFAULT_SHUTDOWN_TIMEOUT_S
from edmm.server.templates import TemplateLimits

TINY_MODEL_NAME = "edmm-tiny"
DEFAULT_MAX_TOOL_OUTPUT_BYTES = 4 << 20
OFFLOAD_SHARE = 0.5  # of the available memory, for `ServerConfig.kv_offload_cap_bytes`
# Per-client bounds (`ServerConfig`): half the agent layer's sessions for one client, and as
# many of them awaiting tools as a large agent fleet keeps in flight.
DEFAULT_MAX_SESSIONS_PER_KEY = AgentConfig.max_sessions // 2
DEFAULT_MAX_AWAITING_PER_KEY = 1024


@dataclass
class ServerConfig:
    """How to serve.

    Attributes:
        model: a local HF folder or a preset name; None: the embedded tool model.
        device: ``"cpu"`` or ``"cuda"``.
        host, port: where to listen (loopback by default).
        served_model_name: the ``model`` clients must send; default: ``edmm-tiny``, the
            folder's name, or the preset's.
        execution_aware: speculation in tool windows and retention of paused sessions' KV
            (`edmm.agent.AgentEngine`, zero-copy commit); False: EDMM off, the same sessions
            with both off (`AgentConfig.off`: prefix caching only).
        tool_timeout_s: seconds a session may await its tool results before it is abandoned
            and its KV reclaimed (`AgentConfig.tool_timeout_s`), on a timer that runs on an
            idle server too.
        max_sessions_per_key, max_awaiting_per_key, max_kv_pages_per_key: what one client
            (API key) may hold (`edmm.agent.KeyQuota`; None: no bound): past them a turn is a
            429 with ``Retry-After``. KV memory is shared fairly across clients whatever the
            bound (`edmm.agent.owners`).
        engine: further `EngineConfig` fields (``max_model_len``, ``num_pages``, ``dtype``...).
        agent: `AgentConfig` fields that override the default (``execution_aware``) or
            `AgentConfig.off` (``retention``, ``speculation``, ``admission``...): a policy.
        allow_client_chat_template: accept ``chat_template_kwargs.chat_template`` (rendered
            in a sandbox within ``template_limits``); off: such a request is a 400.
        template_limits: the time, size and loop budget of one client template render.
        grammar_budget: what one request's grammar may cost the engine thread per token.
        max_forced_string_chars: the most characters of a string argument of a forced tool
            call whose schema does not bound it (`GuidedDecoding`); None (default): unbounded,
            as vLLM (a bound makes each of the string's token masks 6-8x costlier).
        grammar_fast_forward: the tokens a request's grammar forces at its start (a forced
            call's ``<tool_call>`` wrapper and name) are computed with its prompt, not decoded
            one step each (`GuidedDecoding`); False: decoded.
        max_body_bytes: the largest request body (413 past it).
        max_tool_output_bytes: the largest chunk of one ``tool_output`` call (UTF-8 bytes of
            its content; 413 past it).
        header_timeout_s, body_timeout_s: a request's headers must arrive within
            ``header_timeout_s`` of its connection (or of the previous response), its body
            may pause at most ``body_timeout_s``; past either the connection is closed
            (`edmm.server.read_timeouts`; ``edmm serve`` applies them).
        cache_salt_per_key: salt every request's prefix-cache key with its client (the API key
            it sends), so clients share no cached prefixes and hit counts tell nothing across.
        allowed_hosts: the ``Host`` names accepted (``"*"``: any); None: the bound address
            (with ``localhost`` when it is loopback; any when bound to every interface).
        api_docs: serve ``/docs``, ``/redoc`` and ``/openapi.json``.
        model_aliases: further names clients may send for the model.
        kv_offload_cap_bytes: size the host offload of paused sessions' KV from the memory
            available at start-up (`auto_offload_bytes`), at most this; None: as ``engine``
            says (``kv_offload_bytes``, off by default).
        chat_template: a chat template to use instead of the tokenizer's (its text).
        api_keys: the keys one of which a request to ``/v1`` must send as ``Authorization:
            Bearer KEY`` (401 otherwise, `edmm.server.auth`); empty: no authentication.
        force_include_usage: every stream ends with a usage chunk, asked for or not.
        vllm_metrics: ``/metrics`` also carries vLLM's metric names.
        shutdown_timeout_s: on SIGTERM, how long running requests may take to finish before
            they are ended with an error (`edmm.server.shutdown`).
    """

    model: str | None = None
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    execution_aware: bool = True
    tool_timeout_s: float = AgentConfig.tool_timeout_s
    max_sessions_per_key: int | None = DEFAULT_MAX_SESSIONS_PER_KEY
    max_awaiting_per_key: int | None = DEFAULT_MAX_AWAITING_PER_KEY
    max_kv_pages_per_key: int | None = None
    engine: dict[str, Any] = field(default_factory=dict)
    agent: dict[str, Any] = field(default_factory=dict)
    allow_client_chat_template: bool = False
    template_limits: TemplateLimits = field(default_factory=TemplateLimits)
    grammar_budget: GrammarBudget = field(default_factory=GrammarBudget)
    max_forced_string_chars: int | None = FORCED_STRING_CHARS
    grammar_fast_forward: bool = True
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_tool_output_bytes: int = DEFAULT_MAX_TOOL_OUTPUT_BYTES
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    cache_salt_per_key: bool = False
    allowed_hosts: list[str] | None = None
    api_docs: bool = False
    model_aliases: tuple[str, ...] = ()
    kv_offload_cap_bytes: int | None = None
    chat_template: str | None = None
    api_keys: tuple[str, ...] = ()
    force_include_usage: bool = False
    vllm_metrics: bool = False
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S

    @property
    def hosts(self) -> list[str] | None:
        """The ``Host`` names to accept (None: any)."""
        if self.allowed_hosts is not None:
            return None if "*" in self.allowed_hosts else list(self.allowed_hosts)
        return default_allowed_hosts(self.host)

    def agent_config(self) -> AgentConfig:
        """The agent layer's config: EDMM's default or EDMM off, then ``agent``'s fields."""
        base = AgentConfig() if self.execution_aware else AgentConfig.off()
        quota = KeyQuota(self.max_sessions_per_key, self.max_awaiting_per_key,
                         self.max_kv_pages_per_key)
        return dataclasses.replace(base, **{"tool_timeout_s": self.tool_timeout_s,
                                            "quota": quota, **self.agent})

    @property
    def model_name(self) -> str:
        """The name clients address the model by."""
        if self.served_model_name:
            return self.served_model_name
        return TINY_MODEL_NAME if self.model is None else Path(self.model).name or self.model

    def engine_config(self) -> EngineConfig:
        """The engine's config: ``engine``'s fields, with the host offload sized from the
        available memory when ``kv_offload_cap_bytes`` says so."""
        fields = dict(self.engine)
        if self.kv_offload_cap_bytes is not None and "kv_offload_bytes" not in fields:
            fields["kv_offload_bytes"] = auto_offload_bytes(self.kv_offload_cap_bytes)
        return EngineConfig(model=self.model, device=self.device, **fields)


def auto_offload_bytes(cap: int, share: float = OFFLOAD_SHARE) -> int:
    """Host memory for offloaded KV: ``share`` of the memory available now (Linux's
    ``MemAvailable``), at most ``cap``; 0 where that is unknown."""
    try:
        with open("/proc/meminfo") as f:
            lines = dict(line.split(":", 1) for line in f)
        available = int(lines["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0
    return min(cap, int(available * share))


class ServerState:
    """The engine, the agent layer on its thread, and the request logic."""

    def __init__(self, config: ServerConfig, engine: Engine | None = None) -> None:
        self.config = config
        self.engine = engine if engine is not None else build_engine(config.engine_config())
        if config.chat_template is not None and self.engine.tokenizer is not None:
            self.engine.tokenizer.chat_template = config.chat_template
        tokenizer = copy.deepcopy(self.engine.tokenizer)  # the request pipeline's own
        self.sessions = ServerSessions(AgentEngine(self.engine, config.agent_config()))
        self.loop: EngineLoop[ServerSessions] = EngineLoop(self.sessions,
                                                           on_idle=collect_young)
        self.metrics = ServerMetrics(config.model_name, vllm_names=config.vllm_metrics)
        self.guided = _guided(self.engine, tokenizer, config.grammar_budget,
                              config.max_forced_string_chars, config.grammar_fast_forward)
        self.draining = threading.Event()  # set when shutdown starts (`edmm.server.shutdown`)
        self.serving = OpenAIServing(
            self.loop, self.engine, tokenizer, config.model_name, self.metrics, self.guided,
            config.template_limits if config.allow_client_chat_template else None,
            config.cache_salt_per_key, aliases=config.model_aliases,
            force_include_usage=config.force_include_usage)

    @property
    def execution_aware(self) -> bool:
        """True when speculation and retention are on."""
        return self.config.execution_aware

    def describe(self) -> list[str]:
        """What start-up made, as log lines: the model's device, dtype and context; the KV
        capacity (tokens, and sessions at the full context) and the host offload; the agent
        policy; authentication."""
        engine, config = self.engine, self.config
        kv, layout = engine.kv.stats(), engine.kv.layout()
        dtype = str(next(engine.model.parameters()).dtype).removeprefix("torch.")
        per_session = -(-engine.max_model_len * layout.token_bytes // layout.page_size)
        offload = kv.offload_capacity_bytes / 2**30
        agent = config.agent_config()
        speculation = ",".join(agent.speculation) or "none"
        gate = " (gated)" if agent.speculation_gate is not None and agent.speculation else ""
        return [
            f"model {config.model_name}: device {engine.config.device}, dtype {dtype}, "
            f"context {engine.max_model_len} tokens, tensor parallel "
            f"{engine.config.tensor_parallel_size}",
            f"KV capacity: {engine.kv.tokens_in_pages(kv.pages_total)} tokens in "
            f"{kv.pages_total} pages of {layout.page_size >> 10} KiB, "
            f"{kv.pages_total // max(per_session, 1)} sessions at the full context; host "
            f"offload {offload:.1f} GiB" + ("" if offload else " (off)"),
            f"agent policy: {'EDMM' if config.execution_aware else 'EDMM off'}: retention "
            f"{agent.retention}, speculation {speculation}{gate}, admission "
            f"{agent.admission}, prefetch "
            + (f"{agent.prefetch_lead_s:g} s ahead" if agent.prefetch else "off")
            + f", tool timeout {agent.tool_timeout_s:g} s",
            "API keys: " + (f"{len(config.api_keys)} (401 without one)" if config.api_keys
                            else "none (any client is served)"),
        ]

    def start(self) -> None:
        """Start the engine thread (and the grammar-probe and client-template processes, if
        they are on)."""
        self.loop.start()
        if self.guided is not None:
            self.guided.start()
        self.serving.start()

    def end_requests(self) -> None:
        """End every request in flight with a 503 (a stream: an error event, then ``[DONE]``)
        and refuse new ones: the end of a shutdown's grace period."""
        self.loop.end_all(ServiceUnavailableError("the server is shutting down"))

    def stop(self) -> None:
        """Stop the engine thread (pending requests fail with 503)."""
        self.loop.stop()

    def close(self) -> None:
        """Stop, then release the tokenizing thread, the processes and the engine's memory."""
        self.stop()
        self.serving.close()
        if self.guided is not None:
            self.guided.close()
        self.engine.close()
        forget_semaphores()


def _guided(engine: Engine, tokenizer: Any, budget: GrammarBudget,
            forced_string_chars: int | None, fast_forward: bool) -> GuidedDecoding | None:
    """Constrained decoding for models with a tokenizer (presets have none)."""
    if tokenizer is None:
        return None
    eos = tokenizer.eos_token_id
    if eos is None:
        eos = min(engine.eos_token_ids, default=0)
    return GuidedDecoding(tokenizer, engine.model_config.vocab_size, int(eos), budget,
                          isolated=True, forced_string_chars=forced_string_chars,
                          fast_forward=fast_forward)
