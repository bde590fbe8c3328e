# Device call 7 (carry: .fa4/small .fa4/part-b .fa4/install-fa4.sh; after call 6 on the same
# held machine; FA4's wheels and second part are stored for call 8): the FP8
# prefill sweep with the one-pass dequantising route (edmm.kernels.kv_dequant, new), FP8 KV
# against BF16 KV at the model level with the FP8 prefill config of e0d59da (the pipelined
# 128x128 kernel, fastest of the 2026-12-07 sweep), and the FP8 GPU tests on it. Packed after
# each step.
source benchmarks/device/lib.sh
R=/tmp/res7; mkdir -p $R
bash .fa4/install-fa4.sh .fa4 | tail -1  # stores the small wheels and part b
timeout 100 python3 -m benchmarks.kernels.attention --fp8-prefill-sweep --reps 30 \
    --out $R/fp8-prefill 2>&1 | tail -14
pack res7 call7
timeout 120 python3 -m edmm bench ttft --only model --device cuda --contexts 16384 \
    --decode-batch 1,32 --repeats 5 --full-prefill-repeats 2 --full-prefill-chunk 2048 \
    --no-peer --kv-cache-dtype auto --out $R/model-bf16 2>&1 | tail -4
timeout 120 python3 -m edmm bench ttft --only model --device cuda --contexts 16384 \
    --decode-batch 1,32 --repeats 5 --full-prefill-repeats 2 --full-prefill-chunk 2048 \
    --no-peer --kv-cache-dtype fp8 --out $R/model-fp8 2>&1 | tail -4
timeout 150 python3 -m pytest -m gpu tests/gpu/test_fp8_kv_gpu.py tests/gpu/test_kernels_gpu.py \
    -q -rs -p no:cacheprovider 2>&1 | tee $R/gpu-tests-fp8.txt | tail -5
pack res7 call7
