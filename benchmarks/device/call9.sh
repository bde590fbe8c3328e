# Device call 9 (carry: .carry/half00 .carry/wheels; a fresh machine): the first half of vLLM's
# wheel stored (call 2 joins it, call 10 installs vLLM), edmm serve's web stack and the model
# folder (as call 1), the GPU tests on this tree, 8K prompts on another request's 6K prefix
# over HTTP at 1 / 8 / 32 requests with prefix spares on and off and the server's stage log
# (edmm bench load --stages; alone, TTFT 74.1 ms on bb826a6, vLLM's 69.4 on 8f38092), then the
# shared and a fresh 8K prompt in process (call 6's profiles, without its decode half).
# Packed after each step: a call cut short keeps the steps before. PROFILES=0 skips the
# profiles (~3 minutes).
source benchmarks/device/lib.sh
R=/tmp/res9; mkdir -p $R /tmp/vp; cp .carry/half00 /tmp/vp/ &
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/device.txt
echo "${EDMM_GIT_COMMIT:-unknown, EDMM_GIT_COMMIT not given}" | tee $R/tree.txt
install_web $R/installed.txt
python3 .carry/wheels/smoke.py --only-model-dir 2>&1 | tail -1  # /tmp/qwen25-7b-dummy
[ $GPU_TESTS = 1 ] && gpu_tests $R/gpu-tests.txt
wait; pack res9 call9
# spares of the shared prefix (prefix_spares, d8f8ff1) on and off, 8K prompts 75% shared
for S in prefix-spares no-prefix-spares; do
  timeout 120 python3 -m edmm bench load --edmm-args "$E --$S" --edmm-name "EDMM --$S" \
      --prompt-tokens 8192 --output-tokens 8 --concurrency 1,8,32 --prefixes shared \
      --min-requests 16 --rounds 1 --stages --out $R/$S 2>&1 | tail -1
done
pack res9 call9
[ ${PROFILES:-1} = 1 ] || exit 0  # PROFILES=0: the in-process profiles skipped
timeout 120 python3 -m benchmarks.scripts.prefill_step_profile --prompts 8192 --batches 1,8 \
    --repeats 3 --shared-fraction 0.75 --out $R/prefill-8k-shared 2>&1 | grep -v "^ \|USDT"
timeout 100 python3 -m benchmarks.scripts.prefill_step_profile --prompts 8192 --batches 1 \
    --repeats 3 --out $R/prefill-8k-fresh 2>&1 | grep -v "^ \|USDT"
pack res9 call9
