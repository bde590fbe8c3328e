# Call 7: the short-tool mix (every tool under a second) at 2x, 32 sessions: offload and edmm,
# after session 19's pinned-host fix (last measured in session 11, before it).
set -u
export PYTHONPATH=.
R=/tmp/s21; mkdir -p $R
timeout 150 python3 -m edmm bench agents --model qwen2.5-7b --device cuda --dtype bfloat16 --jobs 64 --turns 3,4 --token-scale 0.25 --time-scale 0.1 --max-num-seqs 64 --graph-sizes 256,512,1024,2048 --no-checks --lean --oversub 2 --mix short --loads 32 --policies offload,edmm --out $R/short > $R/short.log 2>&1; echo "short rc $?"
python3 -c "import json,sys; [print(r['policy'], r['tools'], r['load'], r['wait_mean_s'], r['resume_ttft_p90_ms']) for r in json.load(open(sys.argv[1]))['summary']]" $R/short/agents.json
tar czf $OUT/call7.tgz -C $R short short.log
