# Call 6: a repeat of the 128-job knee's 48 and 64 sessions, policies in the other order.
# (Call 5 was the GPU tests: python3 -m pytest -m gpu tests --ignore=... , see gpu-tests.log.)
set -u
export PYTHONPATH=.
R=/tmp/s21; mkdir -p $R
A="python3 -m edmm bench agents --model qwen2.5-7b --device cuda --dtype bfloat16 --jobs 128 --turns 3,4 --token-scale 0.25 --time-scale 0.1 --max-num-seqs 64 --graph-sizes 256,512,1024,2048 --no-checks --lean --oversub 2"
timeout 380 $A --policies offload,edmm --loads 48,64 --out $R/knee128-rep > $R/knee128-rep.log 2>&1; echo "rep rc $?"
python3 -c "import json,sys; [print(r['policy'], r['load'], r['wait_mean_s'], r['resume_ttft_p90_ms']) for r in json.load(open(sys.argv[1]))['summary']]" $R/knee128-rep/agents.json
tar czf $OUT/call6.tgz -C $R knee128-rep knee128-rep.log
