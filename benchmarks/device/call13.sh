# Device call 13 (carry nothing; after call 10 on the same held machine, vLLM installed): the
# fleet of call 10 at 8 sessions against vLLM + OffloadingConnector alone (call 10's limit cut
# it on 2026-12-07: vLLM starts in ~110 s each time), to merge with call 10's EDMM and vLLM APC.
source benchmarks/device/lib.sh
R=/tmp/res13; mkdir -p $R
timeout 450 python3 -m benchmarks.scripts.fleet_http_peers --out $R/fleet --loads 8 \
    --peers vllm-offload --policies none $FLEET_ARGS 2>&1 \
    | grep -v "^\[\|^INFO\|^(APIServer\|^(EngineCore" | tail -12
pack res13 call13
