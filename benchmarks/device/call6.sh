# Device call 6 (carry: .carry/wheels .fa4/part-a .fa4/install-fa4.sh; a fresh machine, no vLLM
# needed; FA4's first part is stored for call 8): where EDMM's time goes
# where vLLM 0.26.0 was ahead on 2026-12-07 (benchmarks/results/2026-12-07-h100-vs-vllm-load-
# single-live): (1) an 8K prompt whose first 6,144 tokens are another request's (TTFT 96.7 ms
# against vLLM's 69.4), profiled in process beside a fresh 8K prompt; (2) the decode step at
# batch 1-32 in process, to set beside `edmm bench single`'s over HTTP (6.83 ms a token at
# batch 32 against vLLM's 6.33: is the gap the HTTP front end's share of the interpreter?).
# Packed after each step.
source benchmarks/device/lib.sh
R=/tmp/res6; mkdir -p $R
bash .fa4/install-fa4.sh .fa4 | tail -1  # stores part a
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/device.txt
echo "${EDMM_GIT_COMMIT:-unknown, EDMM_GIT_COMMIT not given}" | tee $R/tree.txt
install_web $R/installed.txt
python3 .carry/wheels/smoke.py --only-model-dir 2>&1 | tail -1  # /tmp/qwen25-7b-dummy
timeout 130 python3 -m benchmarks.scripts.prefill_step_profile --prompts 8192 --batches 1,8 \
    --repeats 3 --shared-fraction 0.75 --out $R/prefill-8k-shared 2>&1 | grep -v "^ \|USDT"
timeout 110 python3 -m benchmarks.scripts.prefill_step_profile --prompts 8192 --batches 1 \
    --repeats 3 --out $R/prefill-8k-fresh 2>&1 | grep -v "^ \|USDT"
pack res6 call6
timeout 130 python3 -m edmm bench ttft --only model --device cuda --contexts 1024 \
    --decode-batch 1,8,32,64 --repeats 10 --full-prefill-repeats 1 --no-peer \
    --out $R/model-1k 2>&1 | tail -6
timeout 150 python3 -m edmm bench single --edmm-args "$E" --contexts 1024 --repeats 3 \
    --decode-tokens 128 --out $R/single-1k 2>&1 | grep "ms\|rror"
pack res6 call6
