# Device call 5 (carry nothing; vLLM installed by call 3 on the same held machine): the FP8-KV
# prefill kernel's tile shapes beside BF16 and a dequantising route (issue 46's prefill target),
# then the A/B/C resume groups through the openai SDK (`edmm bench live`): EDMM's A, B and C, then vLLM APC's
# and vLLM + OffloadingConnector's A and B with the same conversations, at 4K and 16K, beside
# the seed's vLLM 0.6.6 figures. Packed at the end (the bench rewrites its tables after each
# context, so a run stopped by its timeout keeps what it finished).
source benchmarks/device/lib.sh
R=/tmp/res5; mkdir -p $R
timeout 100 python3 -m benchmarks.kernels.attention --fp8-prefill-sweep --reps 30 \
    --out $R/fp8-prefill 2>&1 | tail -14
pack res5 call5
timeout 440 python3 -m edmm bench live --model /tmp/qwen25-7b-dummy --device cuda \
    --server-arg=--load-format=dummy --server-arg=--dtype=bfloat16 --contexts 4096,16384 \
    --result-tokens 512 --iterations 6 --warmup 1 --modes stream,raw \
    --peer vllm --peer vllm-offload --peer-model-dir /tmp/qwen25-7b-dummy \
    --out $R/live 2>&1 | grep -v "^\[live\]" | tail -25
pack res5 call5
