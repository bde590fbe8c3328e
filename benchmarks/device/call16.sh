# Device call 16 (carry: .carry/half00 .carry/wheels; a fresh machine): call 9's setup without
# its measurements (vLLM's first half stored for call 17, edmm serve's web stack, the model
# folder), the GPU tests (GPU_TESTS=0: none; ~3 minutes), then one fleet point of call 15
# chosen by the same environment (LOAD, JOBS, POLICIES; T_FLEET its limit, default 330 after
# the tests, 510 without). For a session short of device time.
source benchmarks/device/lib.sh
mkdir -p /tmp/vp; cp .carry/half00 /tmp/vp/ &
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
install_web /tmp/installed.txt
python3 .carry/wheels/smoke.py --only-model-dir 2>&1 | tail -1  # /tmp/qwen25-7b-dummy
wait
[ $GPU_TESTS = 1 ] && gpu_tests /tmp/res15-gpu-tests.txt && mkdir -p /tmp/res15 \
    && cp /tmp/res15-gpu-tests.txt /tmp/res15/gpu-tests.txt
T_FLEET=${T_FLEET:-$([ $GPU_TESTS = 1 ] && echo 330 || echo 510)} bash benchmarks/device/call15.sh
