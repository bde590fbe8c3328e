# Device call 17 (carry: .carry/half01 .vllm/part-2 .vllm/install-vllm.sh .vllm/MANIFEST, 59
# MiB; after call 16 or 9 on the same held machine): call 2's join and call 10's install of
# vLLM in one call, then one fleet point of call 15 by the environment (default here: vLLM
# APC alone, POLICIES=none PEERS=vllm; T_FLEET default 480).
bash benchmarks/device/call2.sh
bash .vllm/install-vllm.sh .vllm 2>&1 | tail -1
POLICIES=${POLICIES:-none} PEERS=${PEERS:-vllm} T_FLEET=${T_FLEET:-480} \
    bash benchmarks/device/call15.sh
