# Call 3: function timers at 2x (edmm, offload), and the open loop (Poisson arrivals) at 2 and 4 jobs/s.
set -u
export PYTHONPATH=.
R=/tmp/s20; mkdir -p $R
P=benchmarks/results/2026-12-04-h200-agents-pinned-host/profile_calls.py
A="bench agents --model qwen2.5-7b --device cuda --dtype bfloat16 --jobs 64 --turns 3,4 --token-scale 0.25 --time-scale 0.1 --max-num-seqs 64 --graph-sizes 256,512,1024,2048 --no-checks --lean --oversub 2"
for p in edmm offload; do timeout 120 python3 $P $A --loads 24 --policies $p --out $R/prof-$p > $R/profile-$p.txt 2>&1; echo "prof $p rc $?"; done
head -30 $R/profile-edmm.txt | tail -24
timeout 300 python3 -m edmm $A --mode open --loads 2,4 --policies lru,offload,edmm --out $R/open > $R/open.log 2>&1; echo "open rc $?"
python3 -c "import json,sys; [print(r['policy'], r['load'], r['wait_mean_s'], r['resume_ttft_p90_ms']) for r in json.load(open(sys.argv[1]))['summary']]" $R/open/agents.json
tar czf $OUT/call3.tgz -C $R profile-edmm.txt profile-offload.txt prof-edmm prof-offload open open.log
