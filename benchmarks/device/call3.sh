# Device call 3 (carry: .vllm/part-2 .vllm/install-vllm.sh .vllm/MANIFEST): vLLM installed, the
# model folder both engines load, then the load curve of EDMM and of vLLM (each bench stopped
# by its timeout keeps its rows in load-rows.jsonl and stops its server).
export PYTHONUNBUFFERED=1
R=/tmp/res; mkdir -p $R
bash .vllm/install-vllm.sh .vllm 2>&1 | tail -1
export PYTHONPATH=.:/tmp/site HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0
python3 /tmp/vllm-wheels/smoke.py --only-model-dir 2>&1 | tail -1
pack() { nvidia-smi --query-compute-apps=pid --format=csv,noheader | xargs -r kill -9; (cd /tmp && tar czf $OUT/call3.tgz res); }
E="--model /tmp/qwen25-7b-dummy --load-format dummy --device cuda --dtype bfloat16"
L="--prompt-tokens 2048,8192 --output-tokens 256 --concurrency 1,8,32,64 --prefixes fresh,shared --rounds 1"
timeout 240 python3 -m edmm bench load $L --edmm-args "$E" --out $R/load-edmm 2>&1 | grep "tok/s\|rror"
pack
timeout 270 python3 -m edmm bench load $L --no-edmm --peer-model-dir /tmp/qwen25-7b-dummy \
    --peer vllm --out $R/load-vllm 2>&1 | grep "tok/s\|rror"
pack
