# Device call 11 (carry nothing; after call 10 on the same held machine): the fleet of call 10
# (EDMM and vLLM APC) at 16 concurrent sessions, merged with call 10's load point (edmm bench
# agents-merge: all-turn knees, the peer targets, plots).
source benchmarks/device/lib.sh
R=/tmp/res11; mkdir -p $R
timeout 560 python3 -m benchmarks.scripts.fleet_http_peers --out $R/fleet --loads 16 \
    --peers vllm --merge-also /tmp/res10/fleet/load-8 $FLEET_ARGS 2>&1 \
    | grep -v "^\[\|^INFO\|^(APIServer\|^(EngineCore" | tail -30
pack res11 call11
