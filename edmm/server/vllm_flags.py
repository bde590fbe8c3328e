"""The option names of vLLM 0.26.0's ``vllm serve`` (its engine and OpenAI-server arguments).

`edmm serve` accepts under vLLM's name every one that has a meaning here, with vLLM's semantics
(`edmm.server.cli`); every other name here is refused with one line naming it, rather than as an
unknown argument, so that a vLLM command line says exactly what does not carry over.
Boolean options also have their ``--no-`` form (vLLM's ``BooleanOptionalAction``).
"""

from __future__ import annotations

VLLM_SERVE_OPTIONS = frozenset({
    "--additional-config", "--aggregate-engine-logging", "--all2all-backend",
    "--allow-credentials", "--allow-deprecated-quantization", "--allowed-headers",
    "--allowed-local-media-path", "--allowed-media-domains", "--allowed-methods",
    "--allowed-origins", "--api-key", "--api-server-count", "--async-scheduling",
    "--attention-backend", "--attention-config", "--block-size", "--calculate-kv-scales",
    "--chat-template", "--chat-template-content-format", "--code-revision",
    "--collect-detailed-traces", "--compilation-config", "--config", "--config-format",
    "--convert", "--cp-kv-cache-interleave-size", "--cpu-distributed-timeout-seconds",
    "--cpu-offload-gb", "--cpu-offload-params", "--cudagraph-capture-sizes", "--cudagraph-metrics",
    "--data-parallel-address", "--data-parallel-backend", "--data-parallel-external-lb",
    "--data-parallel-hybrid-lb", "--data-parallel-multi-port-external-lb", "--data-parallel-rank",
    "--data-parallel-rpc-port", "--data-parallel-size", "--data-parallel-size-local",
    "--data-parallel-start-rank", "--data-parallel-supervisor-port",
    "--dbo-decode-token-threshold", "--dbo-prefill-token-threshold", "--dcp-comm-backend",
    "--dcp-kv-cache-interleave-size", "--decode-context-parallel-size",
    "--default-chat-template-kwargs", "--default-mm-loras", "--device-ids", "--diffusion-config",
    "--disable-access-log-for-endpoints", "--disable-cascade-attn", "--disable-chunked-mm-input",
    "--disable-custom-all-reduce", "--disable-fastapi-docs", "--disable-hybrid-kv-cache-manager",
    "--disable-log-stats", "--disable-nccl-for-dp-synchronization", "--disable-sliding-window",
    "--disable-uvicorn-access-log", "--distributed-executor-backend",
    "--distributed-timeout-seconds", "--download-dir", "--dp-supervisor-probe-failure-threshold",
    "--dp-supervisor-probe-interval-s", "--dp-supervisor-probe-timeout-s", "--dtype",
    "--ec-transfer-config", "--enable-auto-tool-choice", "--enable-bf16x3-router-gemm",
    "--enable-chunked-prefill", "--enable-cumem-allocator", "--enable-dbo", "--enable-elastic-ep",
    "--enable-ep-weight-filter", "--enable-eplb", "--enable-expert-parallel",
    "--enable-flash-late-interaction", "--enable-flashinfer-autotune",
    "--enable-force-include-usage", "--enable-layerwise-nvtx-tracing", "--enable-log-deltas",
    "--enable-log-outputs", "--enable-log-requests", "--enable-logging-iteration-details",
    "--enable-lora", "--enable-mamba-cache-stochastic-rounding", "--enable-mfu-metrics",
    "--enable-mixed-moe-lora-format", "--enable-mm-embeds", "--enable-moe-shared-loras",
    "--enable-offline-docs", "--enable-per-request-metrics", "--enable-prefix-caching",
    "--enable-prompt-embeds", "--enable-prompt-tokens-details", "--enable-request-id-headers",
    "--enable-return-routed-experts", "--enable-server-load-tracking", "--enable-sleep-mode",
    "--enable-ssl-refresh", "--enable-tokenizer-info-endpoint", "--enable-tower-connector-lora",
    "--enforce-eager", "--eplb-config", "--exclude-tools-when-tool-choice-none",
    "--expert-placement-strategy", "--fail-on-environ-validation", "--fingerprint-mode",
    "--fingerprint-value", "--fully-sharded-loras", "--gdn-prefill-backend", "--generation-config",
    "--gpu-memory-utilization", "--grpc", "--h11-max-header-count",
    "--h11-max-incomplete-event-size", "--headless", "--hf-config-path", "--hf-overrides",
    "--hf-token", "--host", "--ignore-patterns", "--interleave-mm-strings",
    "--io-processor-plugin", "--ir-op-priority", "--jit-monitor-mode", "--jit-monitor-verbose",
    "--kernel-config", "--kv-cache-dtype", "--kv-cache-dtype-skip-layers",
    "--kv-cache-memory-bytes", "--kv-cache-metrics", "--kv-cache-metrics-sample",
    "--kv-events-config", "--kv-offloading-backend", "--kv-offloading-size",
    "--kv-sharing-fast-prefill", "--kv-transfer-config", "--language-model-only",
    "--limit-mm-per-prompt", "--linear-backend", "--load-format", "--log-config-file",
    "--log-error-stack", "--logits-processors", "--logprobs-mode",
    "--long-prefill-token-threshold", "--lora-dtype", "--lora-modules", "--lora-target-modules",
    "--mamba-backend", "--mamba-block-size", "--mamba-cache-dtype", "--mamba-cache-mode",
    "--mamba-cache-philox-rounds", "--mamba-ssm-cache-dtype", "--master-addr", "--master-port",
    "--max-cpu-loras", "--max-cudagraph-capture-size", "--max-log-len", "--max-logprobs",
    "--max-long-partial-prefills", "--max-lora-rank", "--max-loras", "--max-model-len",
    "--max-num-batched-tokens", "--max-num-partial-prefills", "--max-num-scheduled-tokens",
    "--max-num-seqs", "--max-parallel-loading-workers", "--media-io-kwargs", "--middleware",
    "--mm-encoder-attn-backend", "--mm-encoder-attn-dtype", "--mm-encoder-fp8-scale-path",
    "--mm-encoder-fp8-scale-save-margin", "--mm-encoder-fp8-scale-save-path", "--mm-encoder-only",
    "--mm-encoder-tp-mode", "--mm-ipc-gpu-memory-gb", "--mm-processor-cache-gb",
    "--mm-processor-cache-type", "--mm-processor-kwargs", "--mm-shm-cache-max-object-size-mb",
    "--mm-tensor-ipc", "--model", "--model-class-overrides", "--model-impl",
    "--model-loader-extra-config", "--moe-backend", "--nnodes", "--node-rank",
    "--num-gpu-blocks-override", "--numa-bind", "--numa-bind-cpus", "--numa-bind-nodes",
    "--offload-backend", "--offload-group-size", "--offload-num-in-group", "--offload-params",
    "--offload-prefetch-step", "--optimization-level", "--otlp-traces-endpoint",
    "--override-attention-dtype", "--override-generation-config", "--performance-mode",
    "--pipeline-parallel-size", "--pooler-config", "--port", "--prefill-context-parallel-size",
    "--prefill-schedule-interval", "--prefix-caching-hash-algo", "--prefix-match-unit",
    "--profiler-config", "--pt-load-map-location", "--quantization", "--quantization-config",
    "--ray-workers-use-nsight", "--reasoning-config", "--reasoning-parser",
    "--reasoning-parser-plugin", "--renderer-num-workers", "--response-role",
    "--return-tokens-as-token-ids", "--revision", "--root-path", "--runner",
    "--safetensors-load-strategy", "--safetensors-prefetch-block-size",
    "--safetensors-prefetch-num-threads", "--scheduler-cls", "--scheduler-reserve-full-isl",
    "--scheduling-policy", "--seed", "--served-model-name", "--show-hidden-metrics-for-version",
    "--shutdown-timeout", "--skip-mm-profiling", "--skip-tokenizer-init", "--spec-method",
    "--spec-model", "--spec-tokens", "--specialize-active-lora", "--speculative-config",
    "--ssl-ca-certs", "--ssl-cert-reqs", "--ssl-certfile", "--ssl-ciphers", "--ssl-keyfile",
    "--stream-interval", "--structured-outputs-config", "--tensor-parallel-size", "--tokenizer",
    "--tokenizer-mode", "--tokenizer-revision", "--tokens-only", "--tool-call-parser",
    "--tool-parser-plugin", "--tool-server", "--trust-remote-code",
    "--trust-request-chat-template", "--ubatch-size", "--uds", "--use-fp64-gumbel",
    "--use-tqdm-on-load", "--uvicorn-log-level", "--video-pruning-rate", "--watermark",
    "--weight-transfer-config", "--worker-cls", "--worker-extension-cls",
})

# Short forms vLLM gives some options (``-tp`` is ``--tensor-parallel-size``, ...).
VLLM_SHORT_OPTIONS = frozenset({
    "-ac", "-asc", "-cc", "-dc", "-dcp", "-dp", "-dpa", "-dpb", "-dpe", "-dph", "-dpl", "-dpm",
    "-dpn", "-dpp", "-dpr", "-ep", "-n", "-pcp", "-pp", "-q", "-r", "-sc", "-tp",
})


def vllm_option(token: str) -> str | None:
    """The vLLM option a command-line ``token`` names (``--x``, ``--x=v``, ``--no-x``, ``-tp``),
    or None."""
    name = token.split("=", 1)[0]
    if name in VLLM_SERVE_OPTIONS or name in VLLM_SHORT_OPTIONS:
        return name
    if name.startswith("--no-") and "--" + name[5:] in VLLM_SERVE_OPTIONS:
        return name
    return None
