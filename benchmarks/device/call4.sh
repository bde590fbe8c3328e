# Device call 4 (carry nothing): the agent fleet over HTTP against vLLM APC and vLLM + offload,
# then single requests at 16K through one client: EDMM, vLLM APC and vLLM + OffloadingConnector
# (A appended, B inserted, full prefill, HTTP floor, decode). Packed after each step.
source benchmarks/device/lib.sh
R=/tmp/res4; mkdir -p $R
timeout 270 python3 -m benchmarks.scripts.fleet_http_peers --out $R/fleet --loads 3 --budget-s 200 2>&1 | tail -15
pack res4 call4
timeout 280 python3 -m edmm bench single --edmm-args "$E" --peer-model-dir /tmp/qwen25-7b-dummy \
    --peer vllm --peer vllm-offload --contexts 16384 --repeats 5 --decode-tokens 128 \
    --out $R/single 2>&1 | grep "ms\|rror"
pack res4 call4
