# Device call 16 (carry: .carry/half00 .carry/wheels; a fresh machine, short of device time):
# call 9's setup without its measurements (vLLM's first half stored for call 2, edmm serve's
# web stack, the model folder), a step's grammar masks timed on its CPUs, then the GPU tests
# (GPU_TESTS=0: none; ~3 minutes). No fleet here: the fleet's client processes need the
# openai SDK, which only vLLM's bundle brings (a fleet run before call 17 installed it failed
# on 2026-12-07).
source benchmarks/device/lib.sh
mkdir -p /tmp/vp; cp .carry/half00 /tmp/vp/ &
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
install_web /tmp/installed.txt
python3 .carry/wheels/smoke.py --only-model-dir 2>&1 | tail -1  # /tmp/qwen25-7b-dummy
wait
mkdir -p /tmp/res16
python3 -m benchmarks.scripts.grammar_masks --tokenizer /tmp/qwen25-7b-dummy \
    --out /tmp/res16/grammar-masks.md
[ $GPU_TESTS = 1 ] && gpu_tests /tmp/res16/gpu-tests.txt
pack res16 call16
