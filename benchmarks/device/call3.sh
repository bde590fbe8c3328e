# Device call 3 (carry: .vllm/part-2 .vllm/install-vllm.sh .vllm/MANIFEST): vLLM installed, then
# vLLM's load curve (the same client and levels as EDMM's in call 1), then the GPU tests. Each
# bench stopped by its timeout keeps its rows (load-rows.jsonl) and stops its server; the
# results are packed after each step.
R=/tmp/res3; mkdir -p $R
bash .vllm/install-vllm.sh .vllm 2>&1 | tail -1
source benchmarks/device/lib.sh
timeout $T_VLLM python3 -m edmm bench load $L --no-edmm --peer-model-dir /tmp/qwen25-7b-dummy \
    --peer vllm --out $R/load-vllm 2>&1 | grep "tok/s\|rror"
pack res3 call3
[ $GPU_TESTS = 1 ] && gpu_tests $R/gpu-tests.txt
pack res3 call3
