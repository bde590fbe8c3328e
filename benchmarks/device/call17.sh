# Device call 17 (carry: .vllm/part-2 .vllm/install-vllm.sh .vllm/MANIFEST; after calls 16 (or
# 9) and 2 on the same held machine: their carries and this one's pass 64 MiB together):
# vLLM installed, then one fleet point of call 15 chosen by the environment (default here:
# EDMM and vLLM APC, POLICIES=edmm PEERS=vllm; LOAD, JOBS; T_FLEET default 520).
bash .vllm/install-vllm.sh .vllm 2>&1 | tail -1
POLICIES=${POLICIES:-edmm} PEERS=${PEERS:-vllm} T_FLEET=${T_FLEET:-520} \
    bash benchmarks/device/call15.sh
