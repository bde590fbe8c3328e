# Call 1: the 2x knee on a 128-job trace (offload, edmm at 64, 80, 96, 128 sessions).
set -u
export PYTHONPATH=.
R=/tmp/s21; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/env.txt
python3 -c "import torch; print(torch.__version__)" >> $R/env.txt
A="python3 -m edmm bench agents --model qwen2.5-7b --device cuda --dtype bfloat16 --jobs 128 --turns 3,4 --token-scale 0.25 --time-scale 0.1 --max-num-seqs 64 --graph-sizes 256,512,1024,2048 --no-checks --lean --oversub 2"
timeout 570 $A --policies edmm,offload --loads 64,80,96,128 --out $R/knee128 > $R/knee128.log 2>&1; echo "knee128 rc $?"
python3 -c "import json,sys; [print(r['policy'], r['load'], r['wait_mean_s'], r['resume_ttft_p90_ms']) for r in json.load(open(sys.argv[1]))['summary']]" $R/knee128/agents.json
tar czf $OUT/call1.tgz -C $R env.txt knee128 knee128.log
