# Call 2: the 2x knee sweep (lru, offload, edmm at 32, 48 and 64 sessions).
set -u
export PYTHONPATH=.
R=/tmp/s20; mkdir -p $R
A="python3 -m edmm bench agents --model qwen2.5-7b --device cuda --dtype bfloat16 --jobs 64 --turns 3,4 --token-scale 0.25 --time-scale 0.1 --max-num-seqs 64 --graph-sizes 256,512,1024,2048 --no-checks --lean --oversub 2"
timeout 560 $A --policies offload,edmm,lru --loads 32,48,64 --out $R/knee > $R/knee.log 2>&1; echo "knee rc $?"
python3 -c "import json,sys; [print(r['policy'], r['load'], r['wait_mean_s'], r['resume_ttft_p90_ms']) for r in json.load(open(sys.argv[1]))['summary']]" $R/knee/agents.json
tar czf $OUT/call2.tgz -C $R knee knee.log
