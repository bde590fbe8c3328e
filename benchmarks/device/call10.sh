# Device call 10 (carry: .vllm/part-2 .vllm/install-vllm.sh .vllm/MANIFEST; after calls 9 and 2
# on the same held machine): vLLM installed, then the agent fleet over HTTP (issue 45) at 8
# concurrent sessions, 2x oversubscribed KV: edmm serve and vLLM APC on one trace, seed and KV
# memory (call 13: vLLM + OffloadingConnector, which does not fit this call too: vLLM starts in
# ~110 s; call 11: 16 sessions). Packed at the end (a fleet stopped by its timeout keeps the
# engines it finished).
R=/tmp/res10; mkdir -p $R
bash .vllm/install-vllm.sh .vllm 2>&1 | tail -1
source benchmarks/device/lib.sh
timeout 530 python3 -m benchmarks.scripts.fleet_http_peers --out $R/fleet --loads 8 \
    --peers vllm $FLEET_ARGS 2>&1 | grep -v "^\[\|^INFO\|^(APIServer\|^(EngineCore" | tail -30
pack res10 call10
