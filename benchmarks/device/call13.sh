# Device call 13 (carry nothing; after call 10 on the same held machine, vLLM installed): the
# fleet of calls 10-11 against vLLM + OffloadingConnector alone at $LOAD sessions (default 8),
# to merge with their EDMM and vLLM APC (a load point of three engines does not fit one call:
# vLLM starts in ~110 s each time).
source benchmarks/device/lib.sh
R=/tmp/res13; mkdir -p $R
timeout 450 python3 -m benchmarks.scripts.fleet_http_peers --out $R/fleet --loads ${LOAD:-8} \
    --peers vllm-offload --policies none $FLEET_ARGS 2>&1 \
    | grep -v "^\[\|^INFO\|^(APIServer\|^(EngineCore" | tail -12
pack res13 call13
