# Device call 4 (carry nothing): the agent fleet over HTTP against vLLM APC and vLLM + offload,
# then single requests at 16K through one client: EDMM, vLLM APC and vLLM + OffloadingConnector
# (A appended, B inserted, full prefill, HTTP floor, decode). Packed after each step.
export PYTHONUNBUFFERED=1 PYTHONPATH=.:/tmp/site HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0
R=/tmp/res4; mkdir -p $R
E="--model /tmp/qwen25-7b-dummy --load-format dummy --device cuda --dtype bfloat16"
pack() { nvidia-smi --query-compute-apps=pid --format=csv,noheader | xargs -r kill -9; (cd /tmp && tar czf $OUT/call4.tgz res4); }
timeout 270 python3 -m benchmarks.scripts.fleet_http_peers --out $R/fleet --loads 3 --budget-s 200 2>&1 | tail -15
pack
timeout 280 python3 -m edmm bench single --edmm-args "$E" --peer-model-dir /tmp/qwen25-7b-dummy \
    --peer vllm --peer vllm-offload --contexts 16384 --repeats 5 --decode-tokens 128 \
    --out $R/single 2>&1 | grep "ms\|rror"
pack
