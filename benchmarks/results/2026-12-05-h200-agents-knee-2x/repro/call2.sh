# Call 2: the same 128-job trace below 64 sessions (lru 24-48; edmm, offload 32-48); 1x at 32 sessions on the 64-job trace
# (lru twice, to compare output digests of a repeat, and edmm).
set -u
export PYTHONPATH=.
R=/tmp/s21; mkdir -p $R
B="python3 -m edmm bench agents --model qwen2.5-7b --device cuda --dtype bfloat16 --turns 3,4 --token-scale 0.25 --time-scale 0.1 --max-num-seqs 64 --graph-sizes 256,512,1024,2048 --no-checks --lean"
timeout 200 $B --jobs 128 --oversub 2 --policies lru --loads 24,32,48 --out $R/knee128-lru > $R/knee128-lru.log 2>&1; echo "lru rc $?"
timeout 200 $B --jobs 128 --oversub 2 --policies edmm,offload --loads 32,48 --out $R/knee128-48 > $R/knee128-48.log 2>&1; echo "48 rc $?"
timeout 100 $B --jobs 64 --oversub 1 --policies lru,edmm --loads 32 --out $R/x1-a > $R/x1-a.log 2>&1; echo "x1-a rc $?"
timeout 60 $B --jobs 64 --oversub 1 --policies lru --loads 32 --out $R/x1-b > $R/x1-b.log 2>&1; echo "x1-b rc $?"
for f in $R/knee128-lru $R/knee128-48 $R/x1-a $R/x1-b; do python3 -c "import json,sys; [print(sys.argv[1][-12:], r['policy'], r['load'], r['wait_mean_s'], r['resume_ttft_p90_ms'], r.get('outputs_digest')) for r in json.load(open(sys.argv[1]+'/agents.json'))['summary']]" $f; done
tar czf $OUT/call2.tgz -C $R knee128-lru knee128-48 x1-a x1-b knee128-lru.log knee128-48.log x1-a.log x1-b.log
