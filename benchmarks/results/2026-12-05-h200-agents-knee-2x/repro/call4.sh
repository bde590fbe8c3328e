# Call 4: the open loop (Poisson arrivals, pool sized for 16 sessions at 2x) at 5, 6 and 7 jobs/s (between call 3's 4 and 8).
set -u
export PYTHONPATH=.
R=/tmp/s21; mkdir -p $R
A="python3 -m edmm bench agents --model qwen2.5-7b --device cuda --dtype bfloat16 --jobs 64 --turns 3,4 --token-scale 0.25 --time-scale 0.1 --max-num-seqs 64 --graph-sizes 256,512,1024,2048 --no-checks --lean --oversub 2 --mode open"
timeout 560 $A --loads 5,6,7 --policies edmm,offload,lru --out $R/open567 > $R/open567.log 2>&1; echo "open rc $?"
python3 -c "import json,sys; [print(r['policy'], r['load'], r['wait_mean_s'], r['resume_ttft_p90_ms']) for r in json.load(open(sys.argv[1]))['summary']]" $R/open567/agents.json
tar czf $OUT/call3.tgz -C $R open567 open567.log
