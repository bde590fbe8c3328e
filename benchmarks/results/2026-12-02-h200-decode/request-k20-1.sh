#!/usr/bin/env bash
# k20-1 (issue 20 item 3, branch k20): decode attention at batch 1 / 8 on the H200.
# Expected wall time: ~220 s (GPU tests ~60 s, sweep ~110 s of budget, parts ~40 s).
# Runs from the repo root of a tree with k20 merged; writes 6 files under $OUT/k20/.
set -u
export PYTHONPATH=.
O="$OUT/k20"
mkdir -p "$O" /tmp/k20
# 1. The decode kernels' GPU tests (new: balanced splits, TMA loads, in CUDA graphs, on a VMM
#    arena mapped only up to each context). They also compile most swept variants (disk cache).
timeout 110 python3 -m pytest -m gpu tests/gpu/test_kernels_gpu.py -k "decode or tma" -q -rA \
    -p no:cacheprovider > "$O/gpu-tests.txt" 2>&1
TESTS=$?
echo "exit $TESTS" >> "$O/gpu-tests.txt"
# 2. Sweep batch 1 and 8 at 4K/16K/32K: the committed routes' launch (reduce-pdl 64x2x3) first,
#    then balanced splits (b), TMA loads (t), both, and smaller tiles with more stages; split
#    counts 33/66/99/132 (x 4 KV heads = multiples of the 132 SMs) beside powers of two.
CONFIGS=64x2x3,64x2x3b,64x2x3t,64x2x3bt,32x2x4bt,64x4x3bt
if [ "$TESTS" != 0 ]; then  # a failing test: no TMA launch (a bad read would end the sweep)
    CONFIGS=64x2x3,64x2x3b,32x2x4b,64x4x3b
fi
echo "configs $CONFIGS (tests exit $TESTS)" > /tmp/k20/sweep.log
timeout 170 python3 -m edmm.bench.scripts.decode_sweep --out /tmp/k20/sweep --reps 10 \
    --budget-s 110 --batches 1,8 --contexts 4096,16384,32768 --modes reduce-pdl,fused-pdl \
    --configs "$CONFIGS" --splits 8,16,33,64,66,99,132 >> /tmp/k20/sweep.log 2>&1
echo "sweep exit $?" >> /tmp/k20/sweep.log
cp /tmp/k20/sweep/decode-sweep.md /tmp/k20/sweep/decode_routes.json "$O/"
# 3. Where the time goes at the sweep's routes, beside the streaming-read floors (arena views
#    and a contiguous buffer of the same bytes).
ROUTES=/tmp/k20/sweep/decode_routes.json
[ -s "$ROUTES" ] || ROUTES=edmm/kernels/decode_routes.json
timeout 120 python3 -m edmm.bench.scripts.decode_parts --out /tmp/k20/parts --routes "$ROUTES" \
    --reps 10 >> /tmp/k20/sweep.log 2>&1
echo "parts exit $?" >> /tmp/k20/sweep.log
cp /tmp/k20/parts/decode-parts.md "$O/"
tar -czf "$O/json.tar.gz" -C /tmp/k20 sweep/decode-sweep.json parts/decode-parts.json
tail -c 20000 /tmp/k20/sweep.log > "$O/log.txt"
