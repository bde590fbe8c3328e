# Device call 8 (carry: .fa4/part-c .fa4/install-fa4.sh; after calls 6 and 7 on the same held
# machine, which stored FA4's other parts): FlashAttention-4 installed (../shared/device/
# install-fa4.sh), its GPU tests, FA4 against EDMM's Triton prefill in process, and a single
# 16K request over HTTP with FA4 (serve's `auto` attention takes it once it imports). vLLM's
# FA3 beside it needs vLLM on the same machine (calls 2-3 first): then set
# PEERS="--peer vllm --peer-model-dir /tmp/qwen25-7b-dummy". Packed after each step.
source benchmarks/device/lib.sh
R=/tmp/res8; mkdir -p $R
bash .fa4/install-fa4.sh .fa4 | tail -1  # the third part: joined, checked, installed
export PYTHONPATH=$PYTHONPATH:/tmp/site/nvidia_cutlass_dsl/dsl_packages
timeout 150 python3 -m pytest -m gpu tests/gpu/test_fa4_gpu.py tests/gpu/test_model_gpu.py \
    -q -rs -p no:cacheprovider 2>&1 | tee $R/gpu-tests-fa4.txt | tail -5
pack res8 call8
timeout 150 python3 -m edmm bench ttft --only model --device cuda --contexts 16384 \
    --attention fa4,triton --decode-batch 1 --repeats 5 --full-prefill-repeats 2 \
    --full-prefill-chunk 2048 --no-peer --out $R/model-fa4-triton 2>&1 | tail -6
pack res8 call8
timeout 200 python3 -m edmm bench single --edmm-args "$E" $PEERS --contexts 16384 --repeats 5 \
    --decode-tokens 128 --out $R/single-fa4 2>&1 | grep "ms\|rror"
pack res8 call8
