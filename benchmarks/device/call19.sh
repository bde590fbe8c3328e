# Device call 19 (carry: .carry/wheels; a fresh machine, short of device time): EDMM's HTTP
# fleet without vLLM. The web stack, the openai SDK the fleet's clients need (carried in
# .carry/wheels/web since 2026-12-07: before, only vLLM's bundle brought it) and the model
# folder, then call 15's point with EDMM alone (LOAD default 32, JOBS 64, T_FLEET 400). Call
# 18 right after it runs the same point in process. Its rows hold against vLLM's only when
# vLLM ran in the same call or on the same held machine (call 17).
source benchmarks/device/lib.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
install_web /tmp/installed.txt
python3 .carry/wheels/smoke.py --only-model-dir 2>&1 | tail -1  # /tmp/qwen25-7b-dummy
LOAD=${LOAD:-32} JOBS=${JOBS:-64} POLICIES=edmm PEERS= T_FLEET=${T_FLEET:-400} \
    bash benchmarks/device/call15.sh
