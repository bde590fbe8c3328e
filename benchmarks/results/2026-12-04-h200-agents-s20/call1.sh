# Call 1: GPU tests of the memory layer and agent bench, the VMM per-page costs, two 2x repeats.
set -u
export PYTHONPATH=.
R=/tmp/s20; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/env.txt
python3 -c "import torch; print(torch.__version__)" >> $R/env.txt
git log -1 --format=%h >> $R/env.txt 2>/dev/null
timeout 200 python3 -m pytest -m gpu -q -rs tests/memory/test_vmm.py tests/gpu/test_cuda_arena.py \
  tests/gpu/test_copy_stream_gpu.py tests/gpu/test_agents_bench_gpu.py > $R/gpu-tests.log 2>&1
echo "gpu tests rc $?" >> $R/gpu-tests.log; tail -3 $R/gpu-tests.log
timeout 60 python3 -m edmm bench vmm --backend cuda --contexts 16384 --repeats 10 --pages 57 --out $R/vmm > $R/vmm.log 2>&1
echo "vmm rc $?"; grep -i "unmap" $R/vmm/vmm-cuda.md | head
A="python3 -m edmm bench agents --model qwen2.5-7b --device cuda --dtype bfloat16 --jobs 64 --turns 3,4 --token-scale 0.25 --time-scale 0.1 --max-num-seqs 64 --graph-sizes 256,512,1024,2048 --no-checks --lean --loads 24 --oversub 2"
$A --policies lru,offload,edmm --out $R/x2a > $R/x2a.log 2>&1; echo "x2a rc $?"
$A --policies edmm,offload,lru --out $R/x2b > $R/x2b.log 2>&1; echo "x2b rc $?"
for f in $R/x2*/agents.json; do python3 -c "import json,sys; [print(r['policy'], r['wait_mean_s'], r['resume_ttft_p90_ms']) for r in json.load(open(sys.argv[1]))['summary']]" $f; done
tar czf $OUT/call1.tgz -C $R .
